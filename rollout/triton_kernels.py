"""Triton kernels of the engine (CUDA; also runnable on CPU under `TRITON_INTERPRET=1`).

`TritonOps` has the methods of `rollout.ops.TorchOps` and the same numerics (roundings to the
model dtype where the training model rounds). Kernels with a fixed grid per batch size and
no host synchronisation, so that a decode step can be captured in a CUDA graph:

* `linear`, `gated_linear`: one row (a decode step of one sequence) times a weight `[N, K]`;
  more rows go to cuBLAS (`F.linear`).
* `rms_norm`: residual add + RMSNorm in one pass; `post_norm_add`: a post-norm block's (OLMo-2's,
  Gemma 3's) RMSNorm of a branch's output added to the residual stream, in one pass. Gemma 3's
  norms by 1 + weight (`OFFSET`, here and in `qk_norm`) and its GeGLU (`GELU`, in `silu_and_mul`
  and the gated GEMV) are constexpr variants of the same kernels.
* `qk_square_sums`, `full_qk_norm`: OLMo-2's q / k norms over the whole projections (the sums of
  squares of a rank's columns, which TP all-reduces between the two, then the norm by them).
* `silu_and_mul`: the gated MLP activation.
* `rope_and_cache`: RoPE on q (in place) and k, and the K/V write into the paged cache
  (prefill steps); with an e4m3 cache (`EngineConfig.kv_cache_dtype = "fp8"`) each row of K
  and V is written as e4m3 values and one float32 scale, which the attention kernels apply to
  the scores and to the probabilities.
* `decode_attention`: RoPE on the step's q and k, the K/V write, and split-K flash decoding
  over the paged cache (one kernel when each sequence has one split, else after
  `rope_and_cache`); one program per (sequence, KV head, split) computes all query heads of
  its group with one `tl.dot`, so each K/V row is read once; a second kernel merges splits by
  log-sum-exp.
* `prefill_attention`: flash attention of packed query chunks over their paged context
  (prefix included), causal. Both attentions soft-cap the scaled scores where `SOFTCAP` (a constexpr, Gemma 2's
  attn_logit_softcapping; 0, the uncapped kernels, compiled as before) is set: cap·tanh(s / cap) before the mask
  (`_capped`; the logits' cap is the sampler's, below).
* `sample_partials`: the exponential race and log-normaliser over vocabulary chunks (the
  noise and the greedy rule of `rollout.sampler`), soft-capping each logit it reads where `SOFTCAP`
  (Gemma 2's final_logit_softcapping; 0, the uncapped kernel, compiled as before) is set
  (`_capped_logits`); `combine_partials` merges the chunks.
* `step_inputs`, `step_outputs`: a captured decode step's inputs read from, and its results
  written to, pinned host memory, the half that a parity on the device names: no copy
  between two replays.

At one row, `linear` is a GEMV that streams the weight once and `gated_linear` adds the SwiGLU
activation to it (gate and up rows in one program); the LM head stays on cuBLAS, which read
it faster (BENCHMARKS.md, "Seventh pass"). On Hopper and later every kernel is
launched with programmatic dependent launch (`_after_previous`; `MESHPPO_PDL=off` turns it
off): a decode step at batch 1 is ~250 short kernels, and each one's start (for a GEMV, its
first weight loads) then overlaps the previous one's end.

The RoPE and attention kernels hold a head in `head_lanes(head_dim)` lanes, a power of two of at
least 16 (the least reduction of `tl.dot`): another head_dim (80, 96, 100; 8) runs in the padded
tile with its extra lanes masked; at a power of two from 16 up the masks are always true (a few
loads and stores become predicated; the same loads, vector widths and launches as without them).

The RMSNorm, SwiGLU and RoPE arithmetic (`weighted_norm_row`, `act_mul`, `rotate_half`) is
`models/block_triton.py`'s, which the training model's fused ops use too.

float32 inputs use IEEE dot products (`input_precision="ieee"`): TF32 would cost the
float32 engine its agreement with the reference.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:  # the CUDA math library's fast functions (the interpreter has none: CPU runs take tl.log)
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the triton version
    libdevice = None
try:  # grid dependency control: programmatic dependent launch (Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the triton version
    gdc_launch_dependents = gdc_wait = None

from models.block_triton import act_mul, rotate_half, silu_mul, soft_cap, tanh, weighted_norm_row
from rollout.attention import PREFILL_TILE, AttentionMetadata
from rollout.config import KV_FP8_DTYPES
from rollout.ops import FP8, FP8_MAX, FP8_TINY, scaled_linear

# ---------------------------------------------------------------------------- launch order


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL), a kernel may start while the previous one in
    the stream is still running: wait here until that kernel has finished and its writes are
    visible, then let the next kernel start. Every kernel below calls this before it reads
    anything a previous kernel wrote or writes anything, and before it can finish: then each
    kernel still completes after all earlier ones, as in plain stream order."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# ---------------------------------------------------------------------------- GEMV


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, GELU: tl.constexpr):
    # BLOCK_N weight rows per program, each a dot product over K in float32: the rows are read
    # once (evict-first: nothing reuses them), the products accumulated per lane and reduced
    # once at the end. GATED: the weight is [gate | up] (2N rows) and the program's rows pair
    # gate feature j with up feature j (BLOCK_N / 2 features), stored as silu(gate) * up,
    # rounded as the unfused ops round. The first weight tile loads before the wait for the
    # previous kernel (no kernel of a step writes weights): under PDL it streams while that
    # kernel finishes.
    i = tl.arange(0, BLOCK_N)
    if GATED:
        feat = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        src = feat + (i % 2) * N
    else:
        feat = tl.program_id(0) * BLOCK_N + i
        src = feat
    fmask = feat < N
    rows = w_ptr + src[:, None].to(tl.int64) * stride_w
    rk = tl.arange(0, BLOCK_K)
    w = tl.load(rows + rk[None, :], mask=fmask[:, None] & (rk[None, :] < K), other=0.0, eviction_policy="evict_first")
    _after_previous(PDL)
    x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(rows + rk[None, :], mask=fmask[:, None] & (rk[None, :] < K), other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + src, mask=fmask, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if GATED:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + out, act_mul(gate, up, GELU), mask=out < N)
    else:
        tl.store(y_ptr + feat, y, mask=fmask)


# ---------------------------------------------------------------------------- norms, MLP


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, xs_ptr, stride_s, stride_x, stride_r, stride_o, N, eps, scale,
                     PARTS: tl.constexpr, HAS_RES: tl.constexpr, X_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr, OFFSET: tl.constexpr):
    # PARTS > 0: x is a projection's PARTS float32 split-K products (stride_s apart), summed in
    # order and rounded to the residual's dtype, as `rollout.ops.sum_split_k` does. X_SCALE: x is an
    # fp8 projection's rows, times their scales `xs [T]` in float32, rounded to the residual's dtype.
    # With a residual, x (a block branch's output) is times `scale` (Granite's residual_multiplier; 1 elsewhere, exact)
    # and rounded before the add. The output is rounded to out's dtype (the model's, or e4m3 on the fp8 path).
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        if PARTS > 0:
            for s in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + s * stride_s + row * stride_x + offs, mask=mask, other=0.0)
            x = x.to(r.dtype)
        if X_SCALE:
            x = (x.to(tl.float32) * tl.load(xs_ptr + row)).to(r.dtype)
        x = (x.to(tl.float32) * scale).to(r.dtype)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the residual add rounds like torch's
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out, _ = weighted_norm_row(x, w.to(tl.float32), N, eps, OFFSET)  # (Gemma 3's: times 1 + w, rounded once)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(qkv_ptr, q_w_ptr, k_w_ptr, stride_t, HQ, HEADS, D, eps, HEADS_P: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr, OFFSET: tl.constexpr):
    # program t: every head of token t's q (h < HQ) and k (the next HEADS - HQ), each normed over its D
    # values in place, as `rms_norm_row` norms a row (`TorchOps.qk_norm`); one program a token, not a head
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    mask = (h < HEADS) & (d < D)
    ptr = qkv_ptr + t * stride_t + h * D + d
    x = tl.load(ptr, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    w = tl.where(h < HQ, tl.load(q_w_ptr + d, mask=d < D, other=0.0), tl.load(k_w_ptr + d, mask=d < D, other=0.0))
    if OFFSET:  # Gemma 3's: times 1 + w in float32, rounded once
        out = xf * rstd[:, None] * (1.0 + w.to(tl.float32))
    else:
        out = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(ptr, out.to(qkv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _post_norm_add_kernel(x_ptr, res_ptr, w_ptr, stride_x, stride_r, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr,
                          OFFSET: tl.constexpr):
    # row t: res = res + norm(x) * w, the norm rounded to res's dtype as `rms_norm`'s output, then the add rounded
    # like torch's (`TorchOps.post_norm_add`); in place into res
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    normed, _ = weighted_norm_row(x, w.to(tl.float32), N, eps, OFFSET)  # (Gemma 3's: times 1 + w, rounded once)
    normed = normed.to(r.dtype)
    tl.store(res_ptr + row * stride_r + offs, (normed.to(tl.float32) + r.to(tl.float32)).to(r.dtype), mask=mask)


@triton.jit
def _qk_square_sums_kernel(qkv_ptr, out_ptr, stride_t, QW, KW, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # token t: the float32 sums of squares of its q columns [0, QW) and k columns [QW, QW + KW) into out [T, 2]
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_t
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, QW, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < QW, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + t * 2, tl.sum(acc, axis=0))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, KW, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(row + QW + offs, mask=offs < KW, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + t * 2 + 1, tl.sum(acc, axis=0))


@triton.jit
def _norm_by_sums_kernel(x_ptr, w_ptr, sums_ptr, stride_t, WIDTH, J, TOTAL, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    # token t: its WIDTH columns at x normed in place by the root mean square sqrt(sums[t, J] / TOTAL + eps) (TOTAL,
    # a float: the whole projection's columns, over every TP rank), rounded to x's dtype, times w, rounded again
    # (`TorchOps.full_qk_norm`)
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    ms = tl.math.div_rn(tl.load(sums_ptr + t * 2 + J), TOTAL)
    rstd = 1.0 / tl.sqrt(ms + eps)
    row = x_ptr + t * stride_t
    for c in range(0, WIDTH, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        mask = offs < WIDTH
        x = tl.load(row + offs, mask=mask, other=0.0)
        y = (x.to(tl.float32) * rstd).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(row + offs, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     GELU: tl.constexpr):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + col, act_mul(g, u, GELU), mask=mask)


@triton.jit
def _e4m3_scale(amax, FP8_MAX: tl.constexpr, FP8_TINY: tl.constexpr):
    """(multiplier, scale) of rows whose largest |value| is `amax` (float32): `rollout.ops.quantize_rows`'s."""
    amax = tl.maximum(amax, FP8_TINY)
    return tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax), \
        tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, N, FP8_MAX: tl.constexpr,
                         FP8_TINY: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr, PDL: tl.constexpr):
    # One row a program, as `silu_and_mul_fp8`: the row's largest |silu(gate) * up|, then the row scaled
    # to put it at FP8_MAX and rounded to e4m3. WHOLE_ROW (BLOCK >= N): the row stays in registers, one
    # read of gate/up; otherwise two passes over it in blocks, the second recomputing the products.
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    if WHOLE_ROW:
        col = tl.arange(0, BLOCK)
        mask = col < N
        g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
        v = silu_mul(g, u).to(tl.float32)
        inv, scale = _e4m3_scale(tl.max(tl.abs(v), axis=0), FP8_MAX, FP8_TINY)
        tl.store(out_ptr + row * stride_o + col, (v * inv).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
        return
    amax = tl.zeros((), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        col = start + tl.arange(0, BLOCK)
        mask = col < N
        g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(silu_mul(g, u).to(tl.float32)), axis=0))
    inv, scale = _e4m3_scale(amax, FP8_MAX, FP8_TINY)
    for start in range(0, N, BLOCK):
        col = start + tl.arange(0, BLOCK)
        mask = col < N
        g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
        q = silu_mul(g, u).to(tl.float32) * inv
        tl.store(out_ptr + row * stride_o + col, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


# ---------------------------------------------------------------------------- RoPE + cache write


@triton.jit
def _rope_cache_kernel(qkv_ptr, stride_t, pos_ptr, tslot_ptr, bt_ptr, stride_bt, cos_ptr, sin_ptr,
                       k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr,
                       PAGE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                       HQ_P: tl.constexpr, HKV_P: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                       FP8_TINY: tl.constexpr, PDL: tl.constexpr):
    # KV_FP8: each head's rotated k (in the model dtype) and its v are written as e4m3 values and one
    # float32 scale (`rollout.ops.quantize_rows`) at `ks_ptr` / `vs_ptr [rows, HKV]`.
    # Each half of a head is a tile of D_P / 2 lanes, the lanes past D / 2 masked (`head_lanes`).
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(tslot_ptr + t).to(tl.int64)
    page = tl.load(bt_ptr + slot * stride_bt + pos // PAGE).to(tl.int64)
    row = page * PAGE + pos % PAGE
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, D_P // 2)
    im = i < HALF
    c = tl.load(cos_ptr + pos * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    base = qkv_ptr + t * stride_t

    h = tl.arange(0, HQ_P)[:, None]
    hm = (h < HQ) & im[None, :]
    p = base + h * D + i[None, :]
    o1, o2 = rotate_half(tl.load(p, mask=hm), tl.load(p + HALF, mask=hm), c, s, c, s)
    tl.store(p, o1, mask=hm)
    tl.store(p + HALF, o2, mask=hm)

    h = tl.arange(0, HKV_P)[:, None]
    hm = (h < HKV) & im[None, :]
    p = base + HQ * D + h * D + i[None, :]
    o1, o2 = rotate_half(tl.load(p, mask=hm), tl.load(p + HALF, mask=hm), c, s, c, s)
    dst = row * (HKV * D) + h * D + i[None, :]
    d = tl.arange(0, D_P)[None, :]
    vm = (h < HKV) & (d < D)
    v = tl.load(base + (HQ + HKV) * D + h * D + d, mask=vm)
    if KV_FP8:  # the row maxima over the head's lanes only (a masked load's lanes hold anything)
        o1, o2, v = o1.to(tl.float32), o2.to(tl.float32), v.to(tl.float32)
        k_amax = tl.maximum(tl.max(tl.where(im[None, :], tl.abs(o1), 0.0), 1),
                            tl.max(tl.where(im[None, :], tl.abs(o2), 0.0), 1))
        k_mul, k_scale = _e4m3_scale(k_amax, FP8_MAX, FP8_TINY)
        v_mul, v_scale = _e4m3_scale(tl.max(tl.where(d < D, tl.abs(v), 0.0), 1), FP8_MAX, FP8_TINY)
        o1, o2, v = o1 * k_mul[:, None], o2 * k_mul[:, None], v * v_mul[:, None]
        hs = tl.arange(0, HKV_P)
        tl.store(ks_ptr + row * HKV + hs, k_scale, mask=hs < HKV)
        tl.store(vs_ptr + row * HKV + hs, v_scale, mask=hs < HKV)
    et = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, o1.to(et), mask=hm)
    tl.store(k_cache_ptr + dst + HALF, o2.to(et), mask=hm)
    tl.store(v_cache_ptr + row * (HKV * D) + h * D + d, v.to(et), mask=vm)


# ---------------------------------------------------------------------------- attention


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, n, nm, kvh, d, qk_scale,
              HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr):
    """K and V tiles `[len(n), len(d)]` of one KV head at positions `n` (masked by `nm`), read through the
    sequence's block table (lanes `d` past the head's D values read as zeros), and what the scores and the
    probabilities are to be multiplied by: `qk_scale` and 1, or (KV_FP8: e4m3 tiles) `qk_scale` times each
    key's scale and each value's scale `[len(n)]`."""
    page = tl.load(bt_ptr + slot * stride_bt + n // PAGE, mask=nm, other=0).to(tl.int64)
    r = page * PAGE + n % PAGE
    off = r[:, None] * (HKV * D) + kvh * D + d[None, :]
    m = nm[:, None] & (d[None, :] < D)
    k, v = tl.load(k_ptr + off, mask=m, other=0.0), tl.load(v_ptr + off, mask=m, other=0.0)
    if KV_FP8:
        k_scale = tl.load(ks_ptr + r * HKV + kvh, mask=nm, other=0.0)[None, :] * qk_scale
        v_scale = tl.load(vs_ptr + r * HKV + kvh, mask=nm, other=0.0)[None, :]
    else:
        k_scale = qk_scale
        v_scale = 1.0
    return k, v, k_scale, v_scale


@triton.jit
def _capped(qk, SOFTCAP: tl.constexpr):
    """Base-2 scores `qk` (the scaled scores s times log2 e) of s soft-capped, cap·tanh(s / cap) times log2 e
    (`models.attention.soft_cap`); `qk` itself where SOFTCAP is 0."""
    if SOFTCAP > 0:
        return soft_cap(qk * 0.6931471805599453, SOFTCAP) * 1.4426950408889634
    return qk


@triton.jit
def _online_softmax_step(qk, v, p_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one tile of base-2 scores `qk [R, N]` (masked entries -inf) and its values `v [N, D]`
    (in the query's dtype) into the running row max, exp-sum and unnormalised output; the
    probabilities are multiplied by `p_scale` (the values' e4m3 scales, or 1) before the product. A row
    that has seen no key yet (a sliding window's first tile may mask all of it) stays at -inf, 0, 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (-inf) - (-inf) would be NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot((p * p_scale).to(v.dtype), v, IEEE)


@triton.jit
def _attend_span(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, start, end, kvh, d, qk_scale,
                 HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Queries `q [ROWS, D_P]` (lanes `d`) that see every key of positions `[start, end)` of KV head
    `kvh`: the running row max (base 2), exp-sum and unnormalised output over them (the scores soft-capped by
    SOFTCAP, 0: none)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        k, v, k_scale, v_scale = _paged_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, n, nm, kvh, d,
                                           qk_scale, HKV, D, PAGE, KV_FP8)
        qk = _capped(_dot(q, tl.trans(k.to(q.dtype)), IEEE) * k_scale, SOFTCAP)  # log2 units
        qk = tl.where(nm[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v.to(q.dtype), v_scale, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _window_start(qpos, window):
    """The first position a query at `qpos` sees through a sliding `window` (0: the whole context)."""
    return tl.where(window > 0, tl.maximum(qpos - window + 1, 0), 0)


@triton.jit
def _qkv_load(row, col, mask, stride_s, b_ptr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Columns `col` of one decode row of qkv: the projection as stored, or (PARTS > 0) the sum in order
    of its PARTS float32 split-K products plus the bias, in float32 (`rollout.ops.sum_split_k`, which
    the caller's rounding to the cache dtype completes)."""
    x = tl.load(row + col, mask=mask, other=0.0)
    if PARTS > 0:
        for s in tl.static_range(1, PARTS):
            x += tl.load(row + s * stride_s + col, mask=mask, other=0.0)
        if HAS_BIAS:
            x += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _rope_lanes(row, col0, mask, lane, pos, cos_ptr, sin_ptr, stride_s, b_ptr, HALF: tl.constexpr,
                PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """RoPE of heads of one decode row of qkv (`_qkv_load`) whose columns start at `col0 [R, 1]`, in
    their stored layout: lane j (masked by `mask`, zero there) with its partner j +- HALF, by
    `rotate_half` with sin negated on the second half: the same products and roundings."""
    first = lane < HALF
    j = tl.where(first, lane, lane - HALF)  # the lane's frequency
    jm = lane < 2 * HALF
    c = tl.load(cos_ptr + pos * HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.where(first, s, -s)[None, :]
    dt = cos_ptr.dtype.element_ty
    x = _qkv_load(row, col0 + lane[None, :], mask, stride_s, b_ptr, PARTS, HAS_BIAS).to(dt)
    partner = _qkv_load(row, col0 + tl.where(first, lane + HALF, j)[None, :], mask, stride_s, b_ptr, PARTS,
                        HAS_BIAS).to(dt)
    rotated, _ = rotate_half(x, partner, c, s, c, s)
    return rotated


@triton.jit
def _decode_attn_kernel(qkv_ptr, stride_qb, stride_qs, qkv_b_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                        bt_ptr, stride_bt, slots_ptr, ctx_ptr, out_ptr, stride_ob, part_o_ptr, part_lse_ptr, qk_scale,
                        num_splits, window, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                        D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLIT: tl.constexpr, ROPE: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_TINY: tl.constexpr,
                        IEEE: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr):
    # ROPE: the step's token sits at position ctx - 1 of its sequence: every program rotates the
    # query heads of its KV head (`rotate_half`, as `_rope_cache_kernel` does), and the program
    # whose split holds that position rotates the token's key and writes it and the value into
    # the cache before it reads the split's keys (the write is then visible to the whole program).
    # Else `_rope_cache_kernel` has run: q is rotated in place in `qkv`, the cache written.
    # PARTS > 0 (ROPE only): qkv is the projection's split-K products, summed here with its bias.
    # A head is a tile of D_P lanes, those past D masked (`head_lanes`). The splits share the keys
    # the query sees: its sliding window's (`window` > 0) or the whole context.
    _after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    lo = _window_start(ctx - 1, window)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + sp * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    gm = g < G
    d = tl.arange(0, D_P)
    dm = d < D
    qm = gm[:, None] & dm[None, :]
    heads = kvh * G + g
    row = qkv_ptr + b * stride_qb
    if ROPE:
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, D_P // 2)
        im = i < HALF
        pos = (ctx - 1).to(tl.int64)
        c = tl.load(cos_ptr + pos * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
        dt = cos_ptr.dtype.element_ty  # the model dtype
        if D_P == D:  # the rotated halves side by side are the head as stored, the keys' layout
            qc = heads[:, None] * D + i[None, :]
            q1, q2 = rotate_half(_qkv_load(row, qc, gm[:, None], stride_qs, qkv_b_ptr, PARTS, HAS_BIAS).to(dt),
                                 _qkv_load(row, qc + HALF, gm[:, None], stride_qs, qkv_b_ptr, PARTS, HAS_BIAS).to(dt),
                                 c, s, c, s)
            q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), [BLOCK_G, D])
        else:  # padded halves side by side would not be: rotate the head lane by lane instead
            q = _rope_lanes(row, heads[:, None] * D, qm, d, pos, cos_ptr, sin_ptr, stride_qs, qkv_b_ptr, HALF, PARTS,
                            HAS_BIAS)
        if (pos >= start) & (pos < end):
            kc = HQ * D + kvh * D + i[None, :]
            km = im[None, :]
            k1, k2 = rotate_half(_qkv_load(row, kc, km, stride_qs, qkv_b_ptr, PARTS, HAS_BIAS).to(dt),
                                 _qkv_load(row, kc + HALF, km, stride_qs, qkv_b_ptr, PARTS, HAS_BIAS).to(dt),
                                 c, s, c, s)
            page = tl.load(bt_ptr + slot * stride_bt + pos // PAGE).to(tl.int64)
            r = page * PAGE + pos % PAGE
            dst = r * (HKV * D) + kvh * D
            vc = (HQ + HKV) * D + kvh * D + d
            v = _qkv_load(row, vc, dm, stride_qs, qkv_b_ptr, PARTS, HAS_BIAS).to(dt)
            if KV_FP8:  # e4m3 values and one scale per head (`rollout.ops.quantize_rows`)
                k1, k2, v = k1.to(tl.float32), k2.to(tl.float32), v.to(tl.float32)
                k_mul, k_scale = _e4m3_scale(tl.maximum(tl.max(tl.abs(k1), 1), tl.max(tl.abs(k2), 1)),
                                             FP8_MAX, FP8_TINY)
                v_mul, v_scale = _e4m3_scale(tl.max(tl.abs(v), 0), FP8_MAX, FP8_TINY)
                k1, k2, v = k1 * k_mul[:, None], k2 * k_mul[:, None], v * v_mul
                tl.store(ks_ptr + r * HKV + kvh + tl.zeros([1], tl.int64), k_scale)
                tl.store(vs_ptr + r * HKV + kvh, v_scale)
            et = k_ptr.dtype.element_ty
            tl.store(k_ptr + dst + i[None, :], k1.to(et), mask=km)
            tl.store(k_ptr + dst + HALF + i[None, :], k2.to(et), mask=km)
            tl.store(v_ptr + dst + d, v.to(et), mask=dm)
            tl.debug_barrier()
    else:
        q = tl.load(row + heads[:, None] * D + d[None, :], mask=qm, other=0.0)
    m_i, l_i, acc = _attend_span(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, start, end, kvh, d,
                                 qk_scale, HKV, D, D_P, PAGE, BLOCK_G, BLOCK_N, KV_FP8, IEEE, SOFTCAP)
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qm)
    else:
        nonempty = l_i > 0  # a split past the end of a short context saw no key
        safe_l = tl.where(nonempty, l_i, 1.0)
        lse = tl.where(nonempty, m_i + tl.log2(safe_l), float("-inf"))
        idx = (b * HQ + heads) * num_splits + sp
        tl.store(part_o_ptr + idx[:, None] * D + d[None, :], acc / safe_l[:, None], mask=qm)
        tl.store(part_lse_ptr + idx, lse, mask=gm)


@triton.jit
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ob, num_splits,
                          HQ: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, S_P: tl.constexpr, PDL: tl.constexpr):
    _after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_P)
    sm = s < num_splits
    d = tl.arange(0, D_P)
    dm = d < D
    idx = (b * HQ + h) * num_splits + s
    lse = tl.load(part_lse_ptr + idx, mask=sm, other=float("-inf"))
    w = tl.where(sm, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # split 0 is never empty: the max is finite
    o = tl.load(part_o_ptr + idx[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _one_query_attn(q_ptr, stride_qt, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, out_ptr, stride_ot, q0, ctx,
                    slot, kvh, qk_scale, window, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                    D_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
                    IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    # A sequence with one query (a decoding row of a prefill step, or a one-token chunk): the G
    # query heads of KV head `kvh` are the rows of one tile, so its keys are read once, as in
    # `_decode_attn_kernel`. The query is the context's last position: every key is visible (every
    # key of its sliding window, `window` > 0).
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D_P)
    qm = (g < G)[:, None] & (d < D)[None, :]
    heads = kvh * G + g
    row = q0.to(tl.int64)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * D + d[None, :], mask=qm, other=0.0)
    _, l_i, acc = _attend_span(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, _window_start(ctx - 1, window),
                               ctx, kvh, d, qk_scale, HKV, D, D_P, PAGE, BLOCK_G, BLOCK_N, KV_FP8, IEEE, SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _prefill_attn_kernel(q_ptr, stride_qt, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, out_ptr, stride_ot,
                         cu_q_ptr, ctx_ptr, slots_ptr, tile_seq_ptr, tile_start_ptr, qk_scale, window,
                         HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                         D_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         KV_FP8: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr):
    _after_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_start_ptr + tile)
    q0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q0
    ctx = tl.load(ctx_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    kvh = h // G
    if q_len == 1:  # the program of the first head of each KV head does them all
        if h % G == 0:
            _one_query_attn(q_ptr, stride_qt, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, out_ptr, stride_ot,
                            q0, ctx, slot, kvh, qk_scale, window, HKV, G, BLOCK_G, D, D_P, PAGE, BLOCK_N, KV_FP8, IEEE,
                            SOFTCAP)
        return

    m = m0 + tl.arange(0, BLOCK_M)
    qpos = ctx - q_len + m
    d = tl.arange(0, D_P)
    qm = (m < q_len)[:, None] & (d < D)[None, :]
    rows = (q0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * D + d[None, :], mask=qm, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # keys past the tile's last query are masked anyway
    lo = _window_start(ctx - q_len + m0, window)  # nor before the first query's window (0: the whole context)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        k, v, k_scale, v_scale = _paged_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot, stride_bt, n, nm, kvh, d,
                                           qk_scale, HKV, D, PAGE, KV_FP8)
        qk = _capped(_dot(q, tl.trans(k.to(q.dtype)), IEEE) * k_scale, SOFTCAP)
        seen = nm[None, :] & (n[None, :] <= qpos[:, None]) & ((window <= 0) | (n[None, :] > qpos[:, None] - window))
        qk = tl.where(seen, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v.to(q.dtype), v_scale, m_i, l_i, acc, IEEE)
    # (a padding row's window may lie past the keys read: it saw none, and is not stored)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qm)


# ---------------------------------------------------------------------------- sampling


@triton.jit
def _capped_logits(x, SOFTCAP: tl.constexpr):
    """float32 of logits `x` (loaded in their dtype) soft-capped as `models.attention.soft_cap` rounds it in that
    dtype: x / cap, its tanh (`models.block_triton.tanh`) and that times cap, each rounded to the dtype; float32 `x`
    itself where SOFTCAP is 0. A value may differ from PyTorch's by one ulp of the dtype where the approximate tanh
    (or the GPU's approximate division and exp, or CUDA PyTorch's x times 1/cap) falls on the other side of a rounding
    boundary, and below ~1e-3 in magnitude by the tanh's absolute error (~4e-6), larger than their ulp there."""
    xf = x.to(tl.float32)
    if SOFTCAP > 0:
        q = (xf / SOFTCAP).to(x.dtype).to(tl.float32)
        xf = (tanh(q).to(x.dtype).to(tl.float32) * SOFTCAP).to(x.dtype).to(tl.float32)
    return xf


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, stride_l, keys_ptr, pos_ptr, thresh_ptr, inv_t_ptr, noise_ptr, parts_ptr,
                   V_LOCAL, VOCAB_START, PER_SPLIT, num_splits, HAS_THRESH: tl.constexpr, FAST_LOG: tl.constexpr,
                   BLOCK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr):
    # `rollout.sampler.sample_partials_ref` over one vocabulary split of one row: the race in
    # groups of GROUP ids, one lane per group of a block, each lane keeping its best group's
    # score and token and its share of the log-normaliser; with SOFTCAP, of the capped logits.
    _after_previous(PDL)
    NG: tl.constexpr = BLOCK // GROUP
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    key = tl.load(keys_ptr + r).to(tl.uint32)
    pos = tl.load(pos_ptr + r).to(tl.uint32)
    k1 = _mix32(key ^ _mix32(pos + 0x68E31DA4))
    k2 = _mix32(k1 + 0x1B56C4E9)
    inv_t = tl.load(inv_t_ptr)
    noise = tl.load(noise_ptr)
    if HAS_THRESH:
        thresh = tl.load(thresh_ptr + r)
    else:
        thresh = float("-inf")
    start = sp * PER_SPLIT
    end = tl.minimum(start + PER_SPLIT, V_LOCAL)
    j = tl.arange(0, GROUP)
    lane_best = tl.full([NG], float("-inf"), tl.float32)
    lane_idx = tl.zeros([NG], tl.int32)
    lane_m = tl.full([NG], float("-inf"), tl.float32)
    lane_z = tl.zeros([NG], tl.float32)
    row = logits_ptr + r * stride_l
    for v0 in range(start, end, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < end, other=float("-inf"))
        if SOFTCAP > 0:  # past the split's end stays -inf (the cap of -inf is -cap)
            x = tl.where(idx < end, _capped_logits(x, SOFTCAP), float("-inf"))
        x = x.to(tl.float32) * inv_t
        xg = tl.reshape(x, [NG, GROUP])
        mg = tl.max(xg, 1)
        mg_safe = tl.where(mg == float("-inf"), 0.0, mg)  # a group past the split's end
        w = tl.exp(xg - mg_safe[:, None])
        # The untruncated log-normaliser, merged per lane (two exponentials a group).
        m_new = tl.maximum(lane_m, mg)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        lane_z = lane_z * tl.exp(lane_m - m_safe) + tl.sum(w, 1) * tl.exp(mg - m_safe)
        lane_m = m_new
        if HAS_THRESH:
            w = tl.where(xg >= thresh, w, 0.0)
        cw = tl.cumsum(w, 1)
        mass = tl.max(cw, 1)
        gid = ((v0 + VOCAB_START) // GROUP + tl.arange(0, NG)).to(tl.uint32) ^ k1
        h_race = _mix32(_mix32(gid) + k2)
        h_pick = _mix32(_mix32(gid ^ 0x9E3779B9) + k2)  # `sampler._PICK_SALT`
        u_race = ((h_race >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact, in (0, 1): `uniform_from_bits`
        u_pick = ((h_pick >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        # Gumbel noise -log(E), E = -log(u) ~ Exp(1). E stays exact: near u = 1 it is ~6e-8, where
        # an approximate log's error is as large as E (a zero would make the noise +inf, the bias
        # of a uniformly drawn token). The outer log needs only a small absolute error: on CUDA the
        # hardware approximation (FAST_LOG).
        e = -tl.log(u_race)
        if FAST_LOG:
            g = -libdevice.fast_logf(e)
        else:
            g = -tl.log(e)
        pick = tl.minimum(tl.sum((cw <= (u_pick * mass)[:, None]).to(tl.int32), 1),
                          tl.max(tl.where(w > 0, j[None, :], 0), 1))
        first_max = tl.min(tl.where(xg == mg[:, None], j[None, :], GROUP), 1)
        allowed = tl.where(mg >= thresh, mg, float("-inf"))
        score = tl.where(noise > 0, mg + tl.log(mass) + g * noise, allowed)  # greedy: no noise term at all
        within = tl.where(noise > 0, pick, first_max)
        better = score > lane_best  # strict: a lane keeps its lowest index among ties
        lane_best = tl.where(better, score, lane_best)
        lane_idx = tl.where(better, v0 + tl.arange(0, NG) * GROUP + within, lane_idx)
    best = tl.max(lane_best, 0)
    win = tl.min(tl.where(lane_best == best, lane_idx, 2147483647), 0)
    s_win = _capped_logits(tl.load(row + win), SOFTCAP) * inv_t
    mmax = tl.max(lane_m, 0)
    msafe = tl.where(mmax == float("-inf"), 0.0, mmax)
    z = tl.sum(lane_z * tl.exp(lane_m - msafe), 0)
    out = parts_ptr + (r * num_splits + sp) * 5
    tl.store(out, best)
    tl.store(out + 1, (win + VOCAB_START).to(tl.int32).to(tl.float32, bitcast=True))
    tl.store(out + 2, s_win)
    tl.store(out + 3, mmax)
    tl.store(out + 4, z)


@triton.jit
def _combine_kernel(parts_ptr, P, tokens_ptr, logprobs_ptr, P_P: tl.constexpr, PDL: tl.constexpr):
    # `rollout.sampler.combine_partials` for one row: the first partial with the best score
    # wins (vocabulary order: ties go to the lowest index), and the log-normaliser merges the
    # partials' (max, sum exp) pairs.
    _after_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, P_P)
    jm = j < P
    base = parts_ptr + (r * P + j) * 5
    best = tl.load(base, mask=jm, other=float("-inf"))
    win = tl.min(tl.where(jm & (best == tl.max(best, 0)), j, P_P), 0)
    token = tl.load(parts_ptr + (r * P + win) * 5 + 1).to(tl.int32, bitcast=True)
    s_win = tl.load(parts_ptr + (r * P + win) * 5 + 2)
    m = tl.load(base + 3, mask=jm, other=float("-inf"))
    z = tl.load(base + 4, mask=jm, other=0.0)
    mmax = tl.max(m, 0)
    lse = mmax + tl.log(tl.sum(z * tl.exp(m - mmax), 0))
    tl.store(tokens_ptr + r, token.to(tl.int64))
    tl.store(logprobs_ptr + r, s_win - lse)


# ---------------------------------------------------------------------------- a graphed step's I/O


@triton.jit
def _step_inputs_kernel(src_ptr, parity_ptr, dst_ptr, half_stride, src_stride, dst_stride, rows,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Input vector `program_id` (slots, positions or keys) of the half of `src` that the device's
    # parity names, into the step's device inputs; `src` is pinned host memory, read over the bus.
    _after_previous(PDL)
    v = tl.program_id(0).to(tl.int64)
    half = tl.load(parity_ptr).to(tl.int64)
    for c0 in range(0, rows, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < rows
        x = tl.load(src_ptr + half * half_stride + v * src_stride + c, mask=m)
        tl.store(dst_ptr + v * dst_stride + c, x, mask=m)


@triton.jit
def _step_outputs_kernel(tok_ptr, lp_ptr, parity_ptr, tok_dst_ptr, lp_dst_ptr, tok_half_stride, lp_half_stride,
                         rows, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # The step's sampled tokens and log-probs into the half of the pinned result buffers that
    # the device's parity names (written over the bus; the host reads them after the step's event).
    _after_previous(PDL)
    half = tl.load(parity_ptr).to(tl.int64)
    for c0 in range(0, rows, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < rows
        tl.store(tok_dst_ptr + half * tok_half_stride + c, tl.load(tok_ptr + c, mask=m), mask=m)
        tl.store(lp_dst_ptr + half * lp_half_stride + c, tl.load(lp_ptr + c, mask=m), mask=m)


# ---------------------------------------------------------------------------- launchers

# Kernels that must round like PyTorch's unfused ops (RoPE; the sampler's scaled logits,
# which the top-k / top-p threshold is compared against) are compiled without FMA
# contraction: fused, `x1 * cos - x2 * sin` skips the rounding of `x1 * cos` that torch does.
_NO_FMA = {"enable_fp_fusion": False}


# Weight rows per program, columns per step, warps: the best total over qwen2.5-0.5b's and 7b's
# projections of 16 blockings, timed as chains of PDL launches in a CUDA graph on an H200
# (docs/results/gemv_sweep_pdl_h200.json). Few rows per program keep every SM streaming at
# 0.5b's shapes (896 output features: 224 programs, against 56 with 16 rows).
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 4, 1024, 4


SILU_FP8_WHOLE_ROW = 16384  # lanes: up to this row width `silu_and_mul_fp8` holds the row in registers


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def head_lanes(head_dim: int) -> int:
    """The lanes of a head in the RoPE and attention kernels: a Triton tile's width is a power of two
    and `tl.dot` reduces over at least 16, so a head_dim that is neither (80, 96, 100; 8) is padded,
    the lanes past it masked (equal to head_dim otherwise: the masks are then always true)."""
    return max(16, _pow2(head_dim))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.type == "cuda" and device.index is not None else 0)


PDL_ENV = "MESHPPO_PDL"


@functools.lru_cache(maxsize=None)
def _pdl_device(device_index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def _launch(t: torch.Tensor) -> dict:
    """Launch arguments of a kernel working on `t`: programmatic dependent launch (each kernel's
    prologue overlaps the previous kernel's end; `_after_previous` keeps the order) on CUDA
    devices of compute capability 9.0 and later, unless `MESHPPO_PDL=off` (for a driver that
    cannot capture such launches in a CUDA graph, or to rule PDL out while debugging)."""
    choice = os.environ.get(PDL_ENV, "auto")
    if choice not in ("auto", "off"):
        raise ValueError(f"{PDL_ENV} must be auto or off, got {choice!r}")
    pdl = choice == "auto" and t.is_cuda and _pdl_device(
        t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": pdl, "launch_pdl": pdl}


# The columns of a row OLMo-2's q / k norm kernels read at a time (a loop over the projection's width, up to 5,120
# for OLMo-2-32B's q at TP 1).
QK_SUMS_BLOCK = 1024


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] == 1 and x.shape[-1] == weight.shape[1] and x.is_contiguous() and weight.stride(1) == 1


def _gemv(x, weight, bias, gated: bool, act: str = "silu"):
    n, k = weight.shape
    if gated:
        n //= 2
    y = torch.empty(1, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    features = GEMV_BLOCK_N // 2 if gated else GEMV_BLOCK_N  # per program: a gated one reads 2 rows a feature
    _gemv_kernel[(triton.cdiv(n, features),)](x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
                                            HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=GEMV_BLOCK_N,
                                            BLOCK_K=GEMV_BLOCK_K, GELU=act == "gelu_tanh", num_warps=GEMV_WARPS,
                                            **_launch(x))
    return y


def _kv_scales(k_scale, v_scale, k_cache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale pointers: an e4m3 cache's `k_scale`, `v_scale` (both or neither), else the cache (unread).
    `dtype`: the model's (`rollout.config.KV_FP8_DTYPES` with an e4m3 cache)."""
    if k_scale is None and v_scale is None:
        return k_cache, k_cache
    if k_scale is None or v_scale is None or k_cache.dtype != FP8 or dtype not in KV_FP8_DTYPES:
        raise ValueError(f"an e4m3 KV cache needs k_scale and v_scale, an e4m3 cache and a model dtype in "
                         f"{KV_FP8_DTYPES}; got a {k_cache.dtype} cache, {dtype}")
    return k_scale, v_scale


class TritonOps:
    name = "triton"

    @staticmethod
    def linear(x, weight, bias=None):
        # One row: cuBLAS reached 1.6-3.4 TB/s on qwen2.5-7b's projections at batch 1 on an H200,
        # this kernel 1.9-3.7 (BENCHMARKS.md, "Sixth pass"); with 4 rows cuBLAS won.
        if not _gemv_fits(x, weight):
            return F.linear(x, weight, bias)
        return _gemv(x, weight, bias, gated=False)

    @staticmethod
    def gated_linear(x, weight, bias=None, act: str = "silu"):
        if not _gemv_fits(x, weight):
            return TritonOps.silu_and_mul(F.linear(x, weight, bias), act)
        return _gemv(x, weight, bias, gated=True, act=act)

    @staticmethod
    def rms_norm(x, weight, eps: float, residual=None, x_scale=None, out_dtype=None, scale: float = 1.0,
                 unit_offset: bool = False):
        parts = x.shape[0] if x.dim() == 3 else 0  # split-K products (`rollout.ops.split_k_products`), summed here
        if (parts or x_scale is not None or scale != 1.0) and residual is None:
            raise ValueError("rms_norm of split-K products or scaled rows needs the residual (its dtype is the sum's)")
        t, n = x.shape[-2:]
        block = _pow2(n)
        res = residual if residual is not None else x
        out = torch.empty(t, n, dtype=out_dtype or res.dtype, device=x.device)
        if t == 0:
            return out, res
        _rms_norm_kernel[(t,)](x, res, weight, out, x_scale if x_scale is not None else weight,
                               x.stride(0) if parts else 0, x.stride(-2), res.stride(0), out.stride(0), n, eps,
                               float(scale), PARTS=parts, HAS_RES=residual is not None, X_SCALE=x_scale is not None,
                               BLOCK=block, OFFSET=unit_offset, num_warps=4 if block <= 1024 else 8, **_launch(res))
        return out, res  # the residual sum is written into `residual` in place

    @staticmethod
    def qk_norm(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                unit_offset: bool = False):
        t = qkv.shape[0]
        if t:
            heads = num_heads + num_kv_heads
            block = _pow2(heads) * _pow2(head_dim)
            _qk_norm_kernel[(t,)](qkv, q_weight, k_weight, qkv.stride(0), num_heads, heads, head_dim, eps,
                                  HEADS_P=_pow2(heads), BLOCK=_pow2(head_dim), OFFSET=unit_offset,
                                  num_warps=4 if block <= 4096 else 8, **_launch(qkv))
        return qkv

    @staticmethod
    def post_norm_add(x, weight, eps: float, residual, unit_offset: bool = False):
        t, n = x.shape
        if t:
            block = _pow2(n)
            _post_norm_add_kernel[(t,)](x, residual, weight, x.stride(0), residual.stride(0), n, eps, BLOCK=block,
                                        OFFSET=unit_offset, num_warps=4 if block <= 1024 else 8, **_launch(x))
        return residual  # the sum is written into `residual` in place

    @staticmethod
    def qk_square_sums(qkv, q_width: int, k_width: int):
        t = qkv.shape[0]
        out = torch.empty(t, 2, dtype=torch.float32, device=qkv.device)
        if t:
            _qk_square_sums_kernel[(t,)](qkv, out, qkv.stride(0), q_width, k_width, BLOCK=QK_SUMS_BLOCK, num_warps=4,
                                         **_launch(qkv))
        return out

    @staticmethod
    def full_qk_norm(qkv, q_weight, k_weight, sums, widths: tuple[int, int], eps: float):
        t, start = qkv.shape[0], 0
        for j, weight in enumerate((q_weight, k_weight)):
            if t:
                _norm_by_sums_kernel[(t,)](qkv[:, start:], weight, sums, qkv.stride(0), weight.shape[0], j,
                                           float(widths[j]), eps, BLOCK=QK_SUMS_BLOCK, num_warps=4, **_launch(qkv))
            start += weight.shape[0]
        return qkv

    @staticmethod
    def silu_and_mul(gate_up, act: str = "silu"):
        t, n2 = gate_up.shape
        n = n2 // 2
        out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
        if t:
            block = min(1024, _pow2(n))
            _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                         BLOCK=block, GELU=act == "gelu_tanh", num_warps=4,
                                                         **_launch(gate_up))
        return out

    @staticmethod
    def silu_and_mul_fp8(gate_up):
        t, n2 = gate_up.shape
        n = n2 // 2
        out = torch.empty(t, n, dtype=FP8, device=gate_up.device)
        scale = torch.empty(t, dtype=torch.float32, device=gate_up.device)
        if t:
            whole = _pow2(n) <= SILU_FP8_WHOLE_ROW  # e.g. 1.5b's 8,960 (16,384 lanes); 7b's 18,944 takes two passes
            block = _pow2(n) if whole else 2048
            _silu_mul_fp8_kernel[(t,)](gate_up, out, scale, gate_up.stride(0), out.stride(0), n, FP8_MAX=FP8_MAX,
                                       FP8_TINY=FP8_TINY, BLOCK=block, WHOLE_ROW=whole,
                                       num_warps=max(4, min(16, block // 1024)), **_launch(gate_up))
        return out, scale

    scaled_linear = staticmethod(scaled_linear)

    @staticmethod
    def rope_and_cache(qkv, positions, token_slots, cos, sin, k_cache, v_cache, block_tables,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_scale=None, v_scale=None):
        t = qkv.shape[0]
        if t:
            _rope_cache_kernel[(t,)](qkv, qkv.stride(0), positions, token_slots, block_tables, block_tables.stride(0),
                                     cos, sin, k_cache, v_cache, *_kv_scales(k_scale, v_scale, k_cache, cos.dtype),
                                     PAGE=k_cache.shape[1], HQ=num_heads, HKV=num_kv_heads, D=head_dim,
                                     D_P=head_lanes(head_dim), HQ_P=_pow2(num_heads), HKV_P=_pow2(num_kv_heads),
                                     KV_FP8=k_scale is not None, FP8_MAX=FP8_MAX, FP8_TINY=FP8_TINY,
                                     num_warps=4 if num_heads * head_dim >= 2048 else 2, **_NO_FMA,
                                     **_launch(qkv))
        return qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)

    @staticmethod
    def decode_attention(qkv, positions, cos, sin, k_cache, v_cache, block_tables, meta: AttentionMetadata,
                         scale: float, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias=None,
                         k_scale=None, v_scale=None, window: int | None = None, softcap: float | None = None):
        parts = qkv.shape[0] if qkv.dim() == 3 else 0  # split-K products (`rollout.ops.split_k_products`), summed in the kernel
        b = qkv.shape[-2]
        hq, hkv, d = num_heads, num_kv_heads, head_dim
        d_p = head_lanes(d)
        g = hq // hkv
        splits = meta.num_splits
        out = torch.empty(b, hq * d, dtype=cos.dtype, device=qkv.device)  # the model dtype
        if b == 0:
            return out
        # RoPE and the K/V write inside the attention kernel when a sequence has one split (many
        # rows): with several, each split's program would rotate the queries again, and on an
        # H200 a one-sequence step (16 splits) ran 3 % slower fused (BENCHMARKS.md, "Ninth pass").
        rope = splits == 1  # fused, the kernel takes each token's position as context_lens - 1 (= positions)
        if parts and not rope:
            raise ValueError("decode attention takes split-K qkv products only with one split a sequence")
        if not rope:
            TritonOps.rope_and_cache(qkv, positions, meta.slots, cos, sin, k_cache, v_cache, block_tables, hq, hkv, d,
                                     k_scale, v_scale)
        # keys a tile; with an e4m3 cache too (16, 64 and 128 were slower at 1.5b: BENCHMARKS.md, "Nineteenth pass")
        block_n = 64 if d_p <= 64 else 32
        if splits > 1:
            part_o = torch.empty(b, hq, splits, d, dtype=torch.float32, device=qkv.device)
            part_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=qkv.device)
        else:
            part_o = part_lse = out  # unused
        _decode_attn_kernel[(b, hkv, splits)](
            qkv, qkv.stride(-2), qkv.stride(0) if parts else 0, qkv_bias if qkv_bias is not None else qkv, cos, sin,
            k_cache, v_cache, *_kv_scales(k_scale, v_scale, k_cache, cos.dtype), block_tables, block_tables.stride(0), meta.slots,
            meta.context_lens, out, out.stride(0), part_o, part_lse, scale * 1.4426950408889634, splits, window or 0,
            HQ=hq, HKV=hkv, G=g, BLOCK_G=max(16, _pow2(g)), D=d, D_P=d_p, PAGE=k_cache.shape[1], BLOCK_N=block_n,
            SPLIT=splits > 1, ROPE=rope, PARTS=parts, HAS_BIAS=parts > 0 and qkv_bias is not None,
            KV_FP8=k_scale is not None, FP8_MAX=FP8_MAX, FP8_TINY=FP8_TINY,
            IEEE=cos.dtype == torch.float32, SOFTCAP=float(softcap or 0.0), num_warps=4, **(_NO_FMA if rope else {}),
            **_launch(qkv))
        if splits > 1:
            _decode_reduce_kernel[(b, hq)](part_o, part_lse, out, out.stride(0), splits, HQ=hq, D=d, D_P=d_p,
                                           S_P=_pow2(splits), num_warps=4 if d_p >= 128 else 2,
                                           **_launch(qkv))
        return out

    @staticmethod
    def prefill_attention(q, k_cache, v_cache, block_tables, meta: AttentionMetadata, scale: float,
                          k_scale=None, v_scale=None, window: int | None = None, softcap: float | None = None):
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
        num_tiles = meta.tile_seq.shape[0]
        if num_tiles == 0:
            return out
        fp32 = q.dtype == torch.float32
        d_p = head_lanes(d)
        block_n = 32 if fp32 and d_p > 64 else 64
        _prefill_attn_kernel[(num_tiles, hq)](
            q, q.stride(0), k_cache, v_cache, *_kv_scales(k_scale, v_scale, k_cache, q.dtype), block_tables,
            block_tables.stride(0), out, out.stride(0),
            meta.cu_q, meta.context_lens, meta.slots, meta.tile_seq, meta.tile_start, scale * 1.4426950408889634,
            window or 0, HKV=hkv, G=hq // hkv, BLOCK_G=max(16, _pow2(hq // hkv)), D=d, D_P=d_p, PAGE=k_cache.shape[1],
            BLOCK_M=PREFILL_TILE, BLOCK_N=block_n, KV_FP8=k_scale is not None, IEEE=fp32,
            SOFTCAP=float(softcap or 0.0), num_warps=4, **_launch(q))
        return out

    @staticmethod
    def combine_partials(parts, out=None):
        r, p, _ = parts.shape
        tokens, logprobs = out if out is not None else (
            torch.empty(r, dtype=torch.int64, device=parts.device), torch.empty(r, dtype=torch.float32, device=parts.device))
        if r:
            _combine_kernel[(r,)](parts.contiguous(), p, tokens, logprobs, P_P=_pow2(p), num_warps=4 if p > 256 else 1,
                                  **_launch(parts))
        return tokens, logprobs

    @staticmethod
    def step_inputs(src, parity, dst, rows: int):
        v = dst.shape[0]
        if rows:
            _step_inputs_kernel[(v,)](src, parity, dst, src.stride(0), src.stride(1), dst.stride(0), rows,
                                      BLOCK=min(1024, _pow2(rows)), num_warps=4, **_launch(dst))
        return dst

    @staticmethod
    def step_outputs(tokens, logprobs, parity, tok_dst, lp_dst, rows: int):
        if rows:
            _step_outputs_kernel[(1,)](tokens, logprobs, parity, tok_dst, lp_dst, tok_dst.stride(0), lp_dst.stride(0),
                                       rows, BLOCK=min(1024, _pow2(rows)), num_warps=4, **_launch(tokens))

    @staticmethod
    def sample_partials(logits, keys, positions, inv_temp, noise_scale, thresh, vocab_start: int, num_splits: int,
                        group: int = 1, softcap: float | None = None):
        r, v = logits.shape
        block = max(1024 if v >= 1024 else _pow2(v), group)
        per_split = triton.cdiv(triton.cdiv(v, num_splits), block) * block
        parts = torch.empty(r, num_splits, 5, dtype=torch.float32, device=logits.device)
        if r:
            _sample_kernel[(r, num_splits)](
                logits, logits.stride(0), keys.contiguous(), positions.contiguous(),
                thresh.contiguous() if thresh is not None else inv_temp,
                inv_temp, noise_scale, parts, v, vocab_start, per_split, num_splits,
                HAS_THRESH=thresh is not None, FAST_LOG=logits.is_cuda and libdevice is not None, BLOCK=block,
                GROUP=group, SOFTCAP=float(softcap or 0.0), num_warps=4, **_NO_FMA, **_launch(logits))
        return parts
