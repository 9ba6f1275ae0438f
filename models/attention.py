"""Causal self-attention over padded or packed (variable-length) batches.

Two layouts reach this function:

* padded: `q [B, S, Hq, D]`, `k, v [B, S, Hkv, D]` with an optional `attention_mask [B, S]`
  (1 = real token). Runs SDPA with a causal + key-padding mask.
* packed: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `cu_seqlens [N+1]` (int32, cumulative
  sequence starts). No attention crosses a sequence boundary. On CUDA this uses
  flash-attn's varlen kernel when importable, else the FlashAttention kernels shipped with
  PyTorch (`_FlashVarlen`); everywhere else SDPA with a block-diagonal causal mask, which is
  the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: never required
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # pragma: no cover - depends on the machine
    _flash_varlen = None


class _FlashVarlen(torch.autograd.Function):
    """Causal varlen FlashAttention (the kernels PyTorch ships) called through its aten ops.

    `torch.nn.attention.varlen.varlen_attn` runs the same two kernels, but as custom ops whose
    Python dispatch (forward, then a second custom op for the backward) took 648 µs of host time
    per layer forward + backward on an H200 where this takes 274 µs; the host bounds a small
    model's update.
    FlashAttention takes fewer K/V heads than query heads natively (GQA) and returns K/V
    gradients with K/V's head count."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True,
            rng_state, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def flash_varlen_usable(q: torch.Tensor) -> bool:
    """Whether `attention_packed` takes a FlashAttention kernel for `q`: CUDA, fp16/bf16."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _expand_kv(x: torch.Tensor, n_rep: int, head_dim_axis: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim_axis)


def attention_padded(q, k, v, attention_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]."""
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = _expand_kv(k, n_rep, 1), _expand_kv(v, n_rep, 1)
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        s = q.shape[2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = causal[None] & attention_mask.bool()[:, None, :]
        # A padding query would attend to nothing (NaN softmax); let it see itself instead.
        mask = mask | torch.eye(s, dtype=torch.bool, device=q.device)[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T, T] boolean mask: causal inside each packed sequence, nothing across them."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    if seq_id.numel() < total:  # trailing padding tokens form their own segment
        pad = torch.full((total - seq_id.numel(),), len(lengths), device=seq_id.device)
        seq_id = torch.cat([seq_id, pad])
    same = seq_id[:, None] == seq_id[None, :]
    return same & torch.ones(total, total, dtype=torch.bool, device=seq_id.device).tril()


def attention_packed(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens [N+1] int32 -> [T,Hq,D]."""
    if flash_varlen_usable(q):
        if _flash_varlen is not None:
            return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=scale, causal=True)
        return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, int(max_seqlen),
                                  float(scale))
    n_rep = q.shape[1] // k.shape[1]
    total = q.shape[0]
    mask = block_causal_mask(cu_seqlens.long(), total)
    mask = mask | torch.eye(total, dtype=torch.bool, device=q.device)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    kt, vt = _expand_kv(kt, n_rep, 1), _expand_kv(vt, n_rep, 1)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[None, None], scale=scale)
    return out[0].transpose(0, 1)
