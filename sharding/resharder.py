"""FSDP actor → tensor-parallel engine weights, with zero redundancy (docs/ARCHITECTURE.md).

`apply_fsdp` shards every parameter on its TP dimension, and `ParallelDims` builds TP groups so
that TP shard `j` of a parameter is exactly FSDP chunks `[j·m, (j+1)·m)` (`m = S/t`, `S` the
shard-group size), held by micro-DP group `j`. Filling this rank's engine slots therefore
needs only an all-gather inside its micro-DP group: `P/t·(1 − t/S)` bytes received per rank
instead of the naive `P·(1 − 1/S)`.

Each parameter takes one of three routes, fixed once in a plan:

* `local`: `m == 1` (one GPU, or `t == S`): the rank's chunk *is* its TP shard — a cast-copy,
  no communication;
* `micro`: all-gather of the chunks inside the micro-DP group, in the engine dtype;
* `full`: parameters the engine replicates (norms, row-parallel biases: tiny) and parameters
  whose chunks do not line up with TP shards (a dimension not divisible by `S`; counted in
  `ReshardStats.num_fallback`) are gathered whole over the shard group and sliced.

Parameters are bucketed per layer: one collective per route per bucket, packed into
preallocated buffers in the engine dtype (bf16). On CUDA the packing and gathers of bucket
`i+1` run on a side stream while the default stream copies bucket `i` into the engine
(double-buffered: the extra memory is two bucket buffers, about two layers of one TP shard,
never a full model). A bucket made of one dim-0 parameter whose engine view is contiguous (the
embedding, the LM head) is gathered straight into the engine buffer, with no bucket buffer.

Going back to training needs no communication: the FSDP shards are only read. The naive path
(`reshard_naive`: `DTensor.full_tensor()` per parameter, then slice) is kept as the reference
and the benchmark baseline.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from models import tp_shard_dim
from sharding.fsdp import reshard_all

# torch 2.13 renamed all_gather_into_tensor (the old name warns); the GPU image runs 2.11.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Tensors at least this large get their own copy kernel; smaller ones go through one
# multi-tensor `_foreach_copy_` call, which saves a launch per norm / bias / small projection
# where launch latency, not bandwidth, is the cost.
FOREACH_MAX_NUMEL = 1 << 22

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass
class ReshardStats:
    """What one reshard moved, seen from this rank. Byte counts are in the engine dtype."""

    bytes_received: int = 0  # from other ranks, this call (collective payloads incl. padding)
    bytes_bound: int = 0  # zero-redundancy lower bound: Σ TP-sharded numel/t·(1−t/S) + Σ replicated numel·(1−1/S)
    param_bytes: int = 0  # P: the whole model in the engine dtype
    slot_bytes: int = 0  # bytes written into this rank's engine slots (≈ P/t)
    num_params: int = 0
    num_fallback: int = 0  # TP-sharded params gathered whole because their chunks do not align
    num_collectives: int = 0
    buffer_bytes: int = 0  # bucket buffers allocated for this call (the peak extra memory)
    seconds: float = 0.0  # host time of the call (the GPU may still be copying; synchronise to time it)
    naive: bool = False


@dataclass
class _Item:
    name: str
    param: DTensor
    tp_dim: int | None
    fsdp_dim: int
    route: str  # "local" | "micro" | "full"
    fallback: bool
    chunk_shape: tuple[int, ...]  # per-rank piece as packed (padded to FSDP's padded chunk for "full")
    offset: int = 0  # into the bucket's per-rank send buffer

    @property
    def numel(self) -> int:
        return math.prod(self.chunk_shape)


@dataclass
class _Bucket:
    name: str
    local: list[_Item] = field(default_factory=list)
    micro: list[_Item] = field(default_factory=list)
    full: list[_Item] = field(default_factory=list)
    micro_numel: int = 0
    full_numel: int = 0
    direct: bool = False  # the single micro item is gathered straight into its engine view


class Resharder:
    """Writes an FSDP model's weights into the engine's TP slots (see the module docstring).

    `model`: the FSDP2 actor built by `apply_fsdp` / `build_fsdp_model` (parameters are
    DTensors on `meshes.train`). `meshes`: `ParallelDims.build_meshes()`. `target`: the engine
    (anything with `param_slots()`) or a mapping `training name → slot`, where a slot has
    `.view` (this rank's TP shard of the parameter, a view into the engine's buffers) and
    `.shard_dim` (the TP dimension, None when replicated). `foreach_max_numel`: on CUDA, local
    cast-copies of tensors smaller than this go through one multi-tensor `_foreach_copy_`
    call (0: one copy kernel per tensor; None: everything through `_foreach_copy_`); a knob for
    the benchmark.

    The slots are fetched again at every call and not kept afterwards: holding the views would
    keep the engine's weight buffer alive through `engine.free_weights()`, and after
    `engine.init_weights_storage()` they would point at the old buffer. The plan (routes,
    buckets, offsets) depends only on names and shapes and is built once.
    """

    def __init__(self, model: torch.nn.Module, meshes, target, *, foreach_max_numel: int | None = FOREACH_MAX_NUMEL):
        self.model, self.meshes = model, meshes
        self.foreach_max_numel = foreach_max_numel
        self.dims = meshes.dims
        self._target = target
        self.total_bytes_received = 0
        self._side_stream = None
        rank = dist.get_rank()
        self.tp_rank = self.dims.tp_rank(rank)
        if meshes.tp.get_local_rank() != self.tp_rank:
            raise RuntimeError(f"rank {rank}: the TP mesh puts it at TP rank {meshes.tp.get_local_rank()} but its FSDP "
                               f"chunks lie in TP shard {self.tp_rank}; build the meshes with ParallelDims.build_meshes")
        self._shard_group = meshes.shard.get_group()
        self._micro_group = meshes.micro_dp.get_group()
        reshard_all(model)  # the plan holds the sharded DTensors, which FSDP keeps for the model's life
        self._build_plan(self._slots())

    def _slots(self):
        return self._target.param_slots() if hasattr(self._target, "param_slots") else self._target

    # ------------------------------------------------------------- plan
    def _build_plan(self, slots) -> None:
        params = dict(self.model.named_parameters())
        if set(slots) != set(params):
            raise ValueError(f"engine slots and model parameters differ: only in the engine "
                             f"{sorted(set(slots) - set(params))[:6]}, only in the model {sorted(set(params) - set(slots))[:6]}")
        dtypes = {s.view.dtype for s in slots.values()}
        if len(dtypes) != 1:
            raise ValueError(f"engine slots have mixed dtypes {dtypes}")
        self.dtype = dtypes.pop()
        self.esize = torch.empty((), dtype=self.dtype).element_size()
        self.device = next(iter(slots.values())).view.device
        S, t, m = self.dims.dp_shard, self.dims.tp, self.dims.micro_dp
        buckets: dict[str, _Bucket] = {}
        self.param_bytes = self.slot_bytes = self.num_fallback = 0
        bound = 0.0
        for name, p in params.items():
            slot = slots[name]
            if not isinstance(p, DTensor) or not isinstance(p.placements[-1], Shard):
                raise TypeError(f"{name!r} is not an FSDP-sharded DTensor; apply apply_fsdp first")
            tp_dim = tp_shard_dim(name)
            if slot.shard_dim != tp_dim:
                raise ValueError(f"{name!r}: the engine shards dim {slot.shard_dim}, models.parallel_plan says {tp_dim}")
            expect = list(p.shape)
            if tp_dim is not None:
                if expect[tp_dim] % t:
                    raise ValueError(f"{name!r}: dim {tp_dim} of size {expect[tp_dim]} is not divisible by TP size {t}")
                expect[tp_dim] //= t
            if list(slot.view.shape) != expect:
                raise ValueError(f"{name!r}: engine view has shape {tuple(slot.view.shape)}, its TP shard is {tuple(expect)}")
            fsdp_dim = p.placements[-1].dim
            n = p.numel()
            self.param_bytes += n * self.esize
            self.slot_bytes += slot.view.numel() * self.esize
            bound += n * (1 - 1 / S) if tp_dim is None else n / t * (1 - t / S)
            aligned = tp_dim is not None and fsdp_dim == tp_dim and p.shape[tp_dim] % S == 0
            chunk = list(p.shape)
            if S == 1:
                route = "local"  # one rank holds everything (then t == 1): a cast-copy
            elif aligned:
                route = "local" if m == 1 else "micro"
                chunk[fsdp_dim] //= S
            else:
                # FSDP pads uneven dim-0 chunks to the size of chunk 0; the gather moves padded chunks.
                route = "full"
                chunk[fsdp_dim] = -(-chunk[fsdp_dim] // S)
            fallback = tp_dim is not None and not aligned
            self.num_fallback += fallback
            layer = _LAYER.match(name)
            key = f"layers.{layer.group(1)}" if layer else name.split(".")[0]
            bucket = buckets.setdefault(key, _Bucket(key))
            item = _Item(name, p, tp_dim, fsdp_dim, route, fallback, tuple(chunk))
            if route == "micro":
                item.offset = bucket.micro_numel
                bucket.micro_numel += item.numel
                bucket.micro.append(item)
            elif route == "full":
                bucket.full.append(item)
            else:
                bucket.local.append(item)
        for b in buckets.values():
            for item in b.full:  # full items follow the micro items in the per-rank send buffer
                item.offset = b.micro_numel + b.full_numel
                b.full_numel += item.numel
            b.direct = len(b.micro) == 1 and b.micro[0].fsdp_dim == 0 and slots[b.micro[0].name].view.is_contiguous()
        self.buckets = list(buckets.values())
        self._needs_comm = any(b.micro or b.full for b in self.buckets)
        self.bound_bytes = int(round(bound * self.esize))
        self.num_params = len(params)
        self._sizes = (
            max((b.micro_numel + b.full_numel for b in self.buckets), default=0),
            max((0 if b.direct else b.micro_numel * m for b in self.buckets), default=0),
            max((b.full_numel * S for b in self.buckets), default=0),
        )

    def _views(self) -> dict[str, torch.Tensor]:
        views = {name: slot.view for name, slot in self._slots().items()}
        for b in self.buckets:
            if b.direct and not views[b.micro[0].name].is_contiguous():
                raise RuntimeError(f"{b.micro[0].name}: the engine's view is no longer contiguous")
        return views

    # ------------------------------------------------------------- zero-redundancy path
    @torch.no_grad()
    def reshard(self) -> ReshardStats:
        """Fill this rank's engine slots from the FSDP shards (collective over each shard group)."""
        t0 = time.perf_counter()
        stats = self._new_stats(naive=False)
        views = self._views()
        cuda = self.device.type == "cuda"
        nbuf = 2 if cuda else 1
        send_n, micro_n, full_n = self._sizes
        bufs = [(torch.empty(send_n, dtype=self.dtype, device=self.device),
                 torch.empty(micro_n, dtype=self.dtype, device=self.device),
                 torch.empty(full_n, dtype=self.dtype, device=self.device)) for _ in range(nbuf)]
        stats.buffer_bytes = nbuf * (send_n + micro_n + full_n) * self.esize
        if not self._needs_comm:
            # One GPU (or t == S without replicated params): every parameter is a cast-copy of
            # the local shard; no buffers, streams or events, and one batched copy call.
            local = [it for b in self.buckets for it in b.local]
            _copy_many([views[it.name] for it in local], [it.param.to_local() for it in local], self.foreach_max_numel)
        elif cuda:
            self._pipelined(bufs, stats, views)
        else:
            for b in self.buckets:  # gloo is synchronous: nothing to overlap
                self._gather(b, bufs[0], stats, views)
                self._copy_out(b, bufs[0], views)
        del bufs, views
        self.total_bytes_received += stats.bytes_received
        stats.seconds = time.perf_counter() - t0
        return stats

    def _pipelined(self, bufs, stats: ReshardStats, views) -> None:
        """Gathers of bucket i+1 on a side stream overlap the copies of bucket i on the current stream."""
        main = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        # The side stream reads parameters last written on the current stream (optimizer step)
        # and buffers just allocated there.
        side.wait_stream(main)
        gathered = [torch.cuda.Event(), torch.cuda.Event()]
        copied: list = [None, None]

        def issue(i: int):
            k = i % 2
            with torch.cuda.stream(side):
                if copied[k] is not None:
                    side.wait_event(copied[k])  # bucket i-2 has left this buffer
                self._gather(self.buckets[i], bufs[k], stats, views)
                gathered[k].record(side)

        if self.buckets:
            issue(0)
        for i, b in enumerate(self.buckets):
            if i + 1 < len(self.buckets):
                issue(i + 1)
            k = i % 2
            main.wait_event(gathered[k])
            self._copy_out(b, bufs[k], views)
            copied[k] = torch.cuda.Event()
            copied[k].record(main)
        main.wait_stream(side)

    def _gather(self, b: _Bucket, buf, stats: ReshardStats, views) -> None:
        send, recv_micro, recv_full = buf
        m, S = self.dims.micro_dp, self.dims.dp_shard
        per = b.micro_numel + b.full_numel
        for it in b.micro:
            send[it.offset:it.offset + it.numel].view(it.chunk_shape).copy_(it.param.to_local())
        for it in b.full:
            local = it.param.to_local()
            dst = send[it.offset:it.offset + it.numel].view(it.chunk_shape)
            dst.narrow(it.fsdp_dim, 0, local.shape[it.fsdp_dim]).copy_(local)
        if b.micro:
            out = views[b.micro[0].name].view(-1) if b.direct else recv_micro[:m * b.micro_numel]
            _all_gather(out, send[:b.micro_numel], group=self._micro_group)
            stats.bytes_received += (m - 1) * b.micro_numel * self.esize
            stats.num_collectives += 1
        if b.full:
            _all_gather(recv_full[:S * b.full_numel], send[b.micro_numel:per], group=self._shard_group)
            stats.bytes_received += (S - 1) * b.full_numel * self.esize
            stats.num_collectives += 1

    def _copy_out(self, b: _Bucket, buf, views) -> None:
        _, recv_micro, recv_full = buf
        m, S, t = self.dims.micro_dp, self.dims.dp_shard, self.dims.tp
        if b.local:
            _copy_many([views[it.name] for it in b.local], [it.param.to_local() for it in b.local],
                       self.foreach_max_numel)
        if b.micro and not b.direct:
            rows = recv_micro[:m * b.micro_numel].view(m, b.micro_numel)
            for it in b.micro:
                src = rows[:, it.offset:it.offset + it.numel].unflatten(1, it.chunk_shape)  # [m, *chunk]
                d = it.fsdp_dim
                views[it.name].unflatten(d, (m, it.chunk_shape[d])).copy_(src.movedim(0, d))
        if b.full:
            rows = recv_full[:S * b.full_numel].view(S, b.full_numel)
            for it in b.full:
                off = it.offset - b.micro_numel
                src = rows[:, off:off + it.numel].unflatten(1, it.chunk_shape)  # [S, *padded chunk]
                d = it.fsdp_dim
                full = src.movedim(0, d).flatten(d, d + 1).narrow(d, 0, it.param.shape[d])
                views[it.name].copy_(_tp_slice(full, it.tp_dim, self.tp_rank, t))

    # ------------------------------------------------------------- naive reference
    @torch.no_grad()
    def reshard_naive(self) -> ReshardStats:
        """Reference / baseline: all-gather every full parameter over the shard group, slice, copy."""
        t0 = time.perf_counter()
        stats = self._new_stats(naive=True)
        views = self._views()
        S, t = self.dims.dp_shard, self.dims.tp
        for b in self.buckets:
            for it in b.local + b.micro + b.full:
                # Cast before gathering so the baseline moves the same dtype as the fast path.
                full = it.param.to(self.dtype).full_tensor()
                padded = list(it.param.shape)
                padded[it.fsdp_dim] = -(-padded[it.fsdp_dim] // S)
                stats.bytes_received += (S - 1) * math.prod(padded) * self.esize
                stats.num_collectives += 1
                views[it.name].copy_(_tp_slice(full, it.tp_dim, self.tp_rank, t))
        del views
        self.total_bytes_received += stats.bytes_received
        stats.seconds = time.perf_counter() - t0
        return stats

    def _new_stats(self, naive: bool) -> ReshardStats:
        return ReshardStats(bytes_bound=self.bound_bytes, param_bytes=self.param_bytes, slot_bytes=self.slot_bytes,
                            num_params=self.num_params, num_fallback=self.num_fallback, naive=naive)


def _tp_slice(full: torch.Tensor, tp_dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    if tp_dim is None or tp == 1:
        return full
    n = full.shape[tp_dim] // tp
    return full.narrow(tp_dim, tp_rank * n, n)


def _copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor], foreach_max_numel: int | None) -> None:
    """dst ← src (with a dtype cast) for many pairs; on CUDA the small ones in one multi-tensor call."""
    if not dsts:
        return
    if dsts[0].device.type != "cuda":
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        return
    if foreach_max_numel is None:
        torch._foreach_copy_(dsts, srcs)
        return
    small_d, small_s = [], []
    for d, s in zip(dsts, srcs):
        if d.numel() >= foreach_max_numel:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)
