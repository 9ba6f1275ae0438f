"""The mixture-of-experts layer's sort of (token, slot) pairs by expert as one Triton kernel; CUDA, or CPU under
`TRITON_INTERPRET=1`.

`models.moe.experts_forward` groups the flattened expert ids `ids [N]` (N = tokens × k) by expert with a stable
sort and needs three things from it: `order` (the pairs' indices grouped by expert, each group in pair order),
its inverse permutation `inverse` (each pair's place in `order`) and the groups' ends `ends [E]` (int32, the
grouped GEMM's offsets). On CUDA, torch spends a radix sort (its `argsort(stable=True)` of int64 keys, 30 µs at
2,048 pairs on an H100), a scatter for the inverse, a scatter-add and a cumsum for the ends: a quarter of a
qwen3-30b-a3b decode step's time outside the experts' GEMMs and attention.

Here one program per expert `e` computes all three for its group as a counting sort does: the group starts after
the pairs of smaller ids (`#{j : ids[j] < e}`), and a pair of id `e` goes to that start plus the number of
earlier pairs of id `e` (an inclusive cumsum of `ids == e`, minus one). This is the stable sort's permutation
exactly, so the values computed from it are bitwise those of the argsort path. Each program reads the N ids twice
(from L2: 16 KB at a decode step) in blocks of `BLOCK`; the work grows as E × N, so `experts_forward` takes the
kernel up to `MAX_PAIRS` pairs (decode steps, short prefills) and torch's sort above (`models.moe.sort_by_expert`).

`torch.compile` traces the custom op `meshppo::sort_by_expert` (a fake implementation gives the shapes); its
outputs are integers, without gradients. Imported only where it runs, so triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sort_by_expert_kernel(ids_ptr, order_ptr, inverse_ptr, ends_ptr, n, BLOCK: tl.constexpr):
    """Program `e`: the places of expert `e`'s pairs in the stable sort of `ids [n]` (module docstring)."""
    e = tl.program_id(0)
    start = 0  # pairs of a smaller id: where this expert's group starts
    for first in range(0, n, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=e)
        start += tl.sum((ids < e).to(tl.int32), axis=0)
    seen = 0  # pairs of id e in the blocks before this one
    for first in range(0, n, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        hit = ids == e
        place = start + seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + place, offs.to(tl.int64), mask=hit)
        tl.store(inverse_ptr + offs, place.to(tl.int64), mask=hit)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(ends_ptr + e, start + seen)


def _block(n: int) -> int:
    """Ids a program reads at a time: the whole of a decode step's (up to 2,048), at least 16."""
    return min(max(triton.next_power_of_2(n), 16), 2048)


@torch.library.custom_op("meshppo::sort_by_expert", mutates_args=())
def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(order [N] int64, inverse [N] int64, ends [num_experts] int32)` of expert ids `ids [N]` (int64, each in
    `[0, num_experts)`): `torch.argsort(ids, stable=True)`, its inverse permutation and the cumulative counts."""
    ids = ids.contiguous()
    n = ids.numel()
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    inverse = torch.empty(n, dtype=torch.int64, device=ids.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block = _block(n)
    _sort_by_expert_kernel[(num_experts,)](ids, order, inverse, ends, n, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return order, inverse, ends


@sort_by_expert.register_fake
def _(ids, num_experts):
    n = ids.numel()
    return (ids.new_empty(n, dtype=torch.int64), ids.new_empty(n, dtype=torch.int64),
            ids.new_empty(num_experts, dtype=torch.int32))
