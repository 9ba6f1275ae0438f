import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def test_gloo_all_reduce_two_ranks():
    run_distributed(_allreduce, 2)
