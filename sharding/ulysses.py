"""Ulysses sequence parallelism: the tokens of one micro-batch spread over a group of ranks.

verl's `ulysses_sequence_parallel_size` (DeepSpeed-Ulysses). A role with size `s > 1` runs each
packed micro-batch on the `s` ranks of its group together: each rank holds a contiguous `1/s`
of the micro-batch's tokens through the embeddings, projections, MLPs, norms and the LM head, so
the activations a rank keeps shrink by `s` and sequences longer than one GPU holds can train.
Attention needs every token of a sequence: one all-to-all before it trades the token split for a
head split (`[T/s, H, D]` -> `[T, H/s, D]`, q, k and v in one collective), each rank attends over
the whole micro-batch with its `H/s` heads, and one all-to-all after it trades back. K/V heads
fewer than `s` are repeated first, so that each rank's query heads find their K/V head.

The groups are `s` consecutive ranks (`rank // s`), inside a node where the node's size is known:
the all-to-alls move every layer's q/k/v and output. The ranks of a group pool their rollout rows
(`trainer.roles`): a role with size `s` has `W / s` data-parallel groups, each processing its
pooled rows, micro-batch by micro-batch, on all of its ranks at once.

Gradients: every rank of a group computes the group's loss from the gathered per-token outputs,
and its backward reaches only its own tokens (the all-to-alls carry the attention's share across
ranks). The group's gradient is the sum over its ranks, and FSDP averages over all `W` ranks, not
over the `W / s` groups: the gather's backward therefore scales its rank's share by `s`, so that
the averaged gradient is the mean over the data-parallel groups (as verl's gather does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sharding import comm


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's Ulysses group: `size` consecutive ranks, this one `rank` of them."""

    group: object  # the ProcessGroup
    size: int
    rank: int

    def attention(self, attention, q, k, v, *args):
        """`head_split_attention` over this group (what a model's attention layer calls)."""
        return head_split_attention(attention, q, k, v, self, *args)


def check_sequence_parallel(key: str, size: int, world_size: int, local_world_size: int | None = None,
                            heads: int | None = None, kv_heads: int | None = None) -> None:
    """Whether `size` (the config option `key`) can split this launch and this model's attention;
    raises ValueError naming the option otherwise."""
    if size < 1:
        raise ValueError(f"{key}={size} must be >= 1")
    if size == 1:
        return
    if world_size % size:
        raise ValueError(f"{key}={size} does not divide the {world_size} ranks of the launch: the ranks form groups "
                         f"of {size} consecutive ranks")
    if local_world_size is not None and local_world_size % size:
        raise ValueError(f"{key}={size} does not divide the {local_world_size} ranks of a node: a group's all-to-alls "
                         "run every layer, so a group stays inside one node")
    if heads is not None and heads % size:
        raise ValueError(f"{key}={size} does not divide the model's {heads} attention heads: each rank attends with "
                         f"heads / {size} of them")
    if kv_heads is not None and kv_heads % size and size % kv_heads:
        raise ValueError(f"{key}={size}: the model's {kv_heads} key/value heads neither divide among {size} ranks nor "
                         f"divide {size} (to be repeated)")


def group_ranks(world_size: int, size: int) -> list[list[int]]:
    """The groups' global ranks: `size` consecutive ranks each."""
    return [list(range(g, g + size)) for g in range(0, world_size, size)]


def build_sequence_parallel(size: int, world_size: int, device_type: str,
                            timeout_s: float | None = None) -> SequenceParallel | None:
    """This rank's group of `size` (collective: every rank calls it, with the same sizes in the same
    order); None for size 1."""
    if size == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from sharding.mesh import _timeout_override

    ranks = torch.tensor(group_ranks(world_size, size), dtype=torch.int)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("sp_dp", "sp"),
                      backend_override=_timeout_override(device_type, timeout_s, ranks.shape, world_size))
    group = mesh["sp"].get_group()
    return SequenceParallel(group, size, dist.get_rank(group))


