"""bench/learn.py (and bench/learn_trl.py) at a tiny size on CPU: the task, the metrics, the
records the GPU runs will write, the comparison with TRL, and the warm-up checkpoint as TRL loads it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.learn import GREEDY, accuracy_at, compare, mean_at, time_to_reach, val_metrics
from data.arith import answer, forgotten_carries, has_forgotten_carry, make_rows, operands, problem
from rewards.arith import compute_score
from tests.e2e.conftest import ROOT

DS = "meshppo/add_carry"


def test_task_format_and_slip_by_hand():
    assert problem(7, 358, 3) == "007+358=" and answer(365, 3) == "0365"
    # every carry between columns forgotten; the leftmost column written whole
    assert forgotten_carries(728, 196) == 814      # 8+6=14 -> 4, 2+9=11 -> 1, 7+1 -> 8
    assert forgotten_carries(95, 7) == 92
    assert forgotten_carries(999, 1) == 990
    assert forgotten_carries(512, 634) == 1146 == 512 + 634  # only the leftmost column carries
    assert forgotten_carries(0, 0) == 0
    assert has_forgotten_carry(728, 196) and not has_forgotten_carry(512, 634)
    rows = make_rows(50, 3, seed=0)
    assert len({operands(r) for r in rows}) == 50
    a, b = operands(rows[0])
    assert rows[0]["prompt"][0]["content"] == problem(a, b, 3)
    assert rows[0]["reward_model"]["ground_truth"] == answer(a + b, 3) and rows[0]["data_source"] == DS


def test_reward_by_hand():
    assert compute_score(DS, "0814", "0814") == 1.0
    assert compute_score(DS, " 0814\n", "0814") == 1.0
    for wrong in ("814", "0815", "08140", "0814+", "0814 1", ""):
        assert compute_score(DS, wrong, "0814") == 0.0, wrong
    with pytest.raises(ValueError, match="meshppo/add_carry"):
        compute_score("openai/gsm8k", "0814", "0814")


def test_mean_at_n_by_hand():
    greedy = [{"input": "p", "output": "1", "score": 1.0}, {"input": "q", "output": "22", "score": 0.0}]
    # prompt p: 1 of 3 right, prompt q: 2 of 3 right (rows in any order) -> (1/3 + 2/3) / 2
    sampled = [{"input": "p", "output": "1", "score": 1.0}, {"input": "q", "output": "1", "score": 1.0},
               {"input": "p", "output": "333", "score": 0.0}, {"input": "q", "output": "1", "score": 1.0},
               {"input": "p", "output": "22", "score": 0.0}, {"input": "q", "output": "22", "score": 0.0}]
    m = val_metrics(greedy, sampled, 3)
    assert m[GREEDY] == 0.5 and m[mean_at(3)] == pytest.approx(0.5)
    assert m["val/response_length_chars"] == pytest.approx(10 / 6)
    assert mean_at(8) == "val-core/meshppo/add_carry/acc/mean@8"
    with pytest.raises(ValueError, match="3 samples per prompt"):
        val_metrics(greedy, sampled[:-1], 3)


def _record(framework, pts):
    return {"framework": framework, "points": [{"samples": s, "train_wall_s": t, GREEDY: a} for s, t, a in pts]}


def test_compare_with_trl_by_hand():
    seeds = [_record("meshppo", [(0, 0, 0.3), (100, 10, 0.5), (200, 20, 0.9)]),
             _record("meshppo", [(0, 0, 0.3), (100, 10, 0.7), (200, 20, 0.8)]),
             _record("meshppo", [(0, 0, 0.3), (100, 10, 0.6), (200, 20, 0.7)])]
    assert accuracy_at(seeds[0]["points"], 150) == pytest.approx(0.7)
    assert accuracy_at(seeds[0]["points"], 250) is None
    assert time_to_reach(seeds[1]["points"], 0.75) == 20 and time_to_reach(seeds[2]["points"], 0.75) is None
    trl = _record("trl", [(0, 0, 0.3), (150, 80, 0.75), (300, 160, 0.8)])
    c = compare(seeds, trl)
    # at 150 samples: seeds 0.7, 0.75, 0.65 -> mean 0.7, spread 0.1 >= 0.75 - 0.1; 300 is out of meshppo's range
    assert [r["samples"] for r in c["at_equal_samples"]] == [0, 150]
    assert c["at_equal_samples"][1]["meshppo_mean"] == pytest.approx(0.7)
    assert c["at_equal_samples"][1]["meshppo_spread"] == pytest.approx(0.1)
    assert c["equal_samples_ok"]
    # TRL's last accuracy 0.8 at 160 s; seeds reach it at 20 s, 20 s, never -> no median
    assert c["trl_wall_s_to_last"] == 160 and c["meshppo_wall_s_to_trl_last"] == [20, 20, None]
    assert c["wall_ratio_median"] is None
    # start + 0.3 = 0.6: TRL at 80 s (0.75 >= 0.6), the seeds at 20, 10, 10 s -> median 10 s
    assert c["trl_wall_s_to_gain"] == 80 and c["meshppo_wall_s_to_gain"] == [20, 10, 10]
    assert c["gain_wall_ratio_median"] == pytest.approx(10 / 80)
    c = compare(seeds[:2], trl)
    assert c["wall_ratio_median"] == pytest.approx(20 / 160)


BYPASS = "algorithm.rollout_correction.bypass_mode=true"  # a trainer override the records must show


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """Warm-up, two GRPO steps (bypass mode, by a trainer override) and the summary at the tiny size,
    in a subprocess (its own process group)."""
    work, out = tmp_path_factory.mktemp("learn_work"), tmp_path_factory.mktemp("learn_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--runs", "grpo:0", "--summarize",
                        "--work", str(work), "--out", str(out), "--trainer-override", BYPASS],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work, out, r.stdout


def test_learn_tiny_writes_records(tiny_bench):
    work, out, stdout = tiny_bench
    rec = json.loads((out / "grpo_0.json").read_text())
    assert rec["framework"] == "meshppo" and rec["algorithm"] == "grpo" and rec["samples_per_step"] == 8 * 4
    assert [p["step"] for p in rec["points"]] == [0, 1, 2] and [s["step"] for s in rec["steps"]] == [1, 2]
    for p in rec["points"]:
        assert p["samples"] == 32 * p["step"]
        assert 0 <= p[GREEDY] <= 1 and 0 <= p[mean_at(2)] <= 1
    walls = [p["train_wall_s"] for p in rec["points"]]
    assert walls[0] == 0 and walls == sorted(walls)
    for s in rec["steps"]:
        assert 0 <= s["reward"] <= 1 and s["kl"] >= -1e-6 and 1 <= s["response_length"] <= 5  # k3 >= 0
        phases = s["phases_s"]  # where the step went, phase by phase
        assert {"gen", "ref", "update_actor", "step"} <= phases.keys()
        assert "old_log_prob" not in phases  # the override took: bypass mode skips the recompute pass
        assert all(v >= 0 for v in phases.values()) and phases["step"] == s["step_s"]
    assert rec["greedy_gain"] == pytest.approx(rec["greedy_end"] - rec["greedy_start"])
    # the trainer's greedy validation before any step and the warm-up's teacher-forced greedy
    # check measure the same thing two ways (engine decoding vs argmax under teacher forcing)
    assert abs(rec["points"][0][GREEDY] - rec["warmup"]["greedy_acc"]) <= 1 / 64 + 1e-9
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["grpo_0"]["reached_target"] == rec["reached_target"]
    assert rec["trainer_overrides"] == summary["runs"]["grpo_0"]["trainer_overrides"] == [BYPASS]
    for png in ("curves_step.png", "curves_wall.png", "accuracy_samples.png"):
        assert (out / png).stat().st_size > 1000
    (warm,) = work.glob("warmup-*")
    assert warm.name == f"warmup-{rec['warmup']['hash']}" and (warm / "model.safetensors").is_file()


def test_warmup_is_reused_and_loads_in_transformers(tiny_bench):
    """A second call reuses the checkpoint; transformers (TRL's loader) gives our model's logits,
    and the tokenizer TRL is handed encodes the rendered prompt as the trainer's dataset does."""
    work, out, _ = tiny_bench
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--warmup-only", "--work", str(work),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0 and "reusing" in r.stdout, r.stdout + r.stderr
    from transformers import AutoModelForCausalLM

    from bench.learn import Encoder
    from models import Transformer
    from models.tokenizer import load_tokenizer

    (warm,) = work.glob("warmup-*")
    tok = load_tokenizer(str(warm))
    enc = Encoder(tok, 2)
    ids = enc.prompts([(7, 35)])[0]
    text = tok.apply_chat_template([{"role": "user", "content": problem(7, 35, 2)}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok(text)["input_ids"] == ids and tok.decode(ids) == "<|user|>07+35=<|assistant|>"
    assert enc.answers([42]) == [tok("042")["input_ids"] + [tok.eos_token_id]]
    x = torch.tensor([ids])
    ours = Transformer.from_pretrained(str(warm))(x)
    hf = AutoModelForCausalLM.from_pretrained(str(warm), dtype=torch.float32)(x).logits
    torch.testing.assert_close(hf, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_learn_trl_tiny(tiny_bench):
    """TRL's GRPOTrainer on the same warm-up checkpoint, 2 meshppo-sized steps (4 optimizer steps):
    the record has the schema `bench/learn.py --summarize` compares."""
    pytest.importorskip("trl")
    work, out, _ = tiny_bench
    r = subprocess.run([sys.executable, "bench/learn_trl.py", "--tiny", "--work", str(work), "--out", str(out),
                        "--minutes", "5"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((out / "trl.json").read_text())
    assert rec["framework"] == "trl" and rec["trl_args"]["beta"] == 0.01 and rec["trl_args"]["loss_type"] == "dapo"
    assert [p["step"] for p in rec["points"]] == [0, 1, 2] and [p["samples"] for p in rec["points"]] == [0, 32, 64]
    # same checkpoint, same validation prompts, greedy: the same accuracy before training
    meshppo = json.loads((out / "grpo_0.json").read_text())
    assert abs(rec["points"][0][GREEDY] - meshppo["points"][0][GREEDY]) <= 1 / 64 + 1e-9
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--summarize", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [row["samples"] for row in summary["vs_trl"]["at_equal_samples"]] == [0, 32, 64]
