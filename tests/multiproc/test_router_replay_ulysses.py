"""Routing replay R2 under Ulysses sequence parallelism (2 gloo ranks, one group of 2, float64, CPU): the actor's
old-log-prob pass runs the group's pooled rows, each rank on its shard of every micro-batch, and records its routing;
the group's shards are gathered and each rank keeps its own rows' record (`ro.routed_experts`), which is each row's
own routing (a forward of the row alone on an unsharded copy), and laid out again as the group's shards a forward
replaying it computes, at every token of each shard, the logits of the forward that routes (bit for bit)."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank, world_size, share):
    from models import Transformer
    from sharding.ulysses import apply_sequence_parallel, build_sequence_parallel, shard_bounds
    from tests.unit.test_router_replay import check_record_is_each_rows_routing, moe_args, r2_actor, r2_rollouts
    from trainer.forward import build_micro_batch
    from trainer.roles import pool_rows

    sp = build_sequence_parallel(2, world_size, "cpu")
    plain = Transformer.build(moe_args(), seed=0).double()
    split = Transformer.build(moe_args(), seed=0).double()
    apply_sequence_parallel(split, sp)
    every = r2_rollouts()
    ro = every.take([0, 1, 2, 3, 4] if rank == 0 else [5, 6, 7, 8])  # a shared prompt's rows on both ranks
    actor = r2_actor(split, "shared_prefix" if share else "packed", micro=3, sp=sp)
    with torch.no_grad():
        actor.log_probs(ro)
    check_record_is_each_rows_routing(plain, ro)
    pooled, _ = pool_rows(ro, sp)  # the group's rows with their records
    assert len(pooled) == 9
    mine = build_micro_batch(pooled.prompts, pooled.responses, "cpu", True, 0, sp, share)
    replayed = build_micro_batch(pooled.prompts, pooled.responses, "cpu", True, 0, sp, share, pooled.routed_experts)
    lo, hi = shard_bounds(2 * mine.input_ids.shape[1], sp)
    real = torch.arange(lo, hi) < mine.work[0]  # the padding segment after the last token replays expert 0
    assert real.any()
    with torch.no_grad():
        assert torch.equal(split(replayed.input_ids, **replayed.model_kwargs())[0, real],
                           split(mine.input_ids, **mine.model_kwargs())[0, real])


@pytest.mark.parametrize("share", [False, True])
def test_r2_records_each_rows_routing_over_ulysses_shards_and_replays_it(share):
    run_distributed(_body, 2, share)
