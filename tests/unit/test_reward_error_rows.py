"""How a reward function's error names a row (`trainer.ppo_trainer.reward_row_names`, kept with each row
as `RolloutBatch.row_names` and passed to the reward managers' `row_names`): by its place in the whole
batch and the data, not by its place in the share of the batch that one rank scores. The shares here are
permutations, as `trainer.balance_batch` makes them; tests/multiproc/test_reward_error_rows.py runs the
trainer's step, validation and filter_groups rounds on 1, 2 and 3 ranks."""

from __future__ import annotations

import math

import pytest

from rewards import BatchRewardManager, NaiveRewardManager, RewardError
from tests.unit.test_dumps import dump_trainer, rows_of
from trainer.errors import UserError
from trainer.ppo_trainer import reward_row_names
from trainer.rollout_batch import RolloutBatch

# 3 prompts x 2 responses in the engine's order; the second prompt's item came from no file
ITEMS = [{"where": "data/train.jsonl:7"}, {}, {"where": "data/train.jsonl:2"}]


def _batch():
    full = rows_of([1] * 6)  # row i's response decodes to "i"
    full.uids = [0, 0, 1, 1, 2, 2]
    return full


def test_each_row_is_named_by_its_place_in_the_batch_its_prompt_and_its_data_row():
    names = reward_row_names(_batch(), ITEMS, "the step's batch")
    assert names[0] == "sample 0 of the step's batch: prompt 0's response 1 of 2, data row data/train.jsonl:7"
    assert names[3] == "sample 3 of the step's batch: prompt 1's response 2 of 2"  # (no data row known)
    assert names[4] == "sample 4 of the step's batch: prompt 2's response 1 of 2, data row data/train.jsonl:2"
    # responses counted within their prompt wherever its rows are
    mixed = rows_of([1] * 3)
    mixed.uids = [2, 0, 2]
    assert [n.split(": ")[1] for n in reward_row_names(mixed, ITEMS, "x")] == [
        "prompt 2's response 1 of 2, data row data/train.jsonl:2", "prompt 0's response 1 of 1, data row "
        "data/train.jsonl:7", "prompt 2's response 2 of 2, data row data/train.jsonl:2"]


def _raise_on_4(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "4":
        raise ValueError("boom")
    return 1.0


def _nan_on_4(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan if solution_str == "4" else 1.0


SHARE = [5, 4, 0]  # a rank's rows, in a balanced partition's order: row 4 is the share's second


def test_the_names_travel_with_the_rows():
    full = _batch()
    full.row_names = reward_row_names(full, ITEMS, "round 1")
    assert full.take(SHARE).row_names == [full.row_names[i] for i in SHARE]
    joined = RolloutBatch.concat([full.take([4, 5]), full.take([0])])  # (filter_groups' kept rows)
    assert joined.row_names == [full.row_names[i] for i in (4, 5, 0)]
    assert RolloutBatch.concat([full, _batch()]).row_names is None  # (one batch never named)


@pytest.mark.parametrize("fn, what", [(_raise_on_4, "raised on"), (_nan_on_4, "returned non-finite score nan on")])
def test_a_ranks_share_names_the_failing_row_of_the_whole_batch(tmp_path, fn, what):
    full = _batch()
    trainer = dump_trainer(tmp_path, reward_fn=fn)
    # without names (rows that were never named): the position in the rows given
    with pytest.raises(UserError, match=rf"{what} sample 1 \(data_source='d'\)"):
        trainer._score(full.take(SHARE))
    full.row_names = reward_row_names(full, ITEMS, "the step's batch")
    with pytest.raises(UserError) as raised:
        trainer._score(full.take(SHARE))  # the share keeps its rows' names
    assert (f"{what} sample 4 of the step's batch: prompt 2's response 1 of 2, data row data/train.jsonl:2 "
            "(data_source='d')") in str(raised.value), raised.value


def test_spread_scoring_hands_the_names_out_with_the_rows(tmp_path):
    """`_score_spread` (remax's greedy responses, validation) pads the rows to the ranks and hands each
    rank its share: the names go with them."""
    full = _batch()
    full.row_names = reward_row_names(full, ITEMS, "the step's greedy responses (remax)")
    trainer = dump_trainer(tmp_path, reward_fn=_raise_on_4)
    trainer.ctx.world_size = 1
    trainer._partition = lambda ro: (ro.take(SHARE), [SHARE])  # this rank's share of the (padded) rows
    with pytest.raises(UserError, match=r"raised on sample 4 of the step's greedy responses \(remax\): prompt 2's "):
        trainer._score_spread(full)


def _bad_item(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"acc": 1.0} if s == "4" else 1.0 for s in solution_strs]


def test_every_manager_names_the_row_it_is_given():
    texts = ["5", "4", "0"]
    row_names = [f"row {i}" for i in SHARE]
    args = (["d"] * 3, texts, ["g"] * 3, [{}] * 3, [1] * 3)
    with pytest.raises(RewardError, match=r"raised on row 4 \(data_source='d'\)"):
        NaiveRewardManager(_raise_on_4).score(*args, row_names)
    with pytest.raises(RewardError, match=r"a dict without a 'score' key on row 4 \(data_source='d'\)"):
        BatchRewardManager(_bad_item)(*args, row_names)
    with pytest.raises(ValueError, match="row_names"):  # one name a row
        NaiveRewardManager(_raise_on_4).score(*args, row_names[:2])
