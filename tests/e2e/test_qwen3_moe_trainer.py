"""A Qwen3-MoE in the trainer (CPU, fp32, weights at std 0.3 for decisive logits and routing): the demo's model built
as qwen3_moe (4 experts, each token through 2, every layer sparse) trains two steps, in one process and on two
gloo ranks with a TP 2 engine; the engine's rollout log-probs are the trainer's (both run the experts
through models.moe; the weights reach the engine through the resharder, the experts split over the TP ranks), its
losses finite. `moe_assets` and `check_trains_two_steps` serve test_moe_families_trainer.py's Mixtral and OLMoE."""

import json
import math

import pytest

from tests.e2e.conftest import build_demo_assets, demo_args, read_metrics, train_in_ranks
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


def moe_assets(out, model_type: str):
    """The demo's assets in `out` with an untrained (init std 0.3) 2-layer, hidden-32 model of `model_type` (4
    experts, each token through 2)."""
    return build_demo_assets(out, "--sft-max-steps", "0", "--init-std", "0.3", "--n-train", "64", "--n-val", "16",
                             "--layers", "2", "--hidden", "32", "--model-type", model_type)


def check_trains_two_steps(assets, tmp_path, architecture: str, *overrides: str, two_ranks: bool = False):
    """The model of `assets` (config.json's architectures `architecture`, top-2 routing) trains two steps of the
    demo recipe (the length reward, batch 8, 4 responses a prompt, mini-batches and micro-batches of 4, no
    validation; then `overrides`) in this process, or on two gloo ranks (`two_ranks`, `train_in_ranks`): the
    engine's rollout log-probs are the trainer's (fp32: rounding apart) and the losses finite."""
    config = json.loads((assets / "sft_model" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_experts_per_tok"] == 2
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    args = demo_args(assets, run, "trainer.total_training_steps=2", "trainer.val_before_train=false",
                     f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.test_freq=-1",
                     "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.rollout.calculate_log_probs=true", *overrides)
    if two_ranks:
        train_in_ranks(args)
    else:
        assert cli.main(args) == 0
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # fp32 engine and trainer: rounding apart (an engine that skips the top-2 renormalisation: 0.2, measured)
        assert row["training/rollout_probs_diff_max"] < 1e-4, row["training/rollout_probs_diff_max"]
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    assert rows[0]["actor/grad_norm"] > 0


@pytest.fixture(scope="module")
def qwen3_moe_assets(tmp_path_factory):
    return moe_assets(tmp_path_factory.mktemp("qwen3_moe_assets"), "qwen3_moe")


def test_a_qwen3_moe_trains_two_steps_with_the_engines_log_probs_the_trainers(qwen3_moe_assets, tmp_path):
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM", "trainer.n_gpus_per_node=1")


def test_a_qwen3_moe_trains_on_two_ranks_with_a_tp2_engine(qwen3_moe_assets, tmp_path):
    """Two gloo ranks (FULL_SHARD), the engine at TP 2: each rank holds half of every expert's
    intermediate size, its gate_up_proj from the resharder's all-to-all, its down_proj from the micro-DP group."""
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM",
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2", two_ranks=True)


R3 = ("actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "actor_rollout_ref.actor.router_replay.mode=R3")


def test_a_qwen3_moe_trains_two_steps_replaying_the_engines_routing(qwen3_moe_assets, tmp_path):
    """R3: the engine records every token's experts, the actor's old-log-prob pass and update replay them (dynamic
    batching on: the rows re-packed by token count)."""
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM", "trainer.n_gpus_per_node=1",
                           "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200", *R3)


def test_a_qwen3_moe_replays_the_engines_routing_on_two_ranks_with_a_tp2_engine(qwen3_moe_assets, tmp_path):
    """R3 over two gloo ranks with a TP 2 engine: every TP rank routes alike (the router is whole on each), and each
    rank's rows carry their recorded experts into its forwards."""
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM",
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2", *R3, two_ranks=True)


R2 = "actor_rollout_ref.actor.router_replay.mode=R2"


def test_a_qwen3_moe_trains_two_steps_replaying_its_old_log_prob_pass_routing(qwen3_moe_assets, tmp_path):
    """R2: the actor's old-log-prob pass records each token's experts and the update's two mini-batches replay them
    (the second after an optimizer step), with shared prompts laid out once and dynamic batching."""
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM", "trainer.n_gpus_per_node=1", R2,
                           "actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200")


def test_a_qwen3_moe_replays_its_old_log_prob_pass_routing_on_two_ranks_with_pf_ppo(qwen3_moe_assets, tmp_path):
    """R2 over two gloo ranks with PF-PPO (GAE, a Qwen3-MoE critic routing itself): the redraw gathers every rank's
    rows' records before it partitions the redrawn batch (the engine's record on too, which R2 does not use)."""
    check_trains_two_steps(qwen3_moe_assets, tmp_path, "Qwen3MoeForCausalLM", R2, "algorithm.use_pf_ppo=true",
                           "algorithm.adv_estimator=gae",
                           "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", two_ranks=True)
