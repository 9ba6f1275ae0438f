"""verl's `global_seqlen/*` figures in a run's metrics: one step of the demo recipe on the tiny assets on
2 gloo ranks logs them with `trainer.balance_batch` (the default) and not without it, as verl logs them
only where it balances; the mean is the step's tokens (`perf/total_num_tokens`, counted apart) over the
ranks. (No claim that the balanced spread is the smaller: Karmarkar-Karp on the work estimate can lose to the blocks.)"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.e2e.conftest import read_metrics
from tests.gpu.multi_gpu_checks import PARITY_REWARD

KEYS = [f"global_seqlen/{k}" for k in ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")]


def _body(rank, world, assets, run_root, reward):
    from tests.e2e.conftest import demo_trainer

    for balance in ("true", "false"):
        trainer = demo_trainer(assets, f"{run_root}/{balance}", reward, "data.train_batch_size=4",
                               "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "data.max_response_length=6",
                               f"trainer.balance_batch={balance}", "trainer.total_training_steps=1",
                               "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[jsonl]")
        assert trainer.train() == 0


def test_a_balanced_step_logs_verls_seqlen_figures(tiny_assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(PARITY_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), str(reward), timeout=600)
    (balanced,), (plain,) = (read_metrics(tmp_path / balance) for balance in ("true", "false"))
    assert not any(k in plain for k in KEYS)
    fig = {k.split("/")[1]: balanced[k] for k in KEYS}
    assert fig["minmax_diff"] == pytest.approx(fig["max"] - fig["min"], abs=1e-9)
    assert fig["mean"] == pytest.approx(balanced["perf/total_num_tokens"] / 2, abs=1e-9)
    assert fig["min"] <= fig["mean"] <= fig["max"] and fig["balanced_min"] <= fig["mean"] <= fig["balanced_max"]
