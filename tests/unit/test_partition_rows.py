"""The step's partition under Ulysses groups (`trainer.ppo_trainer.partition_rows`): the rows are balanced
over the data-parallel groups (ranks / group size), each group's part cut into its ranks' consecutive
shares, and verl's `global_seqlen/*` figures count a group's ranks as one part; against values worked out
by hand. tests/multiproc/test_ulysses_balance.py runs it in a trainer."""

import pytest
import torch

from trainer.ppo_trainer import contiguous_parts, partition_rows, seqlen_balance_metrics
from trainer.rollout_batch import RolloutBatch

LENGTHS = [10, 2, 7, 3, 8, 6, 1, 5]  # prompt + response tokens of each row, 42 in all


def _batch(prompts: list[list[int]], response_lengths: list[int]) -> RolloutBatch:
    n = len(prompts)
    responses = [[5] * m for m in response_lengths]
    return RolloutBatch(prompts, responses, list(range(n)), [None] * n, [None] * n, [{}] * n, ["stop"] * n,
                        [[0.0] * m for m in response_lengths], max(response_lengths), torch.device("cpu"))


def test_rows_balance_over_the_groups_and_split_inside_them():
    ro = _batch([[1]] * 8, [m - 1 for m in LENGTHS])
    parts = partition_rows(ro, 4, 2, balance=True, keep_prompts=False)
    # over 2 groups, longest first to the lighter part (4 rows each): 10, 6, 3, 2 (21) and 8, 7, 5, 1 (21);
    # each group's part, in the batch's order, halved between its 2 ranks
    assert parts == [[0, 1], [3, 5], [2, 4], [6, 7]]
    got = seqlen_balance_metrics(LENGTHS, parts, 2)
    # the figures of the 2 groups: blocks 10+2+7+3 = 22 and 8+6+1+5 = 20, then 21 and 21
    want = dict(min=20, max=22, minmax_diff=2, balanced_min=21, balanced_max=21, mean=21)
    assert got == pytest.approx({f"global_seqlen/{k}": float(v) for k, v in want.items()}, abs=1e-9)


def test_prompt_groups_stay_in_one_data_parallel_group():
    # 6 prompts of 2 rows each: the 2 groups of 2 ranks divide them, the 4 ranks do not
    prompts = [[10 + p, 20 + p, 30] for p in range(6) for _ in range(2)]
    ro = _batch(prompts, [1 + (3 * i) % 5 for i in range(12)])
    parts = partition_rows(ro, 4, 2, balance=True, keep_prompts=True)
    assert sorted(i for part in parts for i in part) == list(range(12)) and {len(p) for p in parts} == {3}
    for group in (parts[0] + parts[1], parts[2] + parts[3]):
        assert group == sorted(group)  # the group pools its part back in the batch's order
        assert len({tuple(prompts[i]) for i in group}) == 3  # 3 whole prompts: 6 rows, 3 prompts


def test_without_balancing_the_ranks_take_consecutive_blocks():
    ro = _batch([[1]] * 8, [m - 1 for m in LENGTHS])
    assert partition_rows(ro, 4, 2, balance=False, keep_prompts=True) == contiguous_parts(8, 4)
