"""A reward function's error names the failing row as the data and the step's batch know it, the same
on any number of ranks: its position in the step's batch (the line of the rollout dump), which response
to which prompt of the batch it is, and the prompt's data row (FILE:ROW). Each rank scores only its share
of the rows (`_partition`), so a position in that share (what the error named) is a different row on
every world size and, with `trainer.balance_batch`, a position in a balanced permutation of the batch.

One step of the demo recipe on the tiny assets, 3 prompts x 2 responses, the reward function failing on
every response to the data's third prompt (`extra_info.index` 2, line 3 of train.jsonl): on 1 and on 3
gloo ranks (rank 2 then holds that prompt's rows), without balancing, the messages name the same row
(the rank's prefix aside); with balancing on 2 ranks the row it names is one of that prompt's, and its
position, prompt and response agree with each other."""

from __future__ import annotations

import os
import re

import pytest

from tests.dist_utils import run_distributed

FAILING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 2:
        raise ValueError("no score for this one")
    return 0.0
"""
N = 2  # responses a prompt


def _body(rank, world, assets, run_dir, reward, balance, out):
    from tests.e2e.conftest import demo_trainer
    from trainer.errors import UserError

    trainer = demo_trainer(assets, run_dir, reward, "data.train_batch_size=3", "data.shuffle=false",
                           f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                           f"trainer.balance_batch={balance}", "trainer.total_training_steps=1",
                           "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[jsonl]",
                           "data.max_response_length=4", f"trainer.n_gpus_per_node={world}")
    with pytest.raises(UserError) as raised:
        trainer.step()
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(raised.value))


def _message(tmp_path, assets, world, balance) -> str:
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    out = tmp_path / f"message_{world}_{balance}.txt"
    run_distributed(_body, world, str(assets), str(tmp_path / f"run_{world}_{balance}"), str(reward), balance,
                    str(out), timeout=300)
    return re.sub(r"^\(on rank \d+\) ", "", out.read_text())


def test_a_reward_error_names_the_same_row_on_any_number_of_ranks(tiny_assets, tmp_path):
    train = os.path.join(str(tiny_assets), "train.jsonl")
    one = _message(tmp_path, tiny_assets, 1, "false")
    # the first failing row: the third prompt's first response, position 2 x N of the step's batch
    assert (f"raised on sample {2 * N} of the step's batch: prompt 2's response 1 of {N}, data row {train}:3 "
            "(data_source='meshppo/demo_add')") in one, one
    assert one.endswith("ValueError: no score for this one"), one
    three = _message(tmp_path, tiny_assets, 3, "false")
    assert three == one
    balanced = _message(tmp_path, tiny_assets, 2, "true")
    named = re.search(rf"raised on sample (\d+) of the step's batch: prompt 2's response (\d+) of {N}, "
                      rf"data row {re.escape(train)}:3 ", balanced)
    assert named, balanced
    assert int(named[1]) == 2 * N + int(named[2]) - 1, balanced
