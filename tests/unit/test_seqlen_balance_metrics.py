"""verl's `global_seqlen/*` figures of the step's balanced partition (`trainer.balance_batch`),
`trainer.ppo_trainer.seqlen_balance_metrics`, against values worked out by hand: each rank's tokens before
balancing (the batch cut into consecutive equal blocks in its order) and after it (the partition), and
the batch's tokens over the ranks. tests/multiproc/test_seqlen_balance_metrics.py reads them from a run."""

import pytest

from trainer.batching import balanced_equal_partitions
from trainer.ppo_trainer import seqlen_balance_metrics

LENGTHS = [10, 2, 7, 3, 8, 6]  # prompt + response tokens of each row, 36 in all


@pytest.mark.parametrize("parts, want", [
    # 2 ranks: blocks 10+2+7 = 19 and 3+8+6 = 17; the partition 10+2+6 = 18 and 7+3+8 = 18
    ([[0, 1, 5], [2, 3, 4]], dict(min=17, max=19, minmax_diff=2, balanced_min=18, balanced_max=18, mean=18)),
    # 3 ranks: blocks 12, 10 and 14; the partition 10+3 = 13, 2+8 = 10, 7+6 = 13
    ([[0, 3], [1, 4], [2, 5]], dict(min=10, max=14, minmax_diff=4, balanced_min=10, balanced_max=13, mean=12)),
    # 1 rank: nothing to balance, every figure the batch's
    ([list(range(6))], dict(min=36, max=36, minmax_diff=0, balanced_min=36, balanced_max=36, mean=36)),
])
def test_the_figures_are_each_ranks_tokens_before_and_after_balancing(parts, want):
    got = seqlen_balance_metrics(LENGTHS, parts)
    assert got == pytest.approx({f"global_seqlen/{k}": float(v) for k, v in want.items()}, abs=1e-9)


def test_the_partition_balances_these_lengths():
    parts = balanced_equal_partitions(LENGTHS, 3)
    got = seqlen_balance_metrics(LENGTHS, parts)
    assert got["global_seqlen/balanced_max"] - got["global_seqlen/balanced_min"] <= got["global_seqlen/minmax_diff"]
    assert got["global_seqlen/balanced_min"] <= got["global_seqlen/mean"] <= got["global_seqlen/balanced_max"]
