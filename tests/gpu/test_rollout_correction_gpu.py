"""Rollout correction on one GPU, where the bf16 engine's log-probs really differ from the
actor's: bypass mode runs without the recompute pass and reports the gap; decoupled mode's
weights stay near 1 and its metrics are finite."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("assets")
    subprocess.run([sys.executable, "-m", "tools.prepare_demo", "--out", str(out), "--sft-max-steps", "50"],
                   cwd=ROOT, check=True, capture_output=True)
    return out


def _run(assets, run, *overrides) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "train_ppo.py"), "--config", os.path.join(ROOT, "configs", "demo.yaml"),
           f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
           f"actor_rollout_ref.model.path={assets}/sft_model",
           f"trainer.default_local_dir={run}", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3",
           "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf_at_end=false",
           "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
           "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.calculate_log_probs=true",
           *overrides]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(rows) == 3
    return rows


def test_bypass_mode_on_gpu(assets, tmp_path):
    for row in _run(assets, tmp_path / "bypass", "algorithm.rollout_correction.bypass_mode=true",
                    "algorithm.rollout_correction.rollout_rs=token_k1",
                    "algorithm.rollout_correction.rollout_rs_threshold=4.0"):
        assert "timing_s/old_log_prob" not in row
        for k in ("actor/entropy", "actor/ref_kl", "rollout/logprob_diff", "rollout_corr/kl",
                  "rollout_corr/rollout_rs_masked_fraction"):
            assert math.isfinite(row[k]), (k, row[k])
        # bf16 engine vs bf16-matmul actor: a small gap, possibly none (on an H100 at 4bb1122, where the demo
        # model's head_dim 24 first ran the engine's Triton kernels, 0.0, likely their float32 sums rounding
        # to the actor's bf16 values, not confirmed there; the eager reference attention before left a gap).
        # That the metric measures a real gap is test_rollout_correction.py's (a known 0.01).
        assert 0 <= row["rollout/logprob_diff"] < 0.1
        assert row["rollout_corr/rollout_rs_masked_fraction"] < 0.05


def test_decoupled_weights_on_gpu(assets, tmp_path):
    for row in _run(assets, tmp_path / "decoupled", "algorithm.rollout_correction.rollout_is=token",
                    "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                    "algorithm.rollout_correction.rollout_rs_threshold=0.01"):
        assert "timing_s/old_log_prob" in row
        assert 0.9 < row["rollout_corr/rollout_is_mean"] < 1.1, row["rollout_corr/rollout_is_mean"]
        for k in ("rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/rollout_rs_masked_fraction"):
            assert math.isfinite(row[k]), (k, row[k])
