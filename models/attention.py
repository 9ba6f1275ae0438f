"""Causal self-attention over padded or packed (variable-length) batches.

Two layouts reach this function:

* padded: `q [B, S, Hq, D]`, `k, v [B, S, Hkv, D]` with an optional `attention_mask [B, S]`
  (1 = real token). Runs SDPA with a causal + key-padding mask.
* packed: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `cu_seqlens [N+1]` (int32, cumulative
  sequence starts). No attention crosses a sequence boundary. On CUDA this uses
  flash-attn's varlen kernel when importable (its deterministic backward in torch's
  deterministic mode), else the FlashAttention kernels shipped with PyTorch (`_FlashVarlen`); everywhere else SDPA with the block-diagonal causal mask
  (`block_causal_mask`, the reference semantics), computed segment by segment padded to the
  longest whenever that scores fewer pairs than the whole row: 64 short sequences packed into
  one row then cost 64 small squares, not one large one (the demo's warm-up step: 2x faster).

  With a shared prefix (`PrefixSharing`: the responses of one prompt laid out after a single
  copy of it, `trainer.forward`) a segment's keys are gathered from the packed row and may be
  more than its own tokens: a response's keys are its prompt's followed by its own. Its
  queries are the last tokens of its keys (causal, aligned at the end, as FlashAttention
  aligns queries shorter than their keys), so each response token attends to the whole
  prompt and to the response up to itself, exactly as in the prompt + response sequence.

Every path takes a sliding `window` (None or 0: the whole context): a query at position p sees the keys at
positions p - window + 1 .. p, itself included, as transformers' sliding-window mask (`kv > q - window`) and
FlashAttention's `window_size = (window - 1, 0)` read it. Positions are those of the whole sequence: with a
shared prefix a response's window reaches back into its prompt.

Every path takes a `softcap` (None: none; Gemma 2's attn_logit_softcapping): the scaled scores become
cap·tanh(scores / cap) before the mask and the softmax (`soft_cap`), as transformers' eager attention caps them.
Neither SDPA nor FlashAttention can. A capped packed batch on CUDA takes `models/attention_triton.py`'s
FlashAttention-2-style Triton kernels (online softmax, the cap and its derivative inside; a deterministic backward;
custom ops that `torch.compile` traces), which keep only q, k, v, the output and the rows' log-sum-exp: memory linear
in the tokens, as an uncapped model's FlashAttention. So does a capped padded batch (`attention_padded`,
use_remove_padding false), its rows read as one packed row (`_padded_as_packed`). `MESHPPO_CAPPED_ATTENTION` chooses
(`capped_triton`): `auto` (default: CUDA with triton installed, head dims up to 256), `torch`, or `triton` (CPU
tensors too, under `TRITON_INTERPRET=1` in the tests). Elsewhere a capped model's scores are explicit (`sdpa`: SDPA's
math written out, the softmax in float32 for 16-bit inputs), segment by segment as above, or over the whole row's
mask under `torch.compile`; they take memory by the squared lengths, as transformers' eager attention does: a
layer's [N + 1, heads, longest, longest] scores and probabilities kept for the backward (gradient checkpointing
keeps one layer's). An uncapped model's paths are unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:  # optional: never required
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # pragma: no cover - depends on the machine
    _flash_varlen = None

from models.triton_support import path_choice, triton_usable

_CAPPED_ENV = "MESHPPO_CAPPED_ATTENTION"
CAPPED_TRITON_MAX_HEAD_DIM = 256  # models/attention_triton.py's MAX_HEAD_DIM (that module imports triton)


class PrefixSharing(NamedTuple):
    """The keys of each packed query segment where some segments read a prefix that is not theirs:
    `kv_index [Tk]` (int64) gathers them from the packed row's keys and values, segment after
    segment in `cu_seqlens` order, `cu_seqlens_k [N+1]` (int32) and `max_seqlen_k` delimit them.
    A segment's queries are the last tokens of its keys (`attention_packed`)."""

    kv_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int


class _FlashVarlen(torch.autograd.Function):
    """Causal varlen FlashAttention (the kernels PyTorch ships) called through its aten ops.

    `torch.nn.attention.varlen.varlen_attn` runs the same two kernels, but as custom ops whose
    Python dispatch (forward, then a second custom op for the backward) took 648 µs of host time
    per layer forward + backward on an H200 where this takes 274 µs; the host bounds a small
    model's update.
    FlashAttention takes fewer K/V heads than query heads natively (GQA) and returns K/V
    gradients with K/V's head count. Keys may be longer than their queries (`cu_seqlens_k`):
    causal attention then aligns the queries with the last keys."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, scale, window=None):
        left = window - 1 if window else None  # (window - 1, 0): the last `window` keys, as transformers' flash
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=None if left is None else 0)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, cu_seqlens_k, rng_state, unused)
        ctx.max_seqlen, ctx.max_seqlen_k, ctx.scale, ctx.left = max_seqlen, max_seqlen_k, scale, left
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu_k, ctx.max_seqlen, ctx.max_seqlen_k, 0.0, True,
            rng_state, unused, scale=ctx.scale, window_size_left=ctx.left,
            window_size_right=None if ctx.left is None else 0)
        return dq, dk, dv, None, None, None, None, None, None


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap·tanh(x / cap)` in `x`'s dtype, rounded as transformers' Gemma2 rounds it (divide, tanh, multiply: its
    attention scores' and its logits' soft cap); `x` itself where `cap` is None (or 0)."""
    return torch.tanh(x / cap) * cap if cap else x


