"""A reward function's error names the failing row as the data and the step's batch know it, the same
on any number of ranks: its position in the step's batch (the line of the rollout dump), which response
to which prompt of the batch it is, and the prompt's data row (FILE:ROW). Each rank scores only its share
of the rows (`_partition`), so a position in that share (what the error named) is a different row on
every world size and, with `trainer.balance_batch`, a position in a balanced permutation of the batch.

One step of the demo recipe on the tiny assets, 3 prompts x 2 responses, the reward function failing on
every response to the data's third prompt (`extra_info.index` 2, line 3 of train.jsonl): on 1 and on 3
gloo ranks (rank 2 then holds that prompt's rows), without balancing, the messages name the same row
(the rank's prefix aside); with balancing on 2 ranks the row it names is one of that prompt's, and its
position, prompt and response agree with each other. Validation and filter_groups' generation rounds
name their rows likewise (`validation batch B`, `the step's generation round R`), on 1 and 2 ranks."""

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


# fails on the third training prompt (as above) and on the sixth validation prompt
FAILING_BOTH = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if (extra_info["split"], extra_info["index"]) in (("train", 2), ("val", 5)):
        raise ValueError("no score for this one")
    return 0.0
"""


def _validation_and_round_body(rank, world, assets, run_dir, reward, out):
    """The error of a validation (batches of 3 prompts, one response each) and of a filter_groups step
    (a first generation round of 3 prompts x N), rank 0's messages written to `out` (a line each)."""
    from tests.e2e.conftest import demo_trainer
    from trainer.errors import UserError

    trainer = demo_trainer(assets, run_dir, reward, f"data.val_files=[{assets}/val.jsonl]", "data.val_batch_size=3",
                           "data.train_batch_size=3", "data.gen_batch_size=3", "data.shuffle=false",
                           "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                           f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.balance_batch=false",
                           "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.save_freq=0",
                           "trainer.logger=[jsonl]", "data.max_response_length=4", f"trainer.n_gpus_per_node={world}")
    messages = []
    for phase in (trainer.validate, trainer.step):
        with pytest.raises(UserError) as raised:
            phase()
        messages.append(re.sub(r"^\(on rank \d+\) ", "", str(raised.value)))
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(messages))


def _messages(tmp_path, assets, world) -> list[str]:
    reward = tmp_path / "reward_both.py"
    reward.write_text(FAILING_BOTH)
    out = tmp_path / f"messages_{world}.txt"
    run_distributed(_validation_and_round_body, world, str(assets), str(tmp_path / f"run_both_{world}"), str(reward),
                    str(out), timeout=300)
    return out.read_text().split("\n")


def test_validation_and_filter_groups_errors_name_the_same_row_on_any_number_of_ranks(tiny_assets, tmp_path):
    """On 2 ranks each failing row is the second rank's (validation's 3 rows padded to 4: rank 1 holds
    rows 2 and 0; the round's 6 rows: rank 1 holds rows 3 to 5), where a rank's share named it by its
    place in that share."""
    val, train = (os.path.join(str(tiny_assets), f"{split}.jsonl") for split in ("val", "train"))
    one = _messages(tmp_path, tiny_assets, 1)
    validation, generation_round = one
    # the sixth validation prompt: the second batch's third prompt, its one response
    assert (f"raised on sample 2 of validation batch 2: prompt 2's response 1 of 1, data row {val}:6 "
            "(data_source='meshppo/demo_add')") in validation, validation
    # the third training prompt: the first round's third prompt, its first response
    assert (f"raised on sample {2 * N} of the step's generation round 1: prompt 2's response 1 of {N}, data row "
            f"{train}:3 (data_source='meshppo/demo_add')") in generation_round, generation_round
    assert all(m.endswith("ValueError: no score for this one") for m in one), one
    assert _messages(tmp_path, tiny_assets, 2) == one
