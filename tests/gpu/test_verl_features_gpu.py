"""verl's features through the trainer on one GPU (the CPU tests run them on gloo): a reward model
with its own vocabulary, PF-PPO's redraw and the checkpoint's Hugging Face export, each with
device tensors where the CPU runs had host ones."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.test_trainer_gpu import _run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_reward_model_with_its_own_vocabulary_on_gpu(tmp_path):
    """A Llama reward model with another tokenizer and chat template than the actor's, in fp32 on
    the GPU: the dumped scores equal transformers' (on the CPU, fp32; `check_dumped_scores`)."""
    from tests.unit.test_reward_model import check_dumped_scores, llama_reward_model, other_tokenizer

    other = other_tokenizer()
    hf = llama_reward_model(tmp_path / "rm", len(other))
    other.save_pretrained(tmp_path / "rm")
    dump = tmp_path / "dump"
    _run(tmp_path, "grpo", "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}",
         "reward_model.micro_batch_size_per_gpu=8",
         "reward_model.model.fsdp_config.mixed_precision.param_dtype=fp32", f"trainer.rollout_data_dir={dump}")
    with open(dump / "3.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    check_dumped_scores(dumped, hf, other, atol=5e-3)


def test_pf_ppo_redraw_on_gpu(tmp_path):
    """PF-PPO with gae: every step trains on a batch of the step's size redrawn from its rows."""
    dump = tmp_path / "dump"
    _, steps = _run(tmp_path, "gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_random",
                    f"trainer.rollout_data_dir={dump}")
    for step, row in enumerate(steps, 1):
        with open(dump / f"{step}.jsonl") as f:
            dumped = [json.loads(line) for line in f]
        assert len(dumped) == 32 and {d["score"] for d in dumped} <= {0.0, 1.0}, dumped  # demo: 32 prompts x 1
        assert row["critic/score/mean"] == pytest.approx(sum(d["score"] for d in dumped) / 32), row


def test_checkpoint_hf_export_on_gpu(tmp_path):
    """save_contents with hf_model: the last step's checkpoint holds a Hugging Face directory whose
    tensors equal, bit for bit, the end-of-run export of the same weights, and transformers loads it;
    `tools.export_hf` writes the same from the checkpoint's sharded weights."""
    import transformers
    from safetensors.torch import load_file

    _run(tmp_path, "grpo", "trainer.save_freq=3",
         "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    export = tmp_path / "run" / "checkpoints" / "global_step_3" / "actor" / "huggingface"
    final = tmp_path / "run" / "hf_actor"

    def tensors(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(load_file(str(d / f)))
        return out

    got, want = tensors(export), tensors(final)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    transformers.AutoModelForCausalLM.from_pretrained(export)
    # the export tool, on CPU in a process of its own, rebuilds the same directory from the checkpoint the GPU wrote
    out = tmp_path / "tool"
    r = subprocess.run([sys.executable, "-m", "tools.export_hf", str(export.parent.parent), str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tool = tensors(out)
    assert tool.keys() == want.keys() and all(torch.equal(tool[k], want[k]) for k in want)
    assert sorted(os.listdir(out)) == sorted(os.listdir(export))


def test_optimal_token_baseline_on_gpu(tmp_path):
    """verl's optimal-token-baseline estimator on the GPU: the old-log-prob pass returns each token's
    sum of squared probabilities (the Triton LM head), and the steps' variance-proxy metrics and
    advantages are finite."""
    import math

    _, steps = _run(tmp_path, "optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    for row in steps:
        keys = [k for k in row if k.startswith("variance_proxy/")]
        assert keys and all(math.isfinite(row[k]) for k in keys), row
        assert math.isfinite(row["critic/advantages/mean"]), row


def test_gdpo_on_gpu(tmp_path):
    """gdpo with the reward components on the GPU: each step's gdpo/{a,b} figures are those of the dumped
    components, and each response's advantage is a float64 gdpo run on them (groups of n=8, prompt-major)
    up to the whitening over the batch's tokens (the dump has no response lengths): an affine map, the
    same for every response, with a positive slope."""
    import numpy as np

    from ppo.core_algos import compute_gdpo_outcome_advantage
    from tests.multiproc.test_gdpo_trainer import COMPONENTS_REWARD, WEIGHTS

    reward = tmp_path / "reward.py"
    reward.write_text(COMPONENTS_REWARD)
    dump = tmp_path / "dump"
    _, steps = _run(tmp_path, "gdpo", "algorithm.gdpo_reward_keys=[a,b]",
                    f"algorithm.gdpo_reward_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]", f"custom_reward_function.path={reward}",
                    f"trainer.rollout_data_dir={dump}")
    for step, row in enumerate(steps, 1):
        with open(dump / f"{step}.jsonl") as f:
            dumped = [json.loads(line) for line in f]
        groups = [dumped[i:i + 8] for i in range(0, len(dumped), 8)]
        assert all(len({d["input"] for d in g}) == 1 for g in groups)  # prompt-major: a group is one prompt's
        comps = torch.tensor([[d["a"], d["b"]] for d in dumped], dtype=torch.float64)
        for j, key in enumerate("ab"):
            assert row[f"gdpo/{key}/mean"] == pytest.approx(comps[:, j].mean().item(), rel=1e-5, abs=1e-6)
            assert row[f"gdpo/{key}/std"] == pytest.approx(np.std(comps[:, j].numpy()), rel=1e-5, abs=1e-6)
        mask = torch.ones(len(dumped), 1, dtype=torch.float64)
        want = compute_gdpo_outcome_advantage(torch.zeros_like(mask), mask, np.arange(len(dumped)) // 8,
                                              reward_components=comps, reward_weights=WEIGHTS)[0][:, 0]
        got = torch.tensor([d["advantage"] for d in dumped], dtype=torch.float64)
        fit = torch.linalg.lstsq(torch.stack([want, torch.ones_like(want)], 1), got[:, None]).solution[:, 0]
        assert fit[0] > 0, fit
        torch.testing.assert_close(got, fit[0] * want + fit[1], rtol=0, atol=1e-4)
