"""FSDP actor → tensor-parallel engine weights, with zero redundancy (docs/ARCHITECTURE.md).

`apply_fsdp` shards every parameter on its TP dimension, and `ParallelDims` builds TP groups so
that TP shard `j` of a parameter is exactly FSDP chunks `[j·m, (j+1)·m)` (`m = S/t`, `S` the
shard-group size), held by micro-DP group `j`. Filling this rank's engine slots therefore
needs only an all-gather inside its micro-DP group: `P/t·(1 − t/S)` bytes received per rank
instead of the naive `P·(1 − 1/S)`.

Each parameter takes one of four routes, fixed once in a plan:

* `local`: `m == 1` (one GPU, or `t == S`): the rank's chunk *is* its TP shard — a cast-copy,
  no communication;
* `micro`: all-gather of the chunks inside the micro-DP group, in the engine dtype;
* `kv`: K/V projections at a TP size larger than the model's KV heads, where `t/Hkv` ranks hold a
  copy of one head (`rollout.model.tp_shard_range`): that head is FSDP chunks `[h·r·m, (h+1)·r·m)`
  (`r = t/Hkv`), held by a block of `r·m` consecutive ranks of the shard group, and an all-gather
  inside that block (`ParallelMeshes.block_group`) gives each of them exactly its copy;
* `a2a`: at `t > 1`, a parameter FSDP shards evenly on dim 0 whose TP shard lies along another
  dimension that its chunks do not line up with (a MoE layer's `experts.gate_up_proj`; a
  row-parallel weight whose input dimension `S` does not divide): each rank sends every rank of
  the shard group that rank's TP rows or columns of its own chunk, one all-to-all into the engine
  slot (the pieces arrive in chunk order, which is the slot's row order): `(1 − 1/S)` of the slot
  received, where `full` would receive `(1 − 1/S)` of the whole parameter;
* `full`: parameters the engine replicates (norms, row-parallel biases, a MoE layer's router:
  tiny), K/V heads replicated over the whole shard group, and the other parameters whose chunks
  do not line up with TP shards (a dimension not divisible by `S`, a vocabulary padded to a
  multiple of `t`, a MoE layer's `experts.gate_up_proj` at `t = 1`; counted in
  `ReshardStats.num_fallback`) are gathered whole over the shard group and sliced.

A MoE layer's experts (`models.parallel_plan`): `experts.down_proj` `[E, H, I]` is row-parallel
on dim 2 and FSDP shards it there too (where `S` divides `I`), so it takes `local` / `micro` as
a dense `down_proj` does. `experts.gate_up_proj` `[E, 2I, H]` fuses each expert's gate and up
rows, and a TP shard holds the same rows of both (`tp_shard_parts`); no run of consecutive FSDP
chunks holds that, so FSDP shards it by expert (dim 0) and it takes `a2a` (`full` at `t = 1`,
where the whole parameter is what the rank needs, or where `S` does not divide the experts).

Replicated parameters of the whole model go in one gather (first); the others are bucketed by
consecutive layers, about `BUCKET_BYTES` per rank per bucket. A bucket is packed by one
multi-tensor cast-copy into a preallocated buffer in the engine dtype (bf16) and gathered by
one collective per route and layout: the parameters split on dim 0 land as contiguous rows that
one `split_with_sizes_copy` copies out, the others (split on dim 1, or padded) take one strided
copy each. On CUDA the packing and gathers of bucket `i+1` run on a side stream while the
default stream copies bucket `i` into the engine (double-buffered: the extra memory is two
bucket buffers, never a full model), and the local cast-copies run first, under the first
gathers. A parameter larger than a bucket that
is split on dim 0 with a contiguous engine view (the embedding, the LM head) is gathered straight
into the engine buffer, with no bucket buffer. The host work per call is thus a few calls per
bucket, not several per parameter: on two GPUs the per-parameter version was host-bound.

A LoRA actor (`models.lora`): the engine gets the adapted policy, merged, without any copy of
the base beyond its own slots. After the base weights are in the slots, each adapted slot is
rewritten as `base + scaling·B@A` (`models.lora.merge_weight`: float32, one cast), its rows of B
(column-parallel) or columns of A (row-parallel) taken from the layer's adapters gathered whole
(one collective per layer; adapters are `r × hidden`; `ReshardStats.adapter_bytes_received`).
The base bytes move exactly as without LoRA when the base dtype casts exactly into the engine
dtype (a bf16 base, which `apply_fsdp` stores for a LoRA actor under bf16 compute); an fp32
base into a bf16 engine is merged from the fp32 base itself (`num_wide`: gathered whole).

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

from models import tp_narrow, tp_shard_dim, tp_shard_parts
from models.lora import is_lora_name, lora_modules, merge_weight
from rollout.model import tp_shard_range
from sharding.comm import all_gather_into, all_to_all_into
from sharding.fsdp import reshard_all

# Tensors at least this large get their own copy kernel; smaller ones go through one
# multi-tensor `_foreach_copy_` call, which saves a launch per norm / bias / small projection
# where launch latency, not bandwidth, is the cost.
FOREACH_MAX_NUMEL = 1 << 22

# Gather buckets of about this many bytes per rank: a collective, an event pair and a copy-out
# call per bucket are host time, which a layer-sized bucket of a small model does not cover.
BUCKET_BYTES = 64 << 20

# LoRA merges run over row blocks of a slot so that their float32 temporaries (the base rows and
# B·A) stay near this size, not two float32 copies of the largest weight.
MERGE_CHUNK_BYTES = 64 << 20

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass
class ReshardStats:
    """What one reshard moved, seen from this rank. Byte counts are in the engine dtype."""

    bytes_received: int = 0  # from other ranks, this call (collective payloads incl. padding)
    bytes_bound: int = 0  # zero-redundancy lower bound: Σ (slot numel − numel/S), what a rank holds but its chunk
    param_bytes: int = 0  # P: the whole model in the engine dtype
    slot_bytes: int = 0  # bytes written into this rank's engine slots (≈ P/t)
    num_params: int = 0
    num_fallback: int = 0  # TP-sharded params gathered whole because their chunks do not align
    num_all_to_all: int = 0  # TP-sharded params whose chunks do not align, moved by one all-to-all each
    num_collectives: int = 0
    buffer_bytes: int = 0  # bucket buffers allocated for this call (the peak extra memory)
    seconds: float = 0.0  # host time of the call (the GPU may still be copying; synchronise to time it)
    naive: bool = False
    # LoRA (counted apart from the base bytes above, which they do not change):
    num_merged: int = 0  # engine slots written as base + scaling·B@A
    adapter_bytes_received: int = 0  # adapters gathered whole over the shard group, in their own dtype
    num_wide: int = 0  # merged weights whose base is wider than the engine dtype, gathered whole in the base
    # dtype (their bytes are in bytes_received, at that dtype): a bf16 base into a bf16 engine needs none


@dataclass
class _Item:
    name: str
    param: DTensor
    tp_dim: int | None
    fsdp_dim: int
    route: str  # "local" | "a2a" | one of GATHER_ROUTES
    fallback: bool
    chunk_shape: tuple[int, ...]  # per-rank piece as packed (padded to FSDP's padded chunk for "full")
    shard: tuple[int, int] | None  # the rows / columns [start, start + length) along tp_dim the engine slot holds
    parts: int = 1  # tp_dim fuses this many parts, of each of which the slot holds `shard` (`tp_shard_parts`)
    offset: int = 0  # into the bucket's per-rank send buffer
    # Gathered rows land in the engine view by one `split_with_sizes_copy` over the bucket: the
    # item is split along dim 0 with no padding, no TP slicing, and a contiguous engine view, so
    # the view read as [G, numel/G] is exactly the gathered [G ranks, chunk] rows.
    split: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.chunk_shape)

    def shard_of(self, full: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This item's engine rows / columns of `full` (the whole parameter, or a LoRA factor) along `dim`
        (default: the TP dimension)."""
        if self.shard is None:
            return full
        if dim is None:
            return tp_narrow(full, self.tp_dim, self.parts, *self.shard)
        return full.narrow(dim, *self.shard)


