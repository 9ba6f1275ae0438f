"""`trainer.nccl_timeout` bounds the meshes' sub-groups too, not only the default group: torch gives a
DeviceMesh's groups its own default (30 min on gloo, 10 on NCCL). On 4 gloo ranks, with HSDP
(2 replicas of 2 shards) or an engine of TP 2 (a group smaller than the world: a group of all
ranks is the default group itself), the other ranks enter a collective of one group 5 s late;
with a 2 s timeout rank 0's wait ends in about 2 s (it used to complete after the 5 s; the bound of 4 s is
2 s from either)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tests.dist_utils import free_port, run_distributed


def _body(rank, world, which):
    import torch.distributed as dist

    from sharding.mesh import ParallelDims
    from trainer.launch import init_distributed

    # Set up again as the trainer does, with its timeout, on a store of a port agreed first: a rank
    # that met the old store again would lose it when rank 0 tears it down.
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    init_distributed("cpu", timeout_s=2)
    fsdp_size, tp = (2, 1) if which == "dp_replicate" else (4, 2)
    meshes = ParallelDims(world_size=world, fsdp_size=fsdp_size, tp=tp, local_world_size=world).build_meshes(
        "cpu", timeout_s=2)
    group = (meshes.train["dp_replicate"] if which == "dp_replicate" else meshes.gen["tp"]).get_group()
    if rank != 0:
        time.sleep(5)
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        outcome = "completed"
    except RuntimeError:
        outcome = "timed out"
    waited = time.perf_counter() - t0
    if rank == 0:
        assert outcome == "timed out" and waited < 4, (which, outcome, waited)
    # the groups are broken now: leave without the harness's closing barrier
    sys.stdout.flush()
    time.sleep(2)
    os._exit(0)


@pytest.mark.parametrize("which", ["dp_replicate", "tp"])
def test_mesh_groups_wait_the_configured_timeout(which):
    run_distributed(_body, 4, which, timeout=120)


def _whole_world_body(rank, world):
    import torch.distributed as dist

    from sharding.mesh import ParallelDims

    # a dimension of every rank is the default group itself (it has the timeout): no second communicator
    hsdp = ParallelDims(world_size=world, fsdp_size=1, tp=1, local_world_size=world).build_meshes("cpu", timeout_s=2)
    assert hsdp.train["dp_replicate"].get_group() is dist.group.WORLD
    tp = ParallelDims(world_size=world, fsdp_size=-1, tp=2, local_world_size=world).build_meshes("cpu", timeout_s=2)
    assert tp.gen["tp"].get_group() is dist.group.WORLD and tp.train["dp_shard"].get_group() is dist.group.WORLD


def test_a_mesh_dimension_of_every_rank_is_the_default_group():
    run_distributed(_whole_world_body, 2)
