"""`trainer.balance_batch` decides which rows train together, as in verl 0.9.1: each data-parallel rank cuts
its mini-batches from its own part of the balanced batch, in the part's order, so a mini-batch of the
update is the k-th rows of every rank's part. On 2 gloo ranks, the step's partition (`partition_rows`) and
the update's plan (`plan_update`, its loss units all-reduced over the ranks) give the mini-batches of
verl's balanced batch (Karmarkar-Karp on its work estimate), worked out by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

LENGTHS = [10, 2, 5, 8, 6, 11]  # a 1-token prompt and a response of the rest


def _body(rank, world_size):
    from trainer.ppo_trainer import partition_rows
    from trainer.rollout_batch import RolloutBatch
    from trainer.roles import plan_update

    n = len(LENGTHS)
    responses = [[5] * (m - 1) for m in LENGTHS]
    full = RolloutBatch([[1]] * n, responses, list(range(n)), [None] * n, [None] * n, [{}] * n, ["stop"] * n,
                        [[0.0] * len(r) for r in responses], max(map(len, responses)), torch.device("cpu"))
    parts = partition_rows(full, world_size, 1, balance=True, keep_prompts=False)
    # Karmarkar-Karp on 24576 s + s²: by increasing length the runs {2, 5}, {6, 8}, {10, 11} (spreads 3, 2
    # and 1 tokens); the first two merge, {5, 6} = 11 and {2, 8} = 10; then {10, 11}, which has the larger
    # spread (1 token + 21 against 1 token - 7): {11, 2, 8} = 21 (s² 189, rank 0) and {10, 5, 6} = 21 (161).
    # (Largest first to the lighter part gave rows 2, 4, 5 and 0, 1, 3: 22 and 20 tokens.)
    assert parts == [[1, 3, 5], [0, 2, 4]]
    mine = parts[rank]
    plan = plan_update(full.take(mine), epochs=1, num_mini_batches=3, shuffle=False, seed=0, micro_size=None,
                       dynamic=False, max_tokens=10**6)
    rows = [[mine[i] for micro in mb.parts for i in micro] for mb in plan]
    every: list = [None] * world_size
    dist.all_gather_object(every, rows)
    batches = [sorted(r for rank_rows in every for r in rank_rows[k]) for k in range(3)]
    # the k-th row of each rank's part
    assert batches == [[0, 1], [2, 3], [4, 5]]
    # the loss units are the whole mini-batch's, over both ranks: 9 + 1, 4 + 7 and 5 + 10 response tokens
    assert [mb.global_tokens for mb in plan] == [10.0, 11.0, 15.0]
    assert [mb.global_seqs for mb in plan] == [2.0, 2.0, 2.0]


def test_each_mini_batch_is_the_kth_rows_of_every_ranks_balanced_part():
    run_distributed(_body, 2, timeout=300)