# The routes that gather, in send-buffer order; each gathers over its own group (`Resharder._groups`).
GATHER_ROUTES = ("micro", "kv", "full")


@dataclass
class _Section:
    """One collective of a bucket: `items` of one route whose chunks lie at `start` of the send buffer
    (`numel` per rank), gathered as `[G, numel]` rows at `out` of the receive buffer. Split items come
    in a section of their own, so that their gathered rows are contiguous for `split_with_sizes_copy`."""

    route: str
    split: bool
    items: list
    start: int
    numel: int
    out: int


@dataclass
class _LoRAItem:
    """An engine slot that receives `base + scaling · B @ A` (TP-sliced) instead of the base."""

    item: _Item  # the base weight
    lora_A: DTensor  # [r, in]
    lora_B: DTensor  # [out, r]
    scaling: float
    wide: bool  # the base dtype does not cast exactly into the engine dtype


@dataclass
class _Bucket:
    name: str
    routes: dict[str, list[_Item]] = field(default_factory=lambda: {r: [] for r in GATHER_ROUTES})
    direct: bool = False  # the single item is gathered straight into its engine view
    sections: list[_Section] = field(default_factory=list)
    send_numel: int = 0  # per rank
    recv_numel: int = 0  # gathered, all sections

    @property
    def items(self) -> list[_Item]:
        return [it for r in GATHER_ROUTES for it in self.routes[r]]


