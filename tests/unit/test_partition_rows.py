"""The step's partition (`trainer.ppo_trainer.partition_rows`), verl 0.9.1's trainer's `_balance_batch`:
Karmarkar-Karp on verl's work estimate over the data-parallel groups (ranks / group size), each part in the
batch's order (a rank's mini-batches are cut from it), each group's part cut into its ranks' consecutive
shares; whole prompt groups under prefix sharing; verl's `global_seqlen/*` figures count a group's ranks as
one part.
Against values worked out by hand. tests/multiproc/test_ulysses_balance.py runs it in a trainer,
tests/multiproc/test_balance_mini_batches.py checks the mini-batches it gives on 2 ranks."""

import pytest
import torch

from trainer.ppo_trainer import contiguous_parts, partition_rows, seqlen_balance_metrics
from trainer.rollout_batch import RolloutBatch

LENGTHS = [10, 2, 7, 3, 8, 6, 1, 5]  # prompt + response tokens of each row, 42 in all


def _batch(prompts: list[list[int]], response_lengths: list[int], uids: list[int] | None = None) -> RolloutBatch:
    n = len(prompts)
    responses = [[5] * m for m in response_lengths]
    return RolloutBatch(prompts, responses, list(range(n)) if uids is None else uids, [None] * n, [None] * n, [{}] * n, ["stop"] * n,
                        [[0.0] * m for m in response_lengths], max(response_lengths), torch.device("cpu"))


def test_rows_balance_over_the_groups_and_split_inside_them():
    ro = _batch([[1]] * 8, [m - 1 for m in LENGTHS])
    parts = partition_rows(ro, 4, 2, balance=True, keep_prompts=False)
    # Karmarkar-Karp over 2 groups on 24576 s + s²: by increasing length the runs {1, 2}, {3, 5}, {6, 7},
    # {8, 10}. {8, 10} (spread 2 tokens + 36) merges with {3, 5} (2 + 16): {10, 3} = 13 (s² 109) and {8, 5}
    # = 13 (89); {6, 7} (1 + 13) with {1, 2} (1 + 3): {7, 1} = 8 (50) and {6, 2} = 8 (40); then those two:
    # {10, 3, 6, 2} = 21 (149, group 0: rows 0, 1, 3, 5) and {8, 5, 7, 1} = 21 (139: rows 2, 4, 6, 7), each
    # in the batch's order, halved between its ranks
    assert parts == [[0, 1], [3, 5], [2, 4], [6, 7]]
    got = seqlen_balance_metrics(LENGTHS, parts, 2)
    # the figures of the 2 groups: blocks 10+2+7+3 = 22 and 8+6+1+5 = 20, then 21 and 21
    want = dict(min=20, max=22, minmax_diff=2, balanced_min=21, balanced_max=21, mean=21)
    assert got == pytest.approx({f"global_seqlen/{k}": float(v) for k, v in want.items()}, abs=1e-9)


def test_the_parts_are_karmarkar_karps_not_largest_first():
    lengths = [9, 1, 4, 7, 5, 10]
    ro = _batch([[1]] * 6, [m - 1 for m in lengths])
    # test_batching's hand-worked case: {10, 1, 7} (rows 1, 3, 5) and {9, 4, 5} (rows 0, 2, 4), 18 tokens
    # each, where largest first to the lighter part gave 10 + 5 + 4 = 19 and 9 + 7 + 1 = 17
    parts = partition_rows(ro, 2, 1, balance=True, keep_prompts=False)
    assert parts == [[1, 3, 5], [0, 2, 4]]
    want = dict(min=14, max=22, minmax_diff=8, balanced_min=18, balanced_max=18, mean=18)
    assert seqlen_balance_metrics(lengths, parts) == pytest.approx(
        {f"global_seqlen/{k}": float(v) for k, v in want.items()}, abs=1e-9)
    # one data-parallel rank keeps the batch's order, as verl's trainer does
    assert partition_rows(ro, 1, 1, balance=True, keep_prompts=False) == [list(range(6))]


def test_prompt_groups_stay_in_one_data_parallel_group():
    # 6 prompts of 2 rows each: the 2 groups of 2 ranks divide them, the 4 ranks do not
    prompts = [[10 + p, 20 + p, 30] for p in range(6) for _ in range(2)]
    ro = _batch(prompts, [1 + (3 * i) % 5 for i in range(12)], [p for p in range(6) for _ in range(2)])
    parts = partition_rows(ro, 4, 2, balance=True, keep_prompts=True)
    assert sorted(i for part in parts for i in part) == list(range(12)) and {len(p) for p in parts} == {3}
    for group in (parts[0] + parts[1], parts[2] + parts[3]):
        assert group == sorted(group)  # the group pools its part back in the batch's order
        assert len({tuple(prompts[i]) for i in group}) == 3  # 3 whole prompts: 6 rows, 3 prompts
    # verl's group balance: rows of 4, 7 | 5, 8 | 6, 4 | 7, 5 | 8, 6 | 4, 7 tokens, the prompts' rows 11, 13, 10, 12,
    # 14, 11 tokens (s² 65, 89, 52, 74, 100, 65); by increasing work prompts 2, 0, 5, 3, 1, 4, in runs of 2
    # with spreads of 1 token + 13, + 9 and + 11. {2, 0} merges with {1, 4}: {0, 1} = 24 (154) and {2, 4} =
    # 24 (152); then {5, 3} with those: {3, 2, 4} = 36 to group 0, {5, 0, 1} = 35 to group 1
    assert parts[0] + parts[1] == [4, 5, 6, 7, 8, 9] and parts[2] + parts[3] == [0, 1, 2, 3, 10, 11]
    lengths = ro.lengths()
    want = dict(min=34, max=37, minmax_diff=3, balanced_min=35, balanced_max=36, mean=35.5)
    assert seqlen_balance_metrics(lengths, parts, 2) == pytest.approx(
        {f"global_seqlen/{k}": float(v) for k, v in want.items()}, abs=1e-9)


def test_prompt_groups_that_do_not_divide_fall_back_to_the_row_balance():
    # 3 prompts over 2 ranks: verl's group balance refuses the step; meshppo balances the rows as without
    # prefix sharing (equal row counts a rank, which its collectives need)
    lengths = [9, 1, 4, 7, 5, 10]
    ro = _batch([[1]] * 6, [m - 1 for m in lengths], [0, 0, 1, 1, 2, 2])
    assert partition_rows(ro, 2, 1, balance=True, keep_prompts=True) == [[1, 3, 5], [0, 2, 4]]


def test_without_balancing_the_ranks_take_consecutive_blocks():
    ro = _batch([[1]] * 8, [m - 1 for m in LENGTHS])
    assert partition_rows(ro, 4, 2, balance=False, keep_prompts=True) == contiguous_parts(8, 4)
