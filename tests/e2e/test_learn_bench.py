"""bench/learn.py (and bench/learn_trl.py) at a tiny size on CPU: the tasks (the sum, and the
worked derivation), the metrics, the records the GPU runs will write, the comparison with TRL, and
the warm-up checkpoint as TRL loads it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.learn import (GREEDY, TINY, WORKED, Settings, _ratio, accuracy_at, compare, eval_grid, greedy_key, mean_at,
                         on_grid, seconds_per_step, settings_from, settings_parser, task_of, time_to_reach,
                         val_metrics)
from data.arith import (answer, data_source, forgotten_carries, has_forgotten_carry, make_rows, operands, problem,
                        response, response_chars, worked)
from data.demo import CHARACTERS, build_demo_tokenizer
from rewards.arith import compute_score, final_answer
from tests.e2e.conftest import ROOT

DS = "meshppo/add_carry"
WDS = "meshppo/add_carry_worked"


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


def test_worked_format_and_slip_by_hand():
    # per column, units first: digits, carry in, the column sum with 2 digits; then = and the sum
    assert worked(4728, 1196, 4) == "8+6+0=14 2+9+1=12 7+1+1=09 4+1+0=05=05924"  # 4728 + 1196 = 5924
    # the forgetful demonstrator writes every carry in as 0: 8+6=14 -> 4, 2+9=11 -> 1, 7+1 -> 8, 4+1 -> 5
    assert worked(4728, 1196, 4, forget=True) == "8+6+0=14 2+9+0=11 7+1+0=08 4+1+0=05=05814"
    assert forgotten_carries(4728, 1196, 4) == forgotten_carries(4728, 1196) == 5814
    assert worked(728, 196, 3, forget=True) == "8+6+0=14 2+9+0=11 7+1+0=08=0814"
    # a carry chain, right and forgotten
    assert worked(999, 1, 3) == "9+1+0=10 9+0+1=10 9+0+1=10=1000"
    assert worked(999, 1, 3, forget=True) == "9+1+0=10 9+0+0=09 9+0+0=09=0990"
    # no carry, or a carry out of the leftmost column alone: nothing to forget
    assert worked(1234, 4321, 4) == worked(1234, 4321, 4, forget=True) == "4+1+0=05 3+2+0=05 2+3+0=05 1+4+0=05=05555"
    assert worked(9000, 1000, 4) == worked(9000, 1000, 4, forget=True) == "0+0+0=00 0+0+0=00 0+0+0=00 9+1+0=10=10000"
    assert not has_forgotten_carry(9000, 1000, 4) and has_forgotten_carry(4728, 1196, 4)
    # columns of leading zeros are columns: the carry into one is forgotten too (06+08 -> 004, not 014)
    assert worked(6, 8, 2) == "6+8+0=14 0+0+1=01=014"
    assert worked(6, 8, 2, forget=True) == "6+8+0=14 0+0+0=00=004"
    assert forgotten_carries(6, 8, 2) == 4 and forgotten_carries(6, 8) == 14  # the sum format's demonstrator
    assert has_forgotten_carry(6, 8, 2) and not has_forgotten_carry(6, 8)
    assert response(4728, 1196, 4, "worked", forget=True) == worked(4728, 1196, 4, forget=True)
    assert response(728, 196, 3) == "0924" and response(728, 196, 3, "sum", forget=True) == "0814"
    # every answer has 10 * digits + 1 characters, all in the demo tokenizer's vocabulary
    assert response_chars(4, "worked") == len(worked(4728, 1196, 4)) == 41 and response_chars(3) == 4
    assert set(worked(4728, 1196, 4)) <= set(CHARACTERS)
    tok = build_demo_tokenizer()
    ids = tok(worked(4728, 1196, 4))["input_ids"]
    assert len(ids) == 41 and tok.unk_token_id not in ids
    # a column carries with probability 45/100: at 2 digits (one column below the leftmost) 45 % of
    # the problems have a carry to forget (1 - 0.55**3 = 83 % at 4 digits)
    assert sum(has_forgotten_carry(a, b, 2) for a in range(100) for b in range(100)) == 4500
    # the rows: the same pairs as the sum task's, the worked data source, the sum as ground truth
    rows, sum_rows = make_rows(20, 4, seed=0, task="worked"), make_rows(20, 4, seed=0)
    assert [operands(r) for r in rows] == [operands(r) for r in sum_rows]
    a, b = operands(rows[0])
    assert rows[0]["data_source"] == WDS == data_source("worked")
    assert rows[0]["prompt"][0]["content"] == problem(a, b, 4)
    assert rows[0]["reward_model"]["ground_truth"] == answer(a + b, 4)
    with pytest.raises(ValueError, match=r"\[0, 10\*\*4\)"):
        worked(10000, 1, 4)
    with pytest.raises(ValueError, match="unknown task 'long'"):
        make_rows(2, 4, seed=0, task="long")


def test_worked_reward_by_hand():
    right = "8+6+0=14 2+9+1=12 7+1+1=09 4+1+0=05=05924"
    assert final_answer(right) == "05924" and final_answer(" =12 \n") == "12" and final_answer("05924") is None
    assert compute_score(WDS, right, "05924") == 1.0
    assert compute_score(WDS, " " + right + "\n", "05924") == 1.0
    assert compute_score(WDS, right[:-6] + "= 05924 ", "05924") == 1.0
    # the slip: the demonstrator's consistent but wrong sum
    assert compute_score(WDS, worked(4728, 1196, 4, forget=True), "05924") == 0.0
    # only the final answer is scored: no work, or wrong work, before a right sum scores
    assert compute_score(WDS, "=05924", "05924") == 1.0
    assert compute_score(WDS, "8+6+0=13=05924", "05924") == 1.0
    # malformed: no =, nothing or more after the sum, the sum without its leading zero, truncated
    for wrong in ("", "05924", right + "=", right + " 1", right + "0", right[:-5] + "5924", right[:-2],
                  right[:-6], "8+6+0=14 2+9+1=12"):
        assert compute_score(WDS, wrong, "05924") == 0.0, wrong
    # the sum task's scorer wants the bare sum
    assert compute_score(DS, right, "05924") == 0.0 and compute_score(DS, "05924", "05924") == 1.0
    with pytest.raises(ValueError, match="add_carry_worked"):
        compute_score("openai/gsm8k", right, "05924")


def test_settings_by_hand():
    s = Settings()
    # the sum task's warm-up keeps its name (docs/results/learn_h200's checkpoint) and its response length
    assert s.task == "sum" and s.warmup_hash() == Settings(task="sum").warmup_hash() == "031e57a972"
    assert s.max_response_length == 8 and s.answer_tokens == 5 and s.context == 64
    w = Settings(task="worked", digits=4)
    assert w.warmup_hash() not in (s.warmup_hash(), Settings(digits=4).warmup_hash())
    # 41 characters + EOS, and 3 tokens of room; 12 + 42 + 3 fit in 64 positions
    assert (w.answer_tokens, w.max_response_length, w.prompt_tokens, w.context) == (42, 45, 12, 64)
    assert Settings(task="worked", digits=5).context == 128  # 14 + 52 + 3 = 69
    assert Settings(task="worked", digits=4, max_response_length=42).max_response_length == 42
    with pytest.raises(ValueError, match=r"--max-response-length=41: the worked task's answers at --digits 4 take 42"):
        Settings(task="worked", digits=4, max_response_length=41)
    with pytest.raises(ValueError, match=r"--max-response-length=53: .* give 42 to 52"):
        Settings(task="worked", digits=4, max_response_length=53)
    with pytest.raises(ValueError, match="--max-response-length=4"):
        Settings(max_response_length=4)
    with pytest.raises(ValueError, match="--task='long'"):
        Settings(task="long")
    with pytest.raises(ValueError, match="--prompts=65: must be a multiple of --mini-batch"):
        Settings(prompts=65)
    # the command line: --task worked brings WORKED's defaults, options override them, --tiny TINY's
    p = settings_parser("test")
    w = settings_from(p.parse_args(["--task", "worked"]))
    assert {k: getattr(w, k) for k in WORKED} == WORKED and w.max_response_length == 45 and w.slip == 0.7
    assert settings_from(p.parse_args(["--task", "worked", "--digits", "5"])).max_response_length == 55
    t = settings_from(p.parse_args(["--task", "worked", "--tiny"]))
    assert t.digits == TINY["digits"] == 2 and t.max_response_length == 21 + 1 + 3
    with pytest.raises(SystemExit, match="bench/learn.py: bad setting --max-response-length=20"):
        settings_from(p.parse_args(["--task", "worked", "--max-response-length", "20"]))


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
    # the worked task's records are keyed by its own data source
    m = val_metrics(greedy, sampled, 3, "worked")
    assert m["val-core/meshppo/add_carry_worked/acc/greedy"] == 0.5 == m[greedy_key("worked")]
    assert mean_at(8, "worked") == "val-core/meshppo/add_carry_worked/acc/mean@8" and GREEDY == greedy_key("sum")


def _record(framework, eval_every, pts, run="r", metric=GREEDY):
    """A run record with 100 samples per step, evaluated every `eval_every` steps at `pts`."""
    return {"framework": framework, "run": run, "samples_per_step": 100, "settings": {"eval_every": eval_every},
            "points": [{"samples": s, "train_wall_s": t, metric: a} for s, t, a in pts]}


def test_compare_with_trl_by_hand():
    # meshppo evaluates every step (100 samples), TRL every 2 steps, and once more where its budget stopped it
    seeds = [_record("meshppo", 1, [(0, 0, 0.3), (100, 10, 0.7), (200, 20, 0.8), (300, 30, 0.9)], "s0"),
             _record("meshppo", 1, [(0, 0, 0.3), (100, 10, 0.5), (200, 20, 0.8), (300, 30, 0.8)], "s1"),
             _record("meshppo", 1, [(0, 0, 0.3), (100, 10, 0.6), (200, 20, 0.7), (300, 30, 0.9)], "s2")]
    trl = _record("trl", 2, [(0, 0, 0.3), (200, 80, 0.75), (400, 160, 0.8), (450, 170, 0.85)], "trl")
    assert accuracy_at(seeds[0]["points"], 150) == pytest.approx(0.75)
    assert accuracy_at(seeds[0]["points"], 350) is None
    assert time_to_reach(seeds[0]["points"], 0.6) == 10 and time_to_reach(seeds[1]["points"], 0.85) is None
    # both read at multiples of lcm(1 * 100, 2 * 100) = 200 samples: TRL's 450 is off the grid
    assert eval_grid(seeds + [trl]) == 200 and eval_grid(seeds) == 100
    assert [p["samples"] for p in on_grid(trl["points"], 200)] == [0, 200, 400]
    assert [p["samples"] for p in on_grid(seeds[0]["points"], 200)] == [0, 200]
    c = compare(seeds, trl)
    assert c["eval_grid_samples"] == 200 and c["eval_every"] == {"meshppo": [1], "trl": 2}
    assert c["meshppo_runs"] == ["s0", "s1", "s2"]
    # at TRL's evaluations within meshppo's range (0, 200): at 200 the seeds have 0.8, 0.8, 0.7 ->
    # mean 0.7667, spread 0.1 >= 0.75 - 0.1
    assert [r["samples"] for r in c["at_equal_samples"]] == [0, 200]
    assert c["at_equal_samples"][1]["meshppo_mean"] == pytest.approx(2.3 / 3)
    assert c["at_equal_samples"][1]["meshppo_spread"] == pytest.approx(0.1)
    assert c["equal_samples_ok"]
    # TRL's last accuracy on the grid: 0.8 at 400 samples, 160 s (not 0.85, off the grid); the seeds on
    # the grid reach it at 20 s, 20 s and never (s2's 0.9 at 300 samples is off the grid) -> no median
    assert c["trl_last_accuracy"] == 0.8 and c["trl_last_samples"] == 400 and c["trl_wall_s_to_last"] == 160
    assert c["meshppo_wall_s_to_trl_last"] == [20, 20, None] and c["wall_ratio_median"] is None
    # start + 0.3 = 0.6: TRL at 80 s (0.75 at 200), the seeds at 20 s each on the grid (s0 and s2 reach
    # 0.6 at 100 samples, 10 s, which TRL's schedule does not see) -> 20 / 80
    assert c["trl_wall_s_to_gain"] == 80 and c["meshppo_wall_s_to_gain"] == [20, 20, 20]
    assert c["gain_wall_ratio_median"] == pytest.approx(20 / 80)
    assert c["meshppo_step_s"] == [None] * 3 and c["step_ratio_median"] is None  # no step records
    # step records: the median of consecutive (wall-clock / steps); TRL logs mid-generation steps
    for r, walls in zip(seeds, ([0.5, 1.5, 2.5, 3.5], [1.0, 1.2, 1.4, 5.0], [0.3, 0.4, 0.5, 0.6])):
        r["steps"] = [{"step": i + 1, "train_wall_s": w} for i, w in enumerate(walls)]
    trl["steps"] = [{"step": 0.5, "train_wall_s": 3.0}, {"step": 1.5, "train_wall_s": 7.0},
                    {"step": 2.5, "train_wall_s": 11.0}, {"step": 4.5, "train_wall_s": 16.0}]
    c = compare(seeds, trl)
    # seeds: 1.0; (0.2, 0.2, 3.6) -> 0.2; 0.1 -> median 0.2; TRL: 4.0, 4.0, 2.5 per step -> 4.0
    assert c["meshppo_step_s"] == pytest.approx([1.0, 0.2, 0.1]) and c["trl_step_s"] == pytest.approx(4.0)
    assert c["step_ratio_median"] == pytest.approx(0.2 / 4.0)
    c = compare(seeds[:2], trl)
    assert c["wall_ratio_median"] == pytest.approx(20 / 160)
    # the worked task's records: the same comparison under its own keys
    key = greedy_key("worked")
    w_seeds = [_record("meshppo", 1, [(p["samples"], p["train_wall_s"], p[GREEDY]) for p in r["points"]], r["run"], key)
               for r in seeds[:2]]
    w_trl = _record("trl", 2, [(p["samples"], p["train_wall_s"], p[GREEDY]) for p in trl["points"]], "trl", key)
    for r in w_seeds + [w_trl]:
        r["settings"]["task"] = "worked"
    assert task_of(w_trl) == "worked" and task_of(trl) == "sum"
    assert compare(w_seeds, w_trl)["wall_ratio_median"] == pytest.approx(20 / 160)


def test_medians_of_an_even_count_are_the_middle_pair_mean():
    """Two intervals of 1 s and 3 s a step: the median is 2 s (the upper one would read 3 s)."""
    steps = [{"step": 1, "train_wall_s": 0.0}, {"step": 2, "train_wall_s": 1.0}, {"step": 3, "train_wall_s": 4.0}]
    assert seconds_per_step(steps) == 2.0
    assert _ratio([10, 30], 40) == 0.5 and _ratio([10, 20, 30, 60], 40) == 0.625


def test_compare_reads_the_committed_records():
    """The records of docs/results/learn_h200 (written before `task` and the evaluation grid)
    still compare: meshppo evaluated every 10 steps, TRL every 20, so both are read every 20."""
    d = Path(ROOT) / "docs" / "results" / "learn_h200"
    if not (d / "trl.json").is_file():
        pytest.skip("no committed learning records")
    records = [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]
    trl = next(r for r in records if r.get("framework") == "trl")
    grpo = [r for r in records if r.get("framework") == "meshppo" and r.get("algorithm") == "grpo"]
    c = compare(grpo, trl)
    assert c["eval_every"] == {"meshppo": [10], "trl": 20} and c["eval_grid_samples"] == 20 * 512
    assert c["trl_last_samples"] % (20 * 512) == 0 and c["wall_ratio_median"] is not None


# Greedy accuracy on the 64 tiny validation problems read by two implementations (the engine,
# teacher-forced argmax, TRL's `generate`; float32): near-ties in a tiny model's logits can break
# apart differently on another CPU or package version, so a few problems, not one, may differ; a
# broken path (prompt, tokenizer, scoring) is off by far more.
NEAR_TIES = 4 / 64 + 1e-9
RECOMPUTE = "algorithm.rollout_correction.bypass_mode=false"  # a trainer override the records must show


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """Warm-up, two GRPO steps (the old-log-prob recompute pass back, by a trainer override over the
    benchmark's bypass mode) and the summary at the tiny size, in a subprocess (its own process group)."""
    return _tiny_run(tmp_path_factory, "learn", "--trainer-override", RECOMPUTE)


def _tiny_run(tmp_path_factory, name: str, *args: str):
    """`bench/learn.py --tiny --runs grpo:0 --summarize ARGS` in a subprocess: (work, out, stdout)."""
    work, out = tmp_path_factory.mktemp(f"{name}_work"), tmp_path_factory.mktemp(f"{name}_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--runs", "grpo:0", "--summarize",
                        "--work", str(work), "--out", str(out), *args],
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
    assert rec["settings"]["task"] == "sum" and rec["settings"]["max_response_length"] == 3 + 1 + 3
    for s in rec["steps"]:
        assert 0 <= s["reward"] <= 1 and s["kl"] >= -1e-6 and 1 <= s["response_length"] <= 7  # k3 >= 0
        phases = s["phases_s"]  # where the step went, phase by phase
        assert {"gen", "ref", "update_actor", "step"} <= phases.keys()
        assert "old_log_prob" in phases  # the override took: the benchmark's bypass mode skips this pass
        assert all(v >= 0 for v in phases.values()) and phases["step"] == s["step_s"]
    assert rec["greedy_gain"] == pytest.approx(rec["greedy_end"] - rec["greedy_start"])
    # the trainer's greedy validation before any step and the warm-up's teacher-forced greedy
    # check measure the same thing two ways (engine decoding vs argmax under teacher forcing)
    assert abs(rec["points"][0][GREEDY] - rec["warmup"]["greedy_acc"]) <= NEAR_TIES
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["grpo_0"]["reached_target"] == rec["reached_target"]
    assert rec["trainer_overrides"] == summary["runs"]["grpo_0"]["trainer_overrides"] == [RECOMPUTE]
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
    assert enc.responses([(7, 35)], [False]) == [tok("042")["input_ids"] + [tok.eos_token_id]]
    assert enc.responses([(7, 35)], [True]) == [tok("032")["input_ids"] + [tok.eos_token_id]]  # 7+5 -> 2
    x = torch.tensor([ids])
    ours = Transformer.from_pretrained(str(warm))(x)
    hf = AutoModelForCausalLM.from_pretrained(str(warm), dtype=torch.float32)(x).logits
    torch.testing.assert_close(hf, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.trl
def test_learn_trl_tiny(tiny_bench):
    """TRL's GRPOTrainer on the same warm-up checkpoint, 2 meshppo-sized steps (4 optimizer steps):
    the record has the schema `bench/learn.py --summarize` compares."""
    pytest.importorskip("trl", reason="TRL is in requirements-bench.txt, which make test-trl installs")
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
    assert abs(rec["points"][0][GREEDY] - meshppo["points"][0][GREEDY]) <= NEAR_TIES
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--summarize", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [row["samples"] for row in summary["vs_trl"]["at_equal_samples"]] == [0, 32, 64]


@pytest.fixture(scope="module")
def tiny_worked(tmp_path_factory):
    """The worked task at the tiny size: warm-up, two GRPO steps and the summary, in a subprocess."""
    return _tiny_run(tmp_path_factory, "learn_worked", "--task", "worked")


def test_learn_tiny_worked_task(tiny_worked):
    """`--tiny --task worked`: the worked task's checkpoint, prompts, response length and metric keys."""
    work, out, _ = tiny_worked
    rec = json.loads((out / "grpo_0.json").read_text())
    s = rec["settings"]
    # 2 digits: answers of 10 * 2 + 1 = 21 characters, + EOS + 3 of room
    assert s["task"] == "worked" and s["digits"] == 2 and s["max_response_length"] == 25
    key, mean_key = greedy_key("worked"), mean_at(2, "worked")
    assert [p["step"] for p in rec["points"]] == [0, 1, 2]
    for p in rec["points"]:
        assert 0 <= p[key] <= 1 and 0 <= p[mean_key] <= 1 and GREEDY not in p
    for st in rec["steps"]:
        assert 0 <= st["reward"] <= 1 and 1 <= st["response_length"] <= 25
        assert "old_log_prob" not in st["phases_s"] and "ref" in st["phases_s"]  # the default: bypass mode
    assert rec["greedy_start"] == rec["points"][0][key]
    # the warm-up's greedy check is the whole right derivation; the reward reads the sum alone, so
    # the engine's greedy accuracy is at least as high, up to near-ties
    assert rec["points"][0][key] >= rec["warmup"]["greedy_acc"] - NEAR_TIES
    (warm,) = work.glob("warmup-*")
    assert warm.name == f"warmup-{Settings(**TINY, task='worked').warmup_hash()}" == f"warmup-{rec['warmup']['hash']}"
    assert rec["warmup"]["task"] == "worked"
    val = [json.loads(line) for line in (warm / "val.jsonl").read_text().splitlines()]
    assert {r["data_source"] for r in val} == {WDS} and len(val) == TINY["n_val"]
    a, b = operands(val[0])
    assert val[0]["reward_model"]["ground_truth"] == answer(a + b, 2)
    # the checkpoint's context holds a prompt and the longest response
    config = json.loads((warm / "config.json").read_text())
    assert config["max_position_embeddings"] == 64 >= 2 * 2 + 4 + 25
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["grpo_0"]["task"] == "worked"


@pytest.mark.slow
@pytest.mark.trl
def test_learn_trl_tiny_worked(tiny_worked):
    """TRL on the worked task's checkpoint: its completion length is the task's, its records are keyed
    by the worked data source, and the summary compares it with meshppo's run on the same grid."""
    pytest.importorskip("trl", reason="TRL is in requirements-bench.txt, which make test-trl installs")
    work, out, _ = tiny_worked
    r = subprocess.run([sys.executable, "bench/learn_trl.py", "--tiny", "--task", "worked", "--work", str(work),
                        "--out", str(out), "--minutes", "5"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((out / "trl.json").read_text())
    assert rec["trl_args"]["max_completion_length"] == 25 and rec["settings"]["task"] == "worked"
    key = greedy_key("worked")
    assert [p["samples"] for p in rec["points"]] == [0, 32, 64] and all(key in p for p in rec["points"])
    assert rec["points"][0]["train_wall_s"] == pytest.approx(0, abs=0.5)  # read before the first evaluation
    meshppo = json.loads((out / "grpo_0.json").read_text())
    assert abs(rec["points"][0][key] - meshppo["points"][0][key]) <= NEAR_TIES
    r = subprocess.run([sys.executable, "bench/learn.py", "--tiny", "--task", "worked", "--summarize", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    vs = json.loads((out / "summary.json").read_text())["vs_trl"]
    assert vs["eval_grid_samples"] == 32 and vs["meshppo_runs"] == ["grpo_0"]
    assert [row["samples"] for row in vs["at_equal_samples"]] == [0, 32, 64]
