"""A windowed model trains past its window (CPU, one process, fp32, weights at std 0.3 for decisive logits): the demo's model as a Mistral whose every
layer attends through override_config.sliding_window=4, under prompts of up to 9 tokens + responses of up to 6.
The pre-flight refused such a run while meshppo's attention read the whole context; now the engine's log-probs are
the trainer's (both windowed: 9e-7 measured), where an engine reading the whole context is 0.69 off (measured)."""

import pytest

from tests.e2e.conftest import build_demo_assets, demo_args, read_metrics
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.fixture(scope="module")
def mistral_assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("mistral_assets"), "--sft-max-steps", "0", "--init-std", "0.3",
                             "--n-train", "64", "--n-val", "16", "--layers", "2", "--hidden", "32",
                             "--model-type", "mistral")


def _run(assets, tmp_path, name, window):
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / name
    code = cli.main(demo_args(assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.rollout.calculate_log_probs=true",
                              f"actor_rollout_ref.model.override_config.sliding_window={window}"))
    assert code == 0
    return read_metrics(run)


def test_a_mistral_with_a_window_of_4_trains_two_steps_past_it(mistral_assets, tmp_path):
    rows = _run(mistral_assets, tmp_path, "run", 4)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["prompt_length/max"] + row["response_length/max"] > 4  # the sequences reach past the window
        assert row["training/rollout_probs_diff_max"] < 1e-4, row["training/rollout_probs_diff_max"]
