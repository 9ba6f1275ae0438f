"""The trainer on one GPU: bf16 mixed precision, the native engine with CUDA graphs, and the
train/generate round trip (reshard, KV cache freed and re-allocated) over several steps."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import MACHINE_METRICS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, estimator, *extra, model=(), assets=None, steps=3):
    """`steps` (three) steps of the demo recipe on the GPU, a run resumed in `tmp_path/run` if it has a
    checkpoint; `model`: prepare_demo's model flags; `assets`: those of an earlier run (else built here)."""
    if assets is None:
        assets = tmp_path / "assets"
        subprocess.run([sys.executable, "-m", "tools.prepare_demo", "--out", str(assets), "--sft-max-steps", "50",
                        *model], cwd=ROOT, check=True, capture_output=True)
    run = tmp_path / "run"
    n = "1" if estimator == "gae" else "8"
    cmd = [sys.executable, os.path.join(ROOT, "train_ppo.py"), "--config", os.path.join(ROOT, "configs", "demo.yaml"),
           f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]",
           f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run}",
           "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={steps}", "trainer.test_freq=3",
           "trainer.logger=[jsonl]", f"algorithm.adv_estimator={estimator}", f"actor_rollout_ref.rollout.n={n}",
           "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
           "actor_rollout_ref.rollout.dtype=bfloat16", "critic.ppo_micro_batch_size_per_gpu=16",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    trained = [row for row in rows if "actor/pg_loss" in row or "critic/vf_loss" in row]  # (a critic warm-up's)
    assert len(trained) == steps
    return rows, trained


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_demo_steps_on_gpu(tmp_path, estimator):
    rows, steps = _run(tmp_path, estimator)
    for row in steps:
        # the update phase's peak (after generation) is part of the step's peak
        assert 0 < row["perf/max_memory_allocated_update_gb"] <= row["actor/perf/max_memory_allocated_gb"], row
        for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "perf/throughput",
                  "actor/perf/max_memory_allocated_gb", "timing_s/gen", "timing_s/reshard", "perf/mfu/actor"):
            assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (k, row.get(k))
    assert "val/meshppo/demo_add/score" in rows[-1]


def test_engine_weights_freed_between_phases_on_gpu(tmp_path):
    """rollout.free_engine_weights (the default; set here so the test keeps its subject should the
    default change): the weights are released after every generation and the next
    reshard re-allocates and fills them; the first step captures the decode graphs, which stay
    (recaptured only if the weights come back elsewhere), and training goes on. The demo
    model's head_dim (96 / 4 = 24) has no Triton decode kernel, hence no graphs: this one has 32."""
    rows, steps = _run(tmp_path, "grpo", "actor_rollout_ref.rollout.free_engine_weights=true",
                       model=("--hidden", "128", "--heads", "4"))
    assert steps[0]["timing_s/graph_capture"] > 0, steps[0]
    for row in steps:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0, row
    assert "val/meshppo/demo_add/score" in rows[-1]


def test_prefix_sharing_on_gpu(tmp_path):
    """actor.use_prefix_grouper on the GPU (bf16, FlashAttention's varlen path with the queries of a
    response aligned to the end of its prompt's keys, dynamic micro-batches): the first step trains
    on the same rollouts as without sharing, so its recompute-pass entropy and gradient norm agree.
    bf16 rounding of a differently packed batch moves them by about 1e-3 relative; a response that
    misses its prompt's keys, or reads them at the wrong positions, by far more than the 3 % allowed."""
    common = ("actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
              "actor_rollout_ref.rollout.calculate_log_probs=true")  # keeps the recompute pass
    _, plain = _run(tmp_path / "plain", "grpo", *common)
    _, shared = _run(tmp_path / "shared", "grpo", *common, "actor_rollout_ref.actor.use_prefix_grouper=true",
                     assets=tmp_path / "plain" / "assets")
    a, b = plain[0], shared[0]
    assert a["response_length/mean"] == b["response_length/mean"], (a, b)  # the same rollouts
    for key in ("actor/entropy", "actor/grad_norm"):
        assert a[key] > 1e-3 and abs(a[key] - b[key]) <= 0.03 * a[key], (key, a[key], b[key])
    # the recompute against the engine's log-probs: bf16 noise either way (about 0.01 a token)
    assert b["rollout/logprob_diff"] <= 2 * a["rollout/logprob_diff"] + 0.02, (a, b)
    assert 0.2 < b["perf/prefix_tokens_saved"] < 0.9, b
    for row in shared:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0, row


