"""Triton kernels of the chunked LM head (`models/lm_head.py`); CUDA, or CPU under `TRITON_INTERPRET=1`.

Each kernel reads one chunk of logits `z [C, V]` in the matmul dtype once, with fp32
arithmetic, where PyTorch would make a dozen fp32 passes over `[C, V]`
(cast, temperature, log-sum-exp, gather, softmax, products, scatter, cast back):

* `logit_stats`: per row of x = cap(z) * inv_temp (`SOFTCAP`: cap·tanh(z / cap), Gemma 2's
  final_logit_softcapping, a constexpr: 0 compiles the uncapped kernel), the log-sum-exp, x[label] - lse and, if asked,
  the entropy lse - sum(softmax(x) * x) and the sum of squared probabilities
  sum exp(2(x - m)) / (sum exp(x - m))^2. One program per row, online (rescaled) sums over
  vocabulary tiles.
* `logit_grad_`: d(g_logp * logp + g_ent * ent) / dz, written over the logits it reads (with a
  cap, times d cap(z) / dz = 1 - tanh²(z / cap)). Purely elementwise given the row statistics: one
  program per (row, vocabulary tile).

Imported only when `models.lm_head` takes the Triton path, so triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.block_triton import soft_cap, tanh

# 8 KB of bf16 logits per tile; 8 warps give each thread 16 elements: wide loads, few registers.
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _logit_stats_kernel(z_ptr, stride_z, labels_ptr, lse_ptr, logp_ptr, ent_ptr, sps_ptr, V, inv_temp,
                        WITH_ENTROPY: tl.constexpr, WITH_SPS: tl.constexpr, BLOCK_V: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride_z exceeds int32 for 16k rows of a 150k vocabulary
    z_row = z_ptr + row * stride_z
    m = tl.full([], float("-inf"), tl.float32)  # running max of x
    s = tl.zeros([BLOCK_V], tl.float32)  # per lane: sum of exp(x - m)
    t = tl.zeros([BLOCK_V], tl.float32)  # per lane: sum of exp(x - m) * x
    q = tl.zeros([BLOCK_V], tl.float32)  # per lane: sum of exp(x - m)^2 (<= s: no overflow)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, soft_cap(x, SOFTCAP) * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        s = s * alpha + e
        if WITH_ENTROPY:
            t = t * alpha + tl.where(mask, e * x, 0.0)  # the tail's x is -inf, and 0 * -inf is NaN
        if WITH_SPS:
            q = q * (alpha * alpha) + e * e
        m = m_new
    s_row = tl.sum(s, axis=0)
    lse = m + tl.log(s_row)
    x_label = soft_cap(tl.load(z_row + tl.load(labels_ptr + row)).to(tl.float32), SOFTCAP) * inv_temp
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, x_label - lse)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, lse - tl.sum(t, axis=0) / s_row)
    if WITH_SPS:
        tl.store(sps_ptr + row, tl.sum(q, axis=0) / (s_row * s_row))


@triton.jit
def _logit_grad_kernel(z_ptr, stride_z, labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr, V, inv_temp,
                       WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    ptrs = z_ptr + row * stride_z + cols
    z = tl.load(ptrs, mask=mask, other=0.0)
    zf = z.to(tl.float32)
    x = soft_cap(zf, SOFTCAP) * inv_temp
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(g_logp_ptr + row)
    p = tl.exp(x - lse)
    dx = tl.where(cols == tl.load(labels_ptr + row), g_logp, 0.0) - g_logp * p
    if WITH_ENTROPY:
        dx -= tl.load(g_ent_ptr + row) * p * (x - lse + tl.load(ent_ptr + row))
    dx *= inv_temp
    if SOFTCAP > 0:
        t = tanh(zf / SOFTCAP)
        dx *= 1.0 - t * t
    tl.store(ptrs, dx.to(z.dtype), mask=mask)


def _check_rows(logits, *vectors):
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [C, V] with contiguous rows"
    for v in vectors:
        assert v.shape == logits.shape[:1] and v.is_contiguous() and v.dtype == torch.float32, v


def logit_stats(logits, labels, inv_temp: float, lse, logp, ent=None, sps=None, softcap: float | None = None,
                block_v: int = BLOCK_V):
    """Row statistics of x = cap(logits) * inv_temp (`softcap`: cap·tanh(logits / cap); None: the logits) into
    float32 `[C]` buffers: `lse`, `logp`
    (x[label] - lse), unless `ent` is None the entropy lse - sum(softmax(x) * x), and unless
    `sps` is None sum(softmax(x)^2). logits `[C, V]`, labels `[C]` (int64, valid ids)."""
    _check_rows(logits, lse, logp, *(b for b in (ent, sps) if b is not None))
    c, v = logits.shape
    if c:
        _logit_stats_kernel[(c,)](logits, logits.stride(0), labels.contiguous(), lse, logp,
                                  lse if ent is None else ent, lse if sps is None else sps, v, float(inv_temp),
                                  WITH_ENTROPY=ent is not None, WITH_SPS=sps is not None, BLOCK_V=block_v,
                                  SOFTCAP=float(softcap or 0.0), num_warps=NUM_WARPS)


def logit_grad_(logits, labels, inv_temp: float, lse, grad_logp, ent=None, grad_ent=None,
                softcap: float | None = None, block_v: int = BLOCK_V):
    """Overwrite `logits [C, V]` with the gradient of sum(grad_logp * logp + grad_ent * ent)
    with respect to them, given the forward's `lse` (and `ent`); returns `logits`. With
    x = cap(logits) * inv_temp, p = exp(x - lse):
        dz = inv_temp * (grad_logp * (onehot(label) - p) - grad_ent * p * (x - lse + ent)) * cap'(logits)
    (the entropy term only when `grad_ent` is given; cap' = 1 - tanh²(logits / cap) with a `softcap`, else 1)."""
    with_entropy = grad_ent is not None
    grad_logp = grad_logp.float().contiguous()  # the grad of a summed output is an expanded (stride 0) tensor
    if with_entropy:
        grad_ent = grad_ent.float().contiguous()
    _check_rows(logits, lse, grad_logp, *([ent, grad_ent] if with_entropy else []))
    c, v = logits.shape
    if c:
        _logit_grad_kernel[(c, triton.cdiv(v, block_v))](
            logits, logits.stride(0), labels.contiguous(), lse, ent if with_entropy else lse, grad_logp,
            grad_ent if with_entropy else lse, v, float(inv_temp),
            WITH_ENTROPY=with_entropy, BLOCK_V=block_v, SOFTCAP=float(softcap or 0.0), num_warps=NUM_WARPS)
    return logits
