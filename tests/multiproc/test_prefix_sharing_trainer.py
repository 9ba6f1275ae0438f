"""The trainer with prefix sharing (`actor.use_prefix_grouper`) on 2 gloo ranks: one GRPO step
(4 responses a prompt, KL loss against a reference model, entropy bonus, dynamic micro-batches in
the log-prob passes and the update, the old-log-prob pass kept by `calculate_log_probs`, one
mini-batch so that the gradient norm is taken before any optimizer step), against the same step
without it. Generation does not change, so both runs train on the same rollouts; with sharing the
ranks hold whole prompt groups (`balanced_group_partitions`) and each micro-batch lays a prompt out
once. The step's metrics must agree: the recompute pass's entropy, the entropy loss and the
gradient norm, to float32 rounding (the packing differs); a wrong position, mask, label or gradient
path moves them by far more. The sharing run reports the tokens it saved. Run for full fine-tuning
and for LoRA."""

from __future__ import annotations

import math
import os

import pytest

from tests.dist_utils import run_distributed
from tests.e2e.conftest import read_metrics
from tests.gpu.multi_gpu_checks import PARITY_REWARD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("actor/entropy", "actor/entropy_loss", "actor/grad_norm")
RTOL = 2e-4


def _body(rank, world_size, assets, run_root, reward, extra):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    for share in ("false", "true"):
        A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run_root}/{share}",
            "trainer.logger=[jsonl]", "trainer.total_training_steps=1", "trainer.val_before_train=false",
            "trainer.save_freq=0", "trainer.resume_mode=disable", "data.train_batch_size=8",
            "data.max_response_length=8", f"{R}.n=4", f"{A}.ppo_mini_batch_size=8", f"{R}.calculate_log_probs=true",
            f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=40", f"{R}.log_prob_use_dynamic_bsz=true",
            f"{R}.log_prob_max_token_len_per_gpu=40", f"{A}.entropy_coeff=0.01", f"{A}.use_prefix_grouper={share}",
            f"custom_reward_function.path={reward}", *extra])
        assert PPOTrainer(cfg, ctx).train() == 0


# LoRA (the 7b one-GPU recipe's way): the reference is the actor with its adapters off, whose
# forward shares the prompt too, and the gradient reaches the adapters only
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear")


@pytest.mark.parametrize("extra", [(), LORA], ids=["full", "lora"])
def test_prefix_sharing_trainer_step_matches(tiny_assets, tmp_path, extra):
    reward = tmp_path / "reward.py"
    reward.write_text(PARITY_REWARD)  # varies within groups: nonzero advantages and losses
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), str(reward), list(extra), timeout=600)
    (plain,), (shared,) = (read_metrics(tmp_path / share) for share in ("false", "true"))
    assert plain["response_length/mean"] == shared["response_length/mean"]  # the same rollouts
    for key in COMPARED:
        a, b = plain[key], shared[key]
        assert math.isfinite(a) and a > 1e-3 and abs(a - b) <= RTOL * a, (key, a, b)
    assert abs(shared["actor/kl_loss"]) < 1e-6  # the reference (shared too) is the actor at step 1
    assert "perf/prefix_tokens_saved" not in plain
    # the demo's prompts are about as long as its responses, 4 to a group: well over a fifth saved
    assert 0.2 < shared["perf/prefix_tokens_saved"] < 0.75