def test_full_determinism_on_gpu(tmp_path):
    """fsdp_config.full_determinism: two runs of three demo steps (bf16, the engine's CUDA graphs
    with top-p sampling, FlashAttention's deterministic backward, KL loss against the reference)
    give the same metrics to the bit, losses, gradient norms, scores and validation included:
    everything but the wall-clock figures."""
    flags = ("actor_rollout_ref.actor.fsdp_config.full_determinism=true",
             "actor_rollout_ref.ref.fsdp_config.full_determinism=true", "actor_rollout_ref.rollout.top_p=0.9")
    rows_a, _ = _run(tmp_path / "a", "grpo", *flags)
    rows_b, _ = _run(tmp_path / "b", "grpo", *flags, assets=tmp_path / "a" / "assets")
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        kept = {k: v for k, v in a.items() if not k.startswith(MACHINE_METRICS)}
        assert kept == {k: b.get(k) for k in kept}, [k for k in kept if kept[k] != b.get(k)]
    assert any("actor/grad_norm" in row for row in rows_a)


def test_offloaded_critic_resume_on_gpu(tmp_path):
    """GAE with the critic's parameters and Adam states offloaded to pinned host memory between its
    phases and a one-step critic warm-up, deterministic: a run checkpointed at step 1 (before the
    actor's first update) and resumed trains steps 2 and 3 to the bit as the run that never stopped.
    The offloaded critic's save once read empty device storage (SIGSEGV), and the step-1 checkpoint
    held AdamW step counters of 1 that made the resumed actor's first update smaller."""
    flags = ("actor_rollout_ref.actor.fsdp_config.full_determinism=true",
             "actor_rollout_ref.ref.fsdp_config.full_determinism=true",
             "critic.model.fsdp_config.full_determinism=true", "critic.model.fsdp_config.param_offload=true",
             "critic.model.fsdp_config.optimizer_offload=true", "trainer.critic_warmup=1",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.val_before_train=false", "trainer.test_freq=-1")
    straight, _ = _run(tmp_path / "a", "gae", *flags)
    assets = tmp_path / "a" / "assets"
    _run(tmp_path / "b", "gae", *flags, "trainer.save_freq=1", assets=assets, steps=1)
    resumed, _ = _run(tmp_path / "b", "gae", *flags, assets=assets)
    assert len(straight) == len(resumed)
    for a, b in zip(straight, resumed):
        kept = {k: v for k, v in a.items() if not k.startswith(MACHINE_METRICS)}
        assert kept == {k: b.get(k) for k in kept}, [(k, kept[k], b.get(k)) for k in kept if kept[k] != b.get(k)]
    assert sum("actor/pg_loss" in row for row in resumed) == 2


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "granite", "mistral", "mixtral", "olmo2", "olmoe",
                                        "phi3", "qwen3_moe"])
def test_other_model_types_train_on_gpu(tmp_path, model_type):
    """A model type besides the demo's Qwen2 trains through the whole GPU path: the Triton engine with CUDA
    graphs in bf16, the reshard, the bf16 update (the CPU tests hold its logits to transformers' in float64)."""
    rows, steps = _run(tmp_path, "grpo", model=("--model-type", model_type), steps=2)
    assert json.load(open(tmp_path / "assets" / "sft_model" / "config.json"))["model_type"] == model_type
    for row in steps:
        for k in ("actor/pg_loss", "actor/grad_norm", "timing_s/gen"):
            assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (k, row.get(k))
        assert row["actor/grad_norm"] > 0


def test_a_mixture_of_experts_trains_on_gpu_with_rollout_routing_replay(tmp_path):
    """R3 on the GPU: the graphed bf16 engine records each token's experts, the actor's old-log-prob pass and update
    replay them (prepare_demo's Qwen3-MoE: 4 experts, top 2)."""
    _, steps = _run(tmp_path, "grpo", "actor_rollout_ref.actor.router_replay.mode=R3",
                    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                    model=("--model-type", "qwen3_moe"), steps=2)
    for row in steps:
        for k in ("actor/pg_loss", "actor/grad_norm", "timing_s/gen"):
            assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (k, row.get(k))
        assert row["actor/grad_norm"] > 0


def test_a_mixture_of_experts_trains_on_gpu_replaying_its_old_log_prob_pass_routing(tmp_path):
    """R2 on the GPU: the bf16 actor's old-log-prob pass records each token's experts (copied to pinned host memory
    behind the pass's kernels) and the update's mini-batches replay them (prepare_demo's Qwen3-MoE: 4 experts, top 2;
    the demo's two mini-batches, so the second replays pi_old's routing after an optimizer step)."""
    _, steps = _run(tmp_path, "grpo", "actor_rollout_ref.actor.router_replay.mode=R2",
                    model=("--model-type", "qwen3_moe"), steps=2)
    for row in steps:
        for k in ("actor/pg_loss", "actor/grad_norm", "timing_s/gen", "timing_s/old_log_prob"):
            assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (k, row.get(k))
        assert row["actor/grad_norm"] > 0
