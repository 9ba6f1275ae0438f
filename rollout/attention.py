"""Attention over the paged KV cache: metadata and the pure-PyTorch reference paths.

Cache layout (one layer): `k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]`, in the
model dtype or (`EngineConfig.kv_cache_dtype = "fp8"`) as e4m3 values with one float32 scale per
row of `head_dim` values, `k_scale, v_scale [num_blocks, block_size, kv_heads]` (`rollout.ops.quantize_rows`);
sequence `n`'s position `p` lives at row `block_tables[slots[n], p // block_size] * block_size
+ p % block_size`. A step's new K/V are written into the cache first (`rope_and_cache`), so
attention always reads the whole context - the cached prefix and the new tokens - from the
cache.

* decode: one query per sequence, `q [B, Hq, D]`, context `context_lens[b]` tokens.
* prefill: packed chunks `q [T, Hq, D]`, sequence `n`'s queries are rows
  `cu_q[n] .. cu_q[n+1]` at positions `context_lens[n] - q_len .. context_lens[n] - 1`,
  causal over its whole context (prefix included).

A layer with a sliding `window` (an int; None or 0: the whole context) attends from a query at
position p to the keys at p - window + 1 .. p only (transformers' mask; `models.attention`). A `softcap`
(Gemma 2's attn_logit_softcapping; None: none) caps the scaled scores, cap·tanh(scores / cap), before the mask and
the softmax (`models.attention.sdpa`). The
cache keeps every block of a sequence, those before its window included: nothing is evicted, so
a windowed model's cache needs as many blocks as a full one's.

The reference functions run on any device and are what the Triton kernels are tested
against. Padding positions of the gathered context are zeroed before the product: stale or
never-written cache rows may hold anything, NaN included, and `0 * NaN` would leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import sdpa

# Query rows per prefill tile of the Triton kernel; the runner cuts each chunk into such tiles.
PREFILL_TILE = 64


@dataclass
class AttentionMetadata:
    """What the attention of one step needs (device tensors int32 unless noted)."""

    is_decode: bool
    slots: torch.Tensor  # [N] block-table row of each sequence
    context_lens: torch.Tensor  # [N] tokens in the cache for each sequence, this step's included
    max_context_len: int  # host value, >= every context_lens (reference path only)
    num_splits: int = 1  # decode: split-K partitions per sequence (Triton path)
    cu_q: torch.Tensor | None = None  # prefill: [N+1] query row offsets
    tile_seq: torch.Tensor | None = None  # prefill (Triton): sequence of each query tile
    tile_start: torch.Tensor | None = None  # prefill (Triton): first query row (within the sequence) of each tile
    host_cu_q: list[int] | None = None  # prefill: cu_q on the host (reference path)
    host_context_lens: list[int] | None = None  # prefill: context_lens on the host (reference path)

    @classmethod
    def prefill(cls, slots: torch.Tensor, q_lens: list[int], context_lens: list[int]) -> "AttentionMetadata":
        """A prefill step's metadata from host lists: sequence n (block-table row `slots[n]`) has `q_lens[n]`
        queries, the last `q_lens[n]` positions of its `context_lens[n]`; tensors on `slots`' device."""
        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=slots.device)

        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        tile_seq, tile_start = prefill_tiles(q_lens)
        return cls(is_decode=False, slots=slots, context_lens=i32(context_lens), max_context_len=max(context_lens),
                   cu_q=i32(cu), tile_seq=i32(tile_seq), tile_start=i32(tile_start), host_cu_q=cu,
                   host_context_lens=list(context_lens))


def prefill_tiles(q_lens) -> tuple[list[int], list[int]]:
    """The query tiles of a prefill step whose sequences have `q_lens` queries: each tile's sequence and first
    query row within it (`PREFILL_TILE` rows a tile)."""
    tile_seq, tile_start = [], []
    for i, n in enumerate(q_lens):
        for t0 in range(0, n, PREFILL_TILE):
            tile_seq.append(i)
            tile_start.append(t0)
    return tile_seq, tile_start


def _gather_context(k_cache, v_cache, block_tables, slots, length: int, k_scale=None, v_scale=None):
    """K, V `[N, length, Hkv, D]` of the first `length` positions of each sequence's context: as cached, or
    (an e4m3 cache, `k_scale` / `v_scale [blocks, block_size, Hkv]` given) in float32, each row times its scale."""
    block_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    j = torch.arange(length, device=k_cache.device)
    pages = block_tables[slots.long()][:, j // block_size].long()  # [N, length]
    rows = pages * block_size + j % block_size
    k, v = k_cache.view(-1, hkv, d)[rows], v_cache.view(-1, hkv, d)[rows]
    if k_scale is None:
        return k, v
    return (k.float() * k_scale.reshape(-1, hkv)[rows][..., None], v.float() * v_scale.reshape(-1, hkv)[rows][..., None])


def _sdpa(q, k, v, mask, scale, softcap=None):
    """q [N, Hq, M, D], k/v [N, L, Hkv, D], mask [N, M, L] (True = attend) -> [N, Hq, M, D]."""
    n_rep = q.shape[1] // k.shape[2]
    k = k.masked_fill(~mask.any(1)[..., None, None], 0).transpose(1, 2).repeat_interleave(n_rep, dim=1)
    v = v.masked_fill(~mask.any(1)[..., None, None], 0).transpose(1, 2).repeat_interleave(n_rep, dim=1)
    return sdpa(q, k, v, attn_mask=mask[:, None], scale=scale, softcap=softcap)


def decode_attention_ref(q: torch.Tensor, k_cache, v_cache, block_tables, meta: AttentionMetadata,
                         scale: float, k_scale=None, v_scale=None, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """q `[B, Hq, D]` -> `[B, Hq * D]` (an e4m3 cache: attention in float32, rounded to q's dtype); `window`:
    the last `window` positions of each context only; `softcap`: the scores' soft cap."""
    b, hq, d = q.shape
    length = meta.max_context_len
    k, v = _gather_context(k_cache, v_cache, block_tables, meta.slots, length, k_scale, v_scale)
    j = torch.arange(length, device=q.device)[None, :]
    valid = j < meta.context_lens[:, None]  # [B, L]
    if window:
        valid &= j >= meta.context_lens[:, None] - window
    out = _sdpa(q[:, :, None, :].to(k.dtype), k, v, valid[:, None, :], scale, softcap)
    return out.reshape(b, hq * d).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache, v_cache, block_tables, meta: AttentionMetadata,
                          scale: float, k_scale=None, v_scale=None, window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """q `[T, Hq, D]` (packed chunks) -> `[T, Hq * D]`, causal over each sequence's cached context (an e4m3
    cache: in float32, rounded to q's dtype); `window`: each query the last `window` positions up to its own;
    `softcap`: the scores' soft cap."""
    t, hq, d = q.shape
    out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
    cu, ctx = meta.host_cu_q, meta.host_context_lens
    for n in range(len(ctx)):
        q0, q1, length = cu[n], cu[n + 1], ctx[n]
        m = q1 - q0
        k, v = _gather_context(k_cache, v_cache, block_tables, meta.slots[n:n + 1], length, k_scale, v_scale)
        qpos = torch.arange(length - m, length, device=q.device)
        j = torch.arange(length, device=q.device)[None, :]
        mask = j <= qpos[:, None]  # [M, L]
        if window:
            mask &= j > qpos[:, None] - window
        o = _sdpa(q[q0:q1].transpose(0, 1)[None].to(k.dtype), k, v, mask[None], scale, softcap)  # [1, Hq, M, D]
        out[q0:q1] = o[0].transpose(0, 1).reshape(m, hq * d)
    return out
