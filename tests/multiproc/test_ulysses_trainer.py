"""The trainer with Ulysses sequence parallelism on 2 gloo ranks: one step of PPO (GAE with a
critic, KL loss, entropy bonus, dynamic micro-batches, activation checkpointing, float32 on CPU, one mini-batch so that both
gradient norms are taken before any optimizer step; the old-log-prob pass kept by
`calculate_log_probs`) with the actor, reference and critic in one group of 2
(`ulysses_sequence_parallel_size=2`), against the same step without it. Generation does not change, so both runs train on the same rollouts; every forward and update
then runs pooled and token-split. The step's metrics must agree: the recompute pass's entropy
(a forward pass), the entropy loss, the value loss and both models' gradient norms (the updates). Only the micro-batches' packing and the order of float32 sums differ (the budget
per group is twice a rank's); a wrong gradient scale, loss normaliser or metric sum is off by 2x."""

from __future__ import annotations

import json
import math
import os

from tests.dist_utils import run_distributed
from tests.e2e.conftest import read_metrics
from tests.gpu.multi_gpu_checks import PARITY_REWARD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Figures away from zero (at step 1 the reference is the actor, the critic's zero-initialised head
# gives zero values and the whitened advantages' mean loss is rounding noise: none of those is
# compared). Measured: at most 7e-8 apart, relative.
COMPARED = ("actor/entropy", "actor/entropy_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
RTOL = 2e-4


def _body(rank, world_size, assets, run_root, reward):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    for sp in (1, 2):
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run_root}/sp{sp}",
            "trainer.logger=[jsonl]", "trainer.total_training_steps=1", "trainer.val_before_train=false",
            "trainer.save_freq=0", "trainer.resume_mode=disable", "data.train_batch_size=8",
            "data.max_response_length=8", "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48", "critic.ppo_max_token_len_per_gpu=48",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
            f"critic.ulysses_sequence_parallel_size={sp}", f"custom_reward_function.path={reward}",
            # the recomputation in backward runs the all-to-alls again, in the same order on both ranks
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "critic.model.enable_gradient_checkpointing=true"])
        assert PPOTrainer(cfg, ctx).train() == 0


def test_ulysses_trainer_step_matches(tiny_assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(PARITY_REWARD)  # varies within groups: nonzero advantages, returns and losses
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), str(reward), timeout=600)
    (plain,), (split,) = (read_metrics(tmp_path / f"sp{sp}") for sp in (1, 2))
    info = json.loads((tmp_path / "sp2" / "run_info.json").read_text())
    assert info["ulysses"] == {"actor": 2, "critic": 2}
    assert plain["response_length/mean"] == split["response_length/mean"]  # the same rollouts
    for key in COMPARED:
        a, b = plain[key], split[key]
        assert math.isfinite(a) and a > 1e-3 and abs(a - b) <= RTOL * a, (key, a, b)