def sdpa(q, k, v, attn_mask=None, scale: float | None = None, softcap: float | None = None, is_causal: bool = False):
    """`F.scaled_dot_product_attention` of q [..., Hq, S, D] and k / v with as many heads (`attn_mask` boolean,
    True = attend); with `softcap` its math written out (SDPA cannot cap the scores): the scaled scores capped
    (`soft_cap`), masked, softmax (in float32 for 16-bit inputs, as transformers' eager attention takes it) times v."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    scores = soft_cap((q @ k.transpose(-1, -2)) * scale, softcap)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    half = scores.dtype in (torch.float16, torch.bfloat16)
    return torch.softmax(scores, -1, dtype=torch.float32 if half else None).to(v.dtype) @ v


def flash_varlen_usable(q: torch.Tensor) -> bool:
    """Whether `attention_packed` takes a FlashAttention kernel for `q`: CUDA, fp16/bf16."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def capped_triton(q: torch.Tensor) -> bool:
    """Whether a capped `attention_packed` of `q` takes the Triton kernels (module docstring):
    `MESHPPO_CAPPED_ATTENTION` `auto` (default) where `triton_usable` for a head dim up to 256, `torch` never,
    `triton` always (a head dim or dtype the kernels cannot take is then an error naming them)."""
    choice = path_choice(_CAPPED_ENV)
    if choice == "auto":
        return triton_usable(q.device) and q.shape[-1] <= CAPPED_TRITON_MAX_HEAD_DIM
    return choice == "triton"


def _expand_kv(x: torch.Tensor, n_rep: int, head_dim_axis: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim_axis)


def attention_padded(q, k, v, attention_mask: torch.Tensor | None, scale: float,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]; `window`: each query sees its last `window` columns
    (a row's tokens are contiguous, padding at either end, so columns are positions); `softcap`: the scores'
    soft cap (module docstring)."""
    if softcap and capped_triton(q):
        return _padded_as_packed(q, k, v, attention_mask, scale, window, softcap)
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = _expand_kv(k, n_rep, 1), _expand_kv(v, n_rep, 1)
    s = q.shape[2]
    if attention_mask is None and not (window and window < s):
        out = sdpa(q, k, v, is_causal=True, scale=scale, softcap=softcap)
    else:
        i = torch.arange(s, device=q.device)
        causal = _within(i[:, None] - i[None, :], window)
        mask = causal[None] if attention_mask is None else causal[None] & attention_mask.bool()[:, None, :]
        # A padding query would attend to nothing (NaN softmax); let it see itself instead.
        mask = mask | torch.eye(s, dtype=torch.bool, device=q.device)[None]
        out = sdpa(q, k, v, attn_mask=mask[:, None], scale=scale, softcap=softcap)
    return out.transpose(1, 2)


def _padded_as_packed(q, k, v, attention_mask: torch.Tensor | None, scale: float, window: int | None,
                      softcap: float) -> torch.Tensor:
    """`attention_padded` through the capped Triton kernels: the [B, S] rows read as one packed row of B·S tokens
    whose segments are each row's left padding, its tokens and its right padding (lengths 0 allowed; computed on the
    device, no host sync). A row's tokens see exactly what they see in the padded masks (their own columns,
    causal, windowed); a padding query sees the padding before it in its run where the masks let it see only itself:
    its output differs, and nothing reads it (no real query sees a padding key; the losses mask padding out)."""
    from models.attention_triton import capped_attention

    b, s = q.shape[:2]
    if attention_mask is None:
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=q.device)
    else:
        real = attention_mask.bool()
        left = (real.cumsum(1) == 0).sum(1)
        count = real.sum(1)
        lengths = torch.stack([left, count, s - left - count], 1).flatten()
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    out = capped_attention(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]),
                           v.reshape(b * s, *v.shape[2:]), cu, cu, s, s, scale, window, softcap)
    return out.view(q.shape)


def _within(distance: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether a key `distance` positions before its query (negative: after it) is attended: causal, and
    (`window`) at most window - 1 back."""
    seen = distance >= 0
    return seen & (distance < window) if window else seen


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, cu_seqlens_k: torch.Tensor | None = None,
                      total_k: int | None = None, window: int | None = None) -> torch.Tensor:
    """[T, Tk] boolean mask: causal inside each packed segment, nothing across them. With
    `cu_seqlens_k` (keys laid out apart from the queries) a query sees the keys of its segment up
    to its own distance from the segment's end (queries aligned with the last keys); without, the
    keys are the queries' own positions ([T, T]). `window`: only the last `window` of them."""
    seg_q, back_q = _back(cu_seqlens, total)
    seg_k, back_k = (seg_q, back_q) if cu_seqlens_k is None else _back(cu_seqlens_k, total_k)
    return (seg_q[:, None] == seg_k[None, :]) & _within(back_k[None, :] - back_q[:, None], window)


