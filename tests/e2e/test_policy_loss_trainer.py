"""`actor_rollout_ref.actor.policy_loss.loss_mode=gspo` through the trainer (2 CPU ranks, gloo):
two steps train with finite losses, and on the same first batch the loss is not vanilla's."""

import math
import os

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import DENSE_REWARD, ROOT

# Two mini-batches a step: the second one's ratios are not 1, so the sequence-level clip (GSPO's
# recipe range, for both runs) acts differently from the token-level one. Both aggregate
# seq-mean-token-mean (GSPO's own), so that only the ratio tells them apart.
COMMON = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
          "data.val_files=[]", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=1e-2",
          "actor_rollout_ref.actor.clip_ratio_low=3e-4", "actor_rollout_ref.actor.clip_ratio_high=4e-4",
          "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "trainer.resume_mode=disable",
          "trainer.export_hf_at_end=false", "trainer.logger=[jsonl]"]


def _body(rank, world_size, assets, run_root):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    runs = {}
    for mode in ("vanilla", "gspo"):
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", f"actor_rollout_ref.model.path={assets}/sft_model",
            f"custom_reward_function.path={run_root}/dense_reward.py", f"trainer.default_local_dir={run_root}/{mode}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *COMMON])
        trainer = PPOTrainer(cfg, ctx)
        runs[mode] = [trainer.step() for _ in range(2)]
    for mode, steps in runs.items():
        for m in steps:
            for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
                assert math.isfinite(m[k]), (mode, k, m[k])
            assert m["actor/nonfinite_skipped"] == 0
    vanilla, gspo = runs["vanilla"][0], runs["gspo"][0]
    assert vanilla["critic/score/mean"] == gspo["critic/score/mean"]  # the same first batch
    assert vanilla["critic/advantages/mean"] == gspo["critic/advantages/mean"]
    assert abs(vanilla["actor/pg_loss"] - gspo["actor/pg_loss"]) > 1e-6, (vanilla["actor/pg_loss"], gspo["actor/pg_loss"])
    assert vanilla["actor/pg_clipfrac"] != gspo["actor/pg_clipfrac"]


def test_gspo_trains_through_the_trainer(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)
