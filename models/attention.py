"""Causal self-attention over padded or packed (variable-length) batches.

Two layouts reach this function:

* padded: `q [B, S, Hq, D]`, `k, v [B, S, Hkv, D]` with an optional `attention_mask [B, S]`
  (1 = real token). Runs SDPA with a causal + key-padding mask.
* packed: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `cu_seqlens [N+1]` (int32, cumulative
  sequence starts). No attention crosses a sequence boundary. On CUDA this uses
  flash-attn's varlen kernel when importable, else PyTorch's `varlen_attn` (FlashAttention
  shipped with PyTorch); everywhere else SDPA with a block-diagonal causal mask, which is
  the reference path.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

try:  # optional: never required
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # pragma: no cover - depends on the machine
    _flash_varlen = None


def _resolve_torch_varlen():
    """PyTorch's varlen flash attention and the keyword it wants for causality (API moved in 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal_kw = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal_kw = {"is_causal": True}
    else:
        return None, None
    # FlashAttention takes fewer K/V heads than query heads natively; newer PyTorch only asks
    # for the flag to be set (without it, 2.10/2.11 pass GQA through unchanged: checked on an
    # H200 with torch 2.11, identical outputs to repeated K/V).
    gqa_flag = "enable_gqa" in params
    return varlen_attn, (causal_kw, gqa_flag)


# Resolved once at import: a lookup inside the forward would be traced by torch.compile.
_TORCH_VARLEN = _resolve_torch_varlen()


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
    n_rep = q.shape[1] // k.shape[1]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen is not None:
            return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=scale, causal=True)
        varlen, spec = _TORCH_VARLEN
        if varlen is not None:
            causal_kw, gqa_flag = spec
            if gqa_flag:
                causal_kw = {**causal_kw, "enable_gqa": n_rep > 1}
            return varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **causal_kw)
    total = q.shape[0]
    mask = block_causal_mask(cu_seqlens.long(), total)
    mask = mask | torch.eye(total, dtype=torch.bool, device=q.device)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    kt, vt = _expand_kv(kt, n_rep, 1), _expand_kv(vt, n_rep, 1)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[None, None], scale=scale)
    return out[0].transpose(0, 1)
