"""A Qwen3-MoE in the trainer (CPU, fp32, weights at std 0.3 for decisive logits and routing): the demo's model built
as qwen3_moe (4 experts, each token through 2, every layer sparse) trains two steps, in one process and through the
launcher on two gloo ranks with a TP 2 engine; the engine's rollout log-probs are the trainer's (both run the experts
through models.moe; the weights reach the engine through the resharder, the experts split over the TP ranks), its
losses finite."""

import math

import pytest

from tests.e2e.conftest import build_demo_assets, demo_args, read_metrics, torchrun
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("qwen3_moe_assets"), "--sft-max-steps", "0", "--init-std", "0.3",
                             "--n-train", "64", "--n-val", "16", "--layers", "2", "--hidden", "32",
                             "--model-type", "qwen3_moe")


def test_a_qwen3_moe_trains_two_steps_with_the_engines_log_probs_the_trainers(moe_assets, tmp_path):
    import json

    config = json.loads((moe_assets / "sft_model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts_per_tok"] == 2
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    code = cli.main(demo_args(moe_assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.rollout.calculate_log_probs=true"))
    assert code == 0
    _check_rows(read_metrics(run))


def _check_rows(rows):
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # fp32 engine and trainer: rounding apart (an engine that skips the top-2 renormalisation: 0.2, measured)
        assert row["training/rollout_probs_diff_max"] < 1e-4, row["training/rollout_probs_diff_max"]
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    assert rows[0]["actor/grad_norm"] > 0


def test_a_qwen3_moe_trains_on_two_ranks_with_a_tp2_engine(moe_assets, tmp_path):
    """torchrun over two gloo ranks (FULL_SHARD), the engine at TP 2: each rank holds half of every expert's
    intermediate size, its gate_up_proj from the resharder's all-to-all, its down_proj from the micro-DP group."""
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    r = torchrun(demo_args(moe_assets, run, "trainer.total_training_steps=2", "trainer.val_before_train=false",
                           f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.test_freq=-1",
                           "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                           "actor_rollout_ref.rollout.calculate_log_probs=true",
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    _check_rows(read_metrics(run))
