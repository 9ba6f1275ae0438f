"""`roles.pool_rows` (a Ulysses group's rows pooled, 2 gloo ranks): every per-row list a batch has
comes along, a multi-turn batch's turn masks among them, so the pooled `response_mask` keeps the
tool tokens masked out as each rank's own did."""

import torch

from tests.dist_utils import run_distributed


def _body(rank, world_size):
    import torch.distributed as dist

    from sharding.ulysses import SequenceParallel
    from trainer.roles import pool_rows
    from trainer.rollout_batch import RolloutBatch

    def batch(r):  # rank r's rows: two multi-turn samples, its own lengths and masks
        responses = [[1, 2, 3, 4, 5][:3 + r], [6, 7]]
        masks = [[1, 0, 0, 1, 1][:3 + r], [1, 1]]
        n = len(responses)
        return RolloutBatch([[9]] * n, responses, [r, r], ["s"] * n, [None] * n, [{}] * n, ["stop"] * n, [[0.0]] * n,
                            width=5, device=torch.device("cpu"), raw_prompts=[f"p{r}"] * n, turn_masks=masks,
                            num_turns=[4 + r, 2])

    sp = SequenceParallel(dist.new_group([0, 1]), 2, rank)
    pooled, mine = pool_rows(batch(rank), sp)
    assert mine == slice(2 * rank, 2 * rank + 2)
    assert pooled.turn_masks == list(batch(0).turn_masks) + list(batch(1).turn_masks)
    assert pooled.num_turns == [4, 2, 5, 2] and pooled.raw_prompts == ["p0", "p0", "p1", "p1"]
    assert pooled.response_mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 0]]


def test_pooled_rows_keep_the_turn_masks():
    run_distributed(_body, 2)
