"""Fixtures of the GPU tests."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def meshes():
    """A one-rank NCCL world in this process."""
    from sharding import ParallelDims

    torch.cuda.set_device(torch.device("cuda", 0))
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield ParallelDims(1).build_meshes("cuda")
    dist.destroy_process_group()