def attention_packed(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                     shared: PrefixSharing | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens [N+1] int32 -> [T,Hq,D]; `shared`: the segments' keys,
    `window`: the sliding window, `softcap`: the scores' soft cap (module docstring)."""
    cu_k, max_k = cu_seqlens, max_seqlen
    if shared is not None:
        k, v = k[shared.kv_index], v[shared.kv_index]
        cu_k, max_k = shared.cu_seqlens_k, shared.max_seqlen_k
    if softcap and capped_triton(q):
        from models.attention_triton import capped_attention

        return capped_attention(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, scale, window, softcap)
    if flash_varlen_usable(q) and not softcap:
        if _flash_varlen is not None:
            # flash-attn's backward accumulates dq with atomics unless asked not to: torch's deterministic
            # mode (fsdp_config.full_determinism) reaches PyTorch's kernels (`_FlashVarlen`) by itself, not these
            return _flash_varlen(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, softmax_scale=scale, causal=True,
                                 window_size=(window - 1, 0) if window else (-1, -1),
                                 deterministic=torch.are_deterministic_algorithms_enabled())
        return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_k, int(max_seqlen),
                                  int(max_k), float(scale), int(window) if window else None)
    n_rep = q.shape[1] // k.shape[1]
    if not torch.compiler.is_compiling():
        segments = _segment_layouts(cu_seqlens.long(), q.shape[0], cu_k.long(), k.shape[0])
        if segments is not None:
            return _attention_by_segment(q, k, v, *segments, n_rep, scale, window, softcap)
    if shared is None:
        mask = block_causal_mask(cu_seqlens.long(), q.shape[0], window=window)
    else:
        mask = block_causal_mask(cu_seqlens.long(), q.shape[0], cu_k.long(), k.shape[0], window)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    kt, vt = _expand_kv(kt, n_rep, 1), _expand_kv(vt, n_rep, 1)
    out = sdpa(qt, kt, vt, attn_mask=mask[None, None], scale=scale, softcap=softcap)
    return out[0].transpose(0, 1)


def _layout(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each position's segment and offset in it, and the segments' lengths: `cu`'s N segments and
    the positions past `cu[-1]` (trailing padding) as an (N+1)-th, of length 0 when there are none."""
    lengths = torch.cat([cu[1:] - cu[:-1], (total - cu[-1:]).clamp(min=0)])
    starts = torch.cat([cu[:-1], cu[-1:]])
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    return seg, torch.arange(total, device=cu.device) - starts[seg], lengths


def _back(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's segment (`_layout`) and its distance to the segment's last position."""
    seg, off, lengths = _layout(cu, total)
    return seg, lengths[seg] - 1 - off


def _segment_layouts(cu_q: torch.Tensor, total_q: int, cu_k: torch.Tensor, total_k: int):
    """The query and key layouts by segment (`_layout`) when attending segment by segment, padded to
    the longest, costs fewer scores than the block-diagonal mask over the whole row; else None."""
    q_layout, k_layout = _layout(cu_q, total_q), _layout(cu_k, total_k)
    n, longest_q, longest_k = len(q_layout[2]), int(q_layout[2].max()), int(k_layout[2].max())
    if n * longest_q * longest_k >= total_q * total_k:
        return None
    return q_layout, k_layout, longest_q, longest_k


def _attention_by_segment(q, k, v, q_layout, k_layout, longest_q: int, longest_k: int, n_rep: int, scale: float,
                          window: int | None = None, softcap: float | None = None):
    """`attention_packed`'s reference semantics (`block_causal_mask`) computed per segment: the
    segments' queries and keys padded to `[N+1, longest, H, D]`, one masked SDPA over them, the
    queries' outputs gathered back. A padding query sees its segment's first key (its output is
    dropped), so no row of the softmax is empty."""
    (seg_q, off_q, len_q), (seg_k, off_k, len_k) = q_layout, k_layout
    n = len(len_q)

    def pad(x, seg, off, longest):
        return x.new_zeros(n, longest, *x.shape[1:]).index_put((seg, off), x)

    qp = pad(q, seg_q, off_q, longest_q).transpose(1, 2)
    kp, vp = (_expand_kv(pad(t, seg_k, off_k, longest_k).transpose(1, 2), n_rep, 1) for t in (k, v))
    i = torch.arange(longest_q, device=q.device)[None, :, None]
    j = torch.arange(longest_k, device=q.device)[None, None, :]
    # Aligned at the end, as block_causal_mask: query i of a segment sees key j when both are in
    # it and j is no further from the keys' end than i is from the queries' end (and, with a
    # window, less than `window` further back than i).
    mask = (j < len_k[:, None, None]) & _within((i - len_q[:, None, None]) - (j - len_k[:, None, None]), window)
    mask = mask | ((i >= len_q[:, None, None]) & (j == 0))
    out = sdpa(qp, kp, vp, attn_mask=mask[:, None], scale=scale, softcap=softcap)
    return out.transpose(1, 2)[seg_q, off_q]
