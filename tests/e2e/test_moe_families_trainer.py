"""A Mixtral and an OLMoE in the trainer (CPU, fp32, weights at std 0.3 for decisive logits and routing): the demo's
model built as each (4 experts of intermediate_size, each token through 2, every layer sparse) trains two steps in
one process; the engine's rollout log-probs are the trainer's (the weights reach the engine through the resharder;
Mixtral's checkpoint, written by prepare_demo under its block_sparse_moe / w1 w3 w2 names, read by both), its losses
finite."""

import json

import pytest

from tests.e2e.conftest import build_demo_assets, demo_args, read_metrics
from tests.e2e.test_qwen3_moe_trainer import _check_rows
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.mark.parametrize("model_type, architecture", [("mixtral", "MixtralForCausalLM"),
                                                      ("olmoe", "OlmoeForCausalLM")])
def test_a_mixture_of_experts_trains_two_steps_with_the_engines_log_probs_the_trainers(tmp_path, model_type,
                                                                                       architecture):
    assets = build_demo_assets(tmp_path / "assets", "--sft-max-steps", "0", "--init-std", "0.3", "--n-train", "64",
                               "--n-val", "16", "--layers", "2", "--hidden", "32", "--model-type", model_type)
    config = json.loads((assets / "sft_model" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_experts_per_tok"] == 2
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    code = cli.main(demo_args(assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.rollout.calculate_log_probs=true"))
    assert code == 0
    _check_rows(read_metrics(run))
