"""The trainer's collectives, each on a tensor its group's backend accepts.

NCCL only moves CUDA tensors and gloo only CPU tensors; a CPU scalar handed to an NCCL
all-reduce fails at run time ("No backend type associated with device type cpu"), and no gloo
test notices. So the runtime never calls `torch.distributed` directly for tensors it built
itself: it calls these functions, which put the data on `group_device(group)` and hand the
result back on the caller's device. Where the data already lives on the right device (every
GPU-resident statistic) nothing is copied.

The one exception is the engine (`rollout/parallel.py`), whose collectives only ever see
tensors on the engine's device; FSDP2 and DTensor issue their own. A multi-rank test traces
every collective of trainer runs and fails on any other call site
(`tests/multiproc/test_collective_devices.py`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_device(group=None) -> torch.device:
    """The device a tensor must live on for a collective on `group`: the current CUDA device
    for NCCL, the CPU for gloo (and for no process group at all)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The reduction of `t` over `group` (`op`: sum, max, min), on `t`'s device: `t` itself,
    reduced in place, when it lives on the group's device; otherwise a reduced copy."""
    if world_size(group) == 1:
        return t
    dev = group_device(group)
    if t.device == dev:
        dist.all_reduce(t, op=_OPS[op], group=group)
        return t
    buf = t.to(dev)
    dist.all_reduce(buf, op=_OPS[op], group=group)
    return buf.to(t.device)


def all_reduce_async(t: torch.Tensor, op: str = "sum", group=None):
    """Start reducing `t` in place over `group`; returns the work to `wait()` on (None when
    there is nothing to reduce). `t` must already live on the group's device: an asynchronous
    reduction of a copy would hand nothing back."""
    if world_size(group) == 1:
        return None
    dev = group_device(group)
    if t.device != dev:
        raise ValueError(f"all_reduce_async needs a tensor on {dev} for this group, got one on {t.device}")
    return dist.all_reduce(t, op=_OPS[op], group=group, async_op=True)


def all_reduce_values(values: Sequence[float], op: str = "sum", group=None) -> list[float]:
    """Reduce a few Python numbers in one collective (float64, so integer counts stay exact)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=group_device(group))
    return all_reduce(t, op, group).tolist()


def all_reduce_sum(x: float, group=None) -> float:
    return all_reduce_values([x], "sum", group)[0]


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on every rank), in rank order, on `t`'s device."""
    n = world_size(group)
    if n == 1:
        return [t]
    dev = group_device(group)
    buf = t.contiguous().to(dev)
    parts = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(parts, buf, group=group)
    return [p.to(t.device) for p in parts]


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """The ranks' `t`, in rank order, written into `out` (`[n * t.numel()]`-shaped, preallocated), with no copy: both
    must already be on the group's device (the resharder's buckets). torch 2.13 renamed all_gather_into_tensor to
    all_gather_single (the old name warns); the GPU image runs 2.11. Looked up at each call, as every collective here
    is, so a wrapper installed after import (tests/multiproc/test_collective_devices.py) sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)


def all_to_all_into(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """`t`'s equal chunks to the ranks in order, the chunks they send written into `out` (preallocated, `t`'s size),
    with no copy: both must already be on the group's device (the resharder's buffers)."""
    dist.all_to_all_single(out, t, group=group)


def all_to_all(t: torch.Tensor, group=None) -> torch.Tensor:
    """`t [n, ...]` (n = the group's size): chunk `k` goes to rank `k`; returns `[n, ...]` whose
    chunk `k` came from rank `k`, on `t`'s device."""
    if world_size(group) == 1:
        return t
    dev = group_device(group)
    buf = t.contiguous().to(dev)
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)
    return out.to(t.device)


__all__ = ["all_gather", "all_gather_into", "all_reduce", "all_to_all_into", "all_to_all", "all_reduce_async", "all_reduce_sum", "all_reduce_values", "group_device", "rank", "world_size"]


class RankFailed(Exception):
    """An error one rank or more hit, raised on every rank at the same point (`on_every_rank`):
    `error` is this rank's own (None where only another rank failed), `rank` the lowest that failed."""

    def __init__(self, error: BaseException | None, rank: int):
        self.error, self.rank = error, rank
        super().__init__(f"{type(error).__name__}: {error}" if error is not None else f"rank {rank} failed")


def on_every_rank(fn: Callable[[], object] | None, errors: tuple[type[BaseException], ...] = (OSError,)) -> None:
    """Call `fn` (on the ranks that pass one: often rank 0 alone writes a file), then agree with
    every rank in one collective whether it raised one of `errors` anywhere; if so every rank
    raises `RankFailed`, so that none is left waiting in a collective the failed rank never enters.
    Other exceptions propagate at once, as they would without it."""
    error = None
    if fn is not None:
        try:
            fn()
        except errors as e:
            error = e
    ranks = world_size()
    first = int(all_reduce_values([rank() if error is not None else ranks], "min")[0])
    if first < ranks:
        raise RankFailed(error, first)