class Resharder:
    """Writes an FSDP model's weights into the engine's TP slots (see the module docstring).

    `model`: the FSDP2 actor built by `apply_fsdp` / `build_fsdp_model` (parameters are
    DTensors on `meshes.train`). `meshes`: `ParallelDims.build_meshes()`. `target`: the engine
    (anything with `param_slots()`) or a mapping `training name → slot`, where a slot has
    `.view` (this rank's TP shard of the parameter, a view into the engine's buffers) and
    `.shard_dim` (the TP dimension, None when replicated). `foreach_max_numel`: on CUDA, local
    cast-copies of tensors smaller than this go through one multi-tensor `_foreach_copy_`
    call (0: one copy kernel per tensor; None: everything through `_foreach_copy_`).
    `bucket_bytes`: consecutive layers share a gather bucket until its per-rank send buffer
    reaches this size (0: one bucket per layer). Both are knobs for the benchmark.

    The slots are fetched again at every call and not kept afterwards: holding the views would
    keep the engine's weight buffer alive through `engine.free_weights()`, and after
    `engine.init_weights_storage()` they would point at the old buffer. The plan (routes,
    buckets, offsets) depends only on names and shapes and is built once.
    """

    def __init__(self, model: torch.nn.Module, meshes, target, *, foreach_max_numel: int | None = FOREACH_MAX_NUMEL,
                 bucket_bytes: int = BUCKET_BYTES):
        self.model, self.meshes = model, meshes
        self.foreach_max_numel = foreach_max_numel
        self.bucket_bytes = bucket_bytes
        self.dims = meshes.dims
        self._target = target
        self.total_bytes_received = 0
        self._side_stream = None
        rank = dist.get_rank()
        self.tp_rank = self.dims.tp_rank(rank)
        if meshes.tp.get_local_rank() != self.tp_rank:
            raise RuntimeError(f"rank {rank}: the TP mesh puts it at TP rank {meshes.tp.get_local_rank()} but its FSDP "
                               f"chunks lie in TP shard {self.tp_rank}; build the meshes with ParallelDims.build_meshes")
        self._groups = {"micro": (self.dims.micro_dp, meshes.micro_dp.get_group()),
                        "full": (self.dims.dp_shard, meshes.shard.get_group())}
        self._shard_group = self._groups["full"][1]
        reshard_all(model)  # the plan holds the sharded DTensors, which FSDP keeps for the model's life
        self._build_plan(self._slots())

    def _slots(self):
        return self._target.param_slots() if hasattr(self._target, "param_slots") else self._target

    # ------------------------------------------------------------- plan
    def _gather_size(self, p: DTensor, fsdp_dim: int, tp_dim: int | None, shard: tuple[int, int] | None) -> int | None:
        """How many consecutive ranks of the shard group hold the FSDP chunks that make up exactly this rank's
        engine rows of `p` (the rank among them), or None when they do not line up."""
        S = self.dims.dp_shard
        if shard is None or fsdp_dim != tp_dim or p.shape[tp_dim] % S:
            return None
        chunk = p.shape[tp_dim] // S
        start, length = shard
        if start % chunk or length % chunk:
            return None
        size, first = length // chunk, start // chunk
        mine = dist.get_rank() % S
        return size if S % size == 0 and first % size == 0 and first <= mine < first + size else None

    def _build_plan(self, slots) -> None:
        # LoRA adapters have no engine slot of their own: they are merged into their base weight's.
        all_params = dict(self.model.named_parameters())
        params = {n: p for n, p in all_params.items() if not is_lora_name(n)}
        merged = {f"{mod}.weight": m for mod, m in lora_modules(self.model).items()}
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
        layers: dict[str, _Bucket] = {}
        replicated = _Bucket("replicated")  # norms and row-parallel biases of every layer: one gather
        self.local: list[_Item] = []
        self.a2a: list[_Item] = []
        self.lora: list[_LoRAItem] = []
        self.param_bytes = self.slot_bytes = self.num_fallback = 0
        kv_sizes = set()
        bound = 0.0
        for name, p in params.items():
            slot = slots[name]
            if not isinstance(p, DTensor) or not isinstance(p.placements[-1], Shard):
                raise TypeError(f"{name!r} is not an FSDP-sharded DTensor; apply apply_fsdp first")
            tp_dim = tp_shard_dim(name)
            if slot.shard_dim != tp_dim:
                raise ValueError(f"{name!r}: the engine shards dim {slot.shard_dim}, models.parallel_plan says {tp_dim}")
            shard = None if tp_dim is None else tp_shard_range(self.model.args, name, p.shape[tp_dim], self.tp_rank, t)
            parts = tp_shard_parts(name)
            expect = list(p.shape)
            if shard is not None:
                expect[tp_dim] = parts * shard[1]
            if (list(slot.view.shape) != expect or getattr(slot, "parts", 1) != parts
                    or (shard is not None and getattr(slot, "start", 0) != shard[0])):
                raise ValueError(f"{name!r}: engine view has shape {tuple(slot.view.shape)} in "
                                 f"{getattr(slot, 'parts', 1)} part(s), its TP shard is {tuple(expect)} from "
                                 f"{0 if shard is None else shard[0]} of each of {parts} along dim {tp_dim}")
            fsdp_dim = p.placements[-1].dim
            n = p.numel()
            self.param_bytes += n * self.esize
            self.slot_bytes += slot.view.numel() * self.esize
            bound += slot.view.numel() - n / S  # what the slot holds beyond this rank's own chunk
            # a shard of several parts is rows of each: no run of consecutive chunks holds it (`fsdp_shard_dim`)
            size = self._gather_size(p, fsdp_dim, tp_dim, shard) if parts == 1 else None
            chunk = list(p.shape)
            if S == 1:
                route = "local"  # one rank holds everything (then t == 1): a cast-copy
            elif size is not None:
                route = "local" if size == 1 else "micro" if size == m else "full" if size == S else "kv"
                chunk[fsdp_dim] //= S
                if route == "kv":
                    kv_sizes.add(size)
            elif (t > 1 and fsdp_dim == 0 and tp_dim not in (None, 0) and p.shape[0] % S == 0
                  and slot.view.is_contiguous()):
                route = "a2a"  # each rank's TP rows / columns of every chunk, straight into the slot
                chunk[0] //= S
            else:
                # FSDP pads uneven dim-0 chunks to the size of chunk 0; the gather moves padded chunks.
                route = "full"
                chunk[fsdp_dim] = -(-chunk[fsdp_dim] // S)
            fallback = route == "full" and tp_dim is not None and size is None  # gathered whole: not aligned
            self.num_fallback += fallback
            item = _Item(name, p, tp_dim, fsdp_dim, route, fallback, tuple(chunk), shard, parts)
            # the gathered rows are the slot itself: the route's group holds exactly its chunks, or it is whole
            item.split = (route != "local" and fsdp_dim == 0 and p.shape[0] % S == 0 and slot.view.is_contiguous()
                          and (size is not None or tp_dim is None))
            if name in merged:
                mod = merged[name]
                # bf16 → fp32 is exact, so the base cast into the slot is the base and the merge
                # can read it there; fp32 → bf16 is not, and the merge needs the base itself.
                wide = torch.promote_types(p.dtype, self.dtype) != self.dtype
                self.lora.append(_LoRAItem(item, mod.lora_A, mod.lora_B, mod.scaling, wide))
                if wide and route != "local":
                    if p.to_local().device != self.device:
                        # DTensor's whole-tensor gather of a host-resident shard would hand a
                        # CPU tensor to the device's backend (NCCL rejects it).
                        raise ValueError(f"{name!r}: a LoRA-adapted weight kept in {p.dtype} on the host "
                                         f"(offload) cannot be merged into a {self.dtype} engine across ranks; "
                                         "keep the frozen base in the engine dtype (model_dtype) or on the device")
                    continue  # gathered whole in its own dtype at merge time, not in a bucket
            if route in ("local", "a2a"):
                (self.local if route == "local" else self.a2a).append(item)
                continue
            if route == "full" and tp_dim is None:
                replicated.routes["full"].append(item)
                continue
            layer = _LAYER.match(name)
            bucket = layers.setdefault(f"layers.{layer.group(1)}" if layer else name.split(".")[0], _Bucket(name))
            bucket.routes[route].append(item)
        if len(kv_sizes) > 1:
            raise AssertionError(f"K/V projections gather over blocks of different sizes {sorted(kv_sizes)}")
        if kv_sizes:  # (collective: every rank plans the same parameters, so every rank builds it)
            size = kv_sizes.pop()
            self._groups["kv"] = (size, self.meshes.block_group(size))
        buckets = ([replicated] if replicated.routes["full"] else []) + self._merge(list(layers.values()))
        for b in buckets:
            self._lay_out(b)
        self.buckets = buckets
        self._needs_comm = bool(buckets)
        self.num_all_to_all = len(self.a2a)
        self.bound_bytes = int(round(bound * self.esize))
        self.num_params = len(params)
        self._lora_layers: dict[str, list[_LoRAItem]] = {}
        for li in self.lora:
            layer = _LAYER.match(li.item.name)
            self._lora_layers.setdefault(layer.group(0) if layer else li.item.name, []).append(li)
        self._sizes = (max((b.send_numel for b in self.buckets), default=0),
                       max((b.recv_numel for b in self.buckets), default=0))

    def _lay_out(self, b: _Bucket) -> None:
        """The bucket's per-rank send buffer (route by route, in each the split items first) and its sections."""
        off = recv = 0
        for route in GATHER_ROUTES:
            items = b.routes[route]
            items.sort(key=lambda it: not it.split)
            for split in (True, False):
                part = [it for it in items if it.split == split]
                if not part:
                    continue
                start = off
                for it in part:
                    it.offset, off = off, off + it.numel
                b.sections.append(_Section(route, split, part, start, off - start, recv))
                recv += 0 if b.direct else self._groups[route][0] * (off - start)
        b.send_numel, b.recv_numel = off, recv

    def _merge(self, layers: list[_Bucket]) -> list[_Bucket]:
        """Consecutive layer buckets merged until a bucket's send buffer reaches `bucket_bytes`;
        an item that alone exceeds it (the embedding, the LM head) is gathered straight into
        its engine view when its layout allows, with no bucket buffer."""
        out: list[_Bucket] = []
        cur = None
        for b in layers:
            items = b.items
            if (len(items) == 1 and not b.routes["full"] and items[0].split
                    and items[0].numel * self.esize >= self.bucket_bytes):
                out.append(_Bucket(b.name, routes=b.routes, direct=True))
                continue
            if cur is None or sum(it.numel for it in cur.items) * self.esize >= max(self.bucket_bytes, 1):
                cur = _Bucket(b.name)
                out.append(cur)
            for route in GATHER_ROUTES:
                cur.routes[route] += b.routes[route]
        return out

    def _views(self) -> dict[str, torch.Tensor]:
        views = {name: slot.view for name, slot in self._slots().items()}
        for b in self.buckets:
            if b.direct and not views[b.items[0].name].is_contiguous():
                raise RuntimeError(f"{b.items[0].name}: the engine's view is no longer contiguous")
        return views

    # ------------------------------------------------------------- zero-redundancy path
    @torch.no_grad()
    def reshard(self) -> ReshardStats:
        """Fill this rank's engine slots from the FSDP shards (collective over each shard group)."""
        t0 = time.perf_counter()
        stats = self._new_stats(naive=False)
        views = self._views()
        cuda = self.device.type == "cuda"
        nbuf = 2 if cuda and len(self.buckets) > 1 else 1
        send_n, recv_n = self._sizes
        bufs = [(torch.empty(send_n, dtype=self.dtype, device=self.device),
                 torch.empty(recv_n, dtype=self.dtype, device=self.device)) for _ in range(nbuf if self.buckets else 0)]
        stats.buffer_bytes = len(bufs) * (send_n + recv_n) * self.esize
        if cuda and self._needs_comm:
            self._pipelined(bufs, stats, views)
        else:
            # One GPU: every parameter is a cast-copy of the local shard, in one batched copy
            # call. gloo is synchronous: nothing to overlap.
            self._copy_local(views)
            for b in self.buckets:
                self._gather(b, bufs[0], stats, views)
                self._copy_out(b, bufs[0], views)
        del bufs
        for it in self.a2a:
            self._all_to_all(it, views[it.name], stats)
        self._merge_lora(stats, views)
        del views
        self.total_bytes_received += stats.bytes_received
        stats.seconds = time.perf_counter() - t0
        return stats

    def _all_to_all(self, it: _Item, view: torch.Tensor, stats: ReshardStats) -> None:
        """Route `a2a`: this rank's chunk (dim-0 rows `[r E/S, (r+1) E/S)`) cut, for every rank `d` of the shard group,
        to the rows / columns of TP shard `d // m` (the one `d` holds, `ParallelDims.tp_rank`), in the engine dtype,
        and exchanged in one all-to-all whose output is the slot itself: the piece from rank `r` is the slot's rows
        of chunk `r`."""
        S, t, m = self.dims.dp_shard, self.dims.tp, self.dims.micro_dp
        local = it.param.to_local()
        piece = list(it.chunk_shape)
        piece[it.tp_dim] = view.shape[it.tp_dim]
        send = torch.empty(t, m, *piece, dtype=self.dtype, device=self.device)
        for j in range(t):  # every rank of micro-DP group j gets TP shard j's rows / columns
            shard = tp_shard_range(self.model.args, it.name, it.param.shape[it.tp_dim], j, t)
            send[j].copy_(tp_narrow(local, it.tp_dim, it.parts, *shard).expand(m, *piece))
        all_to_all_into(view.view(-1), send.view(-1), group=self._shard_group)
        stats.bytes_received += (S - 1) * math.prod(piece) * self.esize
        stats.num_collectives += 1

    def _copy_local(self, views) -> None:
        _copy_many([views[it.name] for it in self.local], [it.param.to_local() for it in self.local],
                   self.foreach_max_numel)

    # ------------------------------------------------------------- LoRA
    def _merge_lora(self, stats: ReshardStats, views) -> None:
        """Slot ← base + scaling · B @ A for every adapted weight, after the base is in the slots.

        A TP shard of a column-parallel weight (rows) needs the same rows of B and all of A; of a
        row-parallel one (columns), all of B and the same columns of A. Adapters are `r × hidden`,
        so each layer's are gathered whole over the shard group in one collective. The base is
        read from the slot when its cast there was exact, else from its own shard (or gathered
        whole, `num_wide`); the merge is float32 with one cast into the slot, and the FSDP
        shards the reference reads are never written."""
        for items in self._lora_layers.values():
            adapters = self._gather_adapters(items, stats)
            for li in items:
                it = li.item
                view = views[it.name]
                if not li.wide:
                    base = view
                elif it.route == "local":
                    base = it.param.to_local().to(self.device)  # an offloaded shard is on the host
                else:
                    base = it.shard_of(it.param.full_tensor())
                    padded = list(it.param.shape)
                    padded[it.fsdp_dim] = -(-padded[it.fsdp_dim] // self.dims.dp_shard)
                    stats.bytes_received += (self.dims.dp_shard - 1) * math.prod(padded) * base.element_size()
                    stats.num_collectives += 1
                    stats.num_wide += 1
                A, B = adapters[id(li.lora_A)], adapters[id(li.lora_B)]
                A = it.shard_of(A, 1) if it.tp_dim == 1 else A
                B = it.shard_of(B, 0) if it.tp_dim == 0 else B
                rows = max(1, MERGE_CHUNK_BYTES // (4 * view.shape[1]))
                for r0 in range(0, view.shape[0], rows):
                    view[r0:r0 + rows] = merge_weight(base[r0:r0 + rows], A, B[r0:r0 + rows], li.scaling, self.dtype)
                stats.num_merged += 1

    def _gather_adapters(self, items: list[_LoRAItem], stats: ReshardStats) -> dict[int, torch.Tensor]:
        """Full A and B of `items` (keyed by `id` of the parameter): FSDP's dim-0 chunks of every
        rank of the shard group, padded to chunk 0's rows, in one all-gather."""
        params = [p for li in items for p in (li.lora_A, li.lora_B)]
        S = self.dims.dp_shard
        if S == 1:
            return {id(p): p.to_local().to(self.device) for p in params}
        rows = [-(-p.shape[0] // S) for p in params]
        sizes = [r * p.shape[1] for r, p in zip(rows, params)]
        # On the engine's device, never the shards' own: offloaded shards live on the host,
        # and the group's backend (NCCL) takes device tensors only.
        dtype, device = params[0].dtype, self.device
        send = torch.zeros(sum(sizes), dtype=dtype, device=device)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        for p, off in zip(params, offsets):
            local = p.to_local()
            send[off:off + local.numel()].copy_(local.reshape(-1))
        out = torch.empty(S, send.numel(), dtype=dtype, device=device)
        all_gather_into(out.view(-1), send, group=self._shard_group)
        stats.adapter_bytes_received += (S - 1) * send.numel() * send.element_size()
        stats.num_collectives += 1
        return {id(p): out[:, off:off + size].reshape(S * r, p.shape[1])[:p.shape[0]]
                for p, r, off, size in zip(params, rows, offsets, sizes)}

    def _pipelined(self, bufs, stats: ReshardStats, views) -> None:
        """Gathers of bucket i+1 on a side stream overlap the copies of bucket i on the current
        stream; the cast-copies of the parameters that need no communication run first on the
        current stream, under the first gathers."""
        main = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        # The side stream reads parameters last written on the current stream (optimizer step)
        # and buffers just allocated there.
        side.wait_stream(main)
        nbuf = len(bufs)
        gathered = [torch.cuda.Event() for _ in range(nbuf)]
        copied: list = [None] * nbuf

        def issue(i: int):
            k = i % nbuf
            with torch.cuda.stream(side):
                if copied[k] is not None:
                    side.wait_event(copied[k])  # bucket i-nbuf has left this buffer
                self._gather(self.buckets[i], bufs[k], stats, views)
                gathered[k].record(side)

        issue(0)
        self._copy_local(views)
        for i, b in enumerate(self.buckets):
            if i + 1 < len(self.buckets):
                issue(i + 1)
            k = i % nbuf
            main.wait_event(gathered[k])
            self._copy_out(b, bufs[k], views)
            copied[k] = torch.cuda.Event()
            copied[k].record(main)
        main.wait_stream(side)

    def _gather(self, b: _Bucket, buf, stats: ReshardStats, views) -> None:
        send = buf[0]
        dsts, srcs = [], []
        for it in b.items:
            local = it.param.to_local()
            dst = send[it.offset:it.offset + it.numel].view(it.chunk_shape)
            dsts.append(dst if it.route != "full" else dst.narrow(it.fsdp_dim, 0, local.shape[it.fsdp_dim]))
            srcs.append(local)
        torch._foreach_copy_(dsts, srcs)
        for sec in b.sections:
            G, group = self._groups[sec.route]
            out = (views[sec.items[0].name] if b.direct else self._rows(buf, sec)).view(-1)
            all_gather_into(out, send[sec.start:sec.start + sec.numel], group=group)
            stats.bytes_received += (G - 1) * sec.numel * self.esize
            stats.num_collectives += 1

    def _rows(self, buf, sec: _Section) -> torch.Tensor:
        """The gathered `[G, numel]` rows of section `sec`."""
        G = self._groups[sec.route][0]
        return buf[1][sec.out:sec.out + G * sec.numel].view(G, sec.numel)

    def _copy_out(self, b: _Bucket, buf, views) -> None:
        if b.direct:
            return
        for sec in b.sections:
            rows = self._rows(buf, sec)
            if sec.split:
                torch.split_with_sizes_copy(rows, [it.numel for it in sec.items], dim=1,
                                            out=[views[it.name].view(rows.shape[0], -1) for it in sec.items])
                continue
            for it in sec.items:
                src = rows[:, it.offset - sec.start:it.offset - sec.start + it.numel].unflatten(1, it.chunk_shape)
                d = it.fsdp_dim
                if sec.route != "full":  # the group's chunks are the slot, in order: [G, *chunk]
                    views[it.name].unflatten(d, (rows.shape[0], it.chunk_shape[d])).copy_(src.movedim(0, d))
                else:  # padded chunks of the whole parameter, then this rank's TP slice
                    full = src.movedim(0, d).flatten(d, d + 1).narrow(d, 0, it.param.shape[d])
                    views[it.name].copy_(it.shard_of(full))

    # ------------------------------------------------------------- naive reference
    @torch.no_grad()
    def reshard_naive(self) -> ReshardStats:
        """Reference / baseline: all-gather every full parameter over the shard group, slice, copy."""
        t0 = time.perf_counter()
        stats = self._new_stats(naive=True)
        views = self._views()
        S = self.dims.dp_shard
        lora = {li.item.name: li for li in self.lora}
        wide = [li.item for li in self.lora if li.wide and li.item.route != "local"]
        for it in self.local + self.a2a + [it for b in self.buckets for it in b.items] + wide:
            li = lora.get(it.name)
            # Cast before gathering so the baseline moves the same dtype as the fast path (an
            # adapted weight is merged from the base itself, then cast).
            full = (it.param if li is not None else it.param.to(self.dtype)).full_tensor()
            padded = list(it.param.shape)
            padded[it.fsdp_dim] = -(-padded[it.fsdp_dim] // S)
            stats.bytes_received += (S - 1) * math.prod(padded) * full.element_size()
            stats.num_collectives += 1
            if li is not None:
                A, B = li.lora_A.full_tensor(), li.lora_B.full_tensor()
                stats.adapter_bytes_received += (S - 1) * (A.numel() + B.numel()) * A.element_size() // S
                stats.num_collectives += 2
                full = merge_weight(full, A, B, li.scaling, self.dtype)
                stats.num_merged += 1
            views[it.name].copy_(it.shard_of(full))
        del views
        self.total_bytes_received += stats.bytes_received
        stats.seconds = time.perf_counter() - t0
        return stats

    def _new_stats(self, naive: bool) -> ReshardStats:
        return ReshardStats(bytes_bound=self.bound_bytes, param_bytes=self.param_bytes, slot_bytes=self.slot_bytes,
                            num_params=self.num_params, num_fallback=self.num_fallback,
                            num_all_to_all=self.num_all_to_all, naive=naive)


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