def apply_sequence_parallel(model: torch.nn.Module, sp: SequenceParallel | None) -> None:
    """Make every attention layer of `model` run split by heads over `sp` on packed input: the
    model is then called with this rank's token shard and the whole micro-batch's `cu_seqlens`
    (`trainer.forward.build_micro_batch(..., sp=sp)`)."""
    from models.transformer import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            m.sequence_parallel = sp


# ------------------------------------------------------------------ the layout
def padded_length(tokens: int, size: int) -> int:
    """The micro-batch's length padded to a multiple of `size` (equal token shards)."""
    return -(-tokens // size) * size


def shard_bounds(padded: int, sp: SequenceParallel) -> tuple[int, int]:
    """This rank's token range `[lo, hi)` of a padded micro-batch."""
    n = padded // sp.size
    return sp.rank * n, (sp.rank + 1) * n


def per_shard_counts(positions: np.ndarray, padded: int, size: int) -> list[int]:
    """How many of the sorted flat `positions` fall in each rank's shard."""
    n = padded // size
    edges = np.searchsorted(positions, np.arange(size + 1) * n)
    return np.diff(edges).tolist()


# ------------------------------------------------------------------ collectives with gradients
def _seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """`[T/s, h, D]` (this rank's tokens, every head) -> `[T, h/s, D]` (every token, this rank's heads)."""
    t, h, d = x.shape
    s = sp.size
    chunks = x.reshape(t, s, h // s, d).transpose(0, 1)  # chunk k: rank k's heads of my tokens
    return comm.all_to_all(chunks, sp.group).reshape(s * t, h // s, d)


def _heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """`[T, h/s, D]` -> `[T/s, h, D]`: the inverse of `_seq_to_heads`."""
    total, hs, d = x.shape
    s = sp.size
    got = comm.all_to_all(x.reshape(s, total // s, hs, d), sp.group)  # chunk k: my tokens, rank k's heads
    return got.transpose(0, 1).reshape(total // s, s * hs, d)


class _Exchange(torch.autograd.Function):
    """`_seq_to_heads` (`to_heads`) or `_heads_to_seq`; the backward is the other one."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.sp), None, None


def head_split_attention(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel,
                         *args) -> torch.Tensor:
    """`attention(q, k, v, *args)` over the whole micro-batch with this rank's `1/s` of the heads,
    from and back to this rank's token shard: q `[T/s, Hq, D]`, k/v `[T/s, Hkv, D]` -> `[T/s, Hq, D]`.
    q, k and v travel in one all-to-all; K/V heads fewer than `s` are repeated to `s` first (each
    rank's query heads then all read its one K/V head)."""
    s = sp.size
    if k.shape[1] % s:
        rep = s // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    hq, hk = q.shape[1] // s, k.shape[1] // s
    t, d = q.shape[0], q.shape[2]
    # [T/s, s, heads of one rank, D] for each, side by side per rank: one collective for the three
    packed = torch.cat([x.reshape(t, s, x.shape[1] // s, d) for x in (q, k, v)], dim=2).flatten(1, 2)
    full = _Exchange.apply(packed, sp, True)
    qf, kf, vf = full.split([hq, hk, hk], dim=1)
    return _Exchange.apply(attention(qf, kf, vf, *args), sp, False)


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; backward: this rank's rows of the gradient,
    times the group size (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, sp, counts):
        ctx.sp, ctx.counts = sp, counts
        most = max(counts)
        padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0])) if x.shape[0] < most else x
        parts = comm.all_gather(padded, sp.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.counts[:ctx.sp.rank])
        return grad[start:start + ctx.counts[ctx.sp.rank]] * ctx.sp.size, None, None


def gather_rows(x: torch.Tensor, sp: SequenceParallel, counts: list[int]) -> torch.Tensor:
    """The group's rows of `x` (`counts[k]` rows on rank k), in rank order, on every rank."""
    return _GatherRows.apply(x, sp, list(counts))


__all__ = ["SequenceParallel", "apply_sequence_parallel", "build_sequence_parallel", "check_sequence_parallel",
           "gather_rows", "group_ranks", "head_split_attention", "padded_length", "per_shard_counts", "shard_bounds"]
