"""The tensor-parallel process group of the engine, taken from a DeviceMesh.

TP=1 (no mesh, or a mesh of size 1) needs no process group at all: every collective is
then a no-op. Collectives always run on the mesh's group, never the world group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# `all_gather_into_tensor` was renamed `all_gather_single` (torch 2.13); both take a flat output.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPGroup:
    """Rank, size and collectives of one TP group."""

    def __init__(self, group=None):
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def from_mesh(cls, tp_mesh) -> "TPGroup":
        """`tp_mesh`: None, a 1-D DeviceMesh, or one named dimension of a larger mesh (`mesh["tp"]`)."""
        if tp_mesh is None or tp_mesh.size() == 1:
            return cls(None)
        if tp_mesh.ndim != 1:
            raise ValueError(f"tp_mesh must be 1-D (a mesh dimension such as mesh['tp']), got {tp_mesh.ndim} dims")
        return cls(tp_mesh.get_group())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns `t`)."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_min(self, value: int, device) -> int:
        """The smallest `value` over the group (host integer; for sizing decisions, not hot paths)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """`[size, *t.shape]`: every rank's `t`, in rank order."""
        if self.size == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_flat(out, t.reshape(-1), group=self.group)
        return out.view(self.size, *t.shape)
