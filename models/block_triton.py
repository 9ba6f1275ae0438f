"""Triton kernels of a transformer block's elementwise parts; CUDA, or CPU under `TRITON_INTERPRET=1`.

Eager PyTorch spends a handful of kernels (and as many autograd nodes) on each of a block's
RMSNorms, its SwiGLU and its RoPE; at small hidden sizes the update is then bound by the
host. Here each is one kernel forward and one backward (`models/block_ops.py` wraps them in
autograd Functions):

* `rms_norm_fwd` / `rms_norm_bwd`: one program per row forward, saving the row's rstd; the
  backward gives dx per row and dweight as per-program float32 partial sums over runs of
  rows, which torch adds up (deterministic: no atomics). `OFFSET` (Gemma 3's norm): times
  `1 + weight`, in float32, rounded once.
* `swiglu_fwd` / `swiglu_bwd`: `silu(gate) * up` and its two gradients, flat over elements;
  the backward recomputes silu from the saved gate and up, and can write the forward's output
  again on the way (for a down projection that did not keep it). `GELU` (Gemma 3's GeGLU): the
  tanh-approximated GELU of the gate instead of silu.
* `rope`: rotate-half RoPE of q and k in one launch, one program per token; the backward is
  the same kernel rotating by -sin.

The forwards round where `models.transformer`'s eager code rounds (the normalised row to the
input dtype before the weight, silu to the input dtype before the product, each RoPE product
to the input dtype), so they give its values up to float32 rounding (the order of sums, the
GPU's exp); RoPE, which has neither, gives them bit for bit. The backwards keep float32 until
their outputs, where autograd rounds each intermediate gradient to the input dtype.

The jit helpers `rms_norm_row`, `silu_mul` and `rotate_half` are also the arithmetic of the
engine's forward kernels (`rollout/triton_kernels.py`): one definition of each rounding; `soft_cap` (Gemma 2's
tanh soft cap of scores and logits) is the engine's attention kernels' and the LM head's (`models/lm_head_triton.py`).

Imported only where Triton runs (`models.block_ops`'s Triton path, the engine's kernels), so
triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# RoPE is compiled without FMA contraction: fused, `x1 * cos - x2 * sin` would skip the
# rounding of `x1 * cos` that torch does (in float32 too).
_NO_FMA = {"enable_fp_fusion": False}
SWIGLU_BLOCK = 1024
# The RMSNorm backward's programs: ~8 per SM of an H200 (132 SMs), and a float32 partial
# dweight buffer of at most that many rows.
RMS_BWD_PROGRAMS = 1024

# ---------------------------------------------------------------------------- shared arithmetic


@triton.jit
def rms_norm_row(x, N, eps):
    """(x normalised in float32 and rounded to x's dtype, the row's rstd) for one row `x [BLOCK]`
    whose lanes past `N` hold zeros. The rounding before the weight is Hugging Face's."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    return (xf * rstd).to(x.dtype), rstd


@triton.jit
def _silu(gf):
    return gf / (1.0 + tl.exp(-gf))


@triton.jit
def silu_mul(g, u):
    """`F.silu(g) * u` as torch rounds it: silu in float32, rounded to u's dtype, times u."""
    s = _silu(g.to(tl.float32)).to(u.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)


# The tanh-approximated GELU, `0.5 g (1 + tanh(k (g + c g^3)))` with k = sqrt(2 / pi), c = 0.044715, written as
# `g * sigmoid(2 k (g + c g^3))` (the same function: 1 + tanh(z) = 2 sigmoid(2 z)); 1.5957691216057308 is 2 k.


@triton.jit
def _gelu_tanh(gf):
    return gf / (1.0 + tl.exp(-1.5957691216057308 * (gf + 0.044715 * gf * gf * gf)))


@triton.jit
def _gelu_tanh_grad(gf):
    """d gelu_tanh / dg at float32 `gf`: sig + g sig (1 - sig) 2 k (1 + 3 c g^2), sig the sigmoid above."""
    sig = 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (gf + 0.044715 * gf * gf * gf)))
    return sig + gf * sig * (1.0 - sig) * 1.5957691216057308 * (1.0 + 0.134145 * gf * gf)


@triton.jit
def tanh(x):
    """tanh of float32 `x` as `1 - 2 / (exp(2x) + 1)` (the interpreter has no libdevice): exact limits at +-inf
    (exp overflowing to inf gives 1, underflowing to 0 gives -1), within a few float32 ulps of 1 elsewhere."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def soft_cap(x, CAP: tl.constexpr):
    """`CAP·tanh(x / CAP)` of float32 `x` (`models.attention.soft_cap`); `x` itself where CAP is 0 (none)."""
    if CAP > 0:
        return tanh(x / CAP) * CAP
    return x


@triton.jit
def act_mul(g, u, GELU: tl.constexpr):
    """`act(g) * u` as torch rounds it (act in float32, rounded to u's dtype, times u): `silu_mul`, or with
    `GELU` the tanh-approximated GELU (`F.gelu(g, approximate="tanh")`, Gemma 3's GeGLU)."""
    if GELU:
        s = _gelu_tanh(g.to(tl.float32)).to(u.dtype)
        return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    return silu_mul(g, u)


@triton.jit
def rotate_half(x1, x2, c1, s1, c2, s2):
    """`x * cos + cat([-x2, x1]) * sin` on the halves (x1, x2) of the head dim, with the
    halves (c1, c2), (s1, s2) of cos and sin (float32): (x1 c1 - x2 s1, x2 c2 + x1 s2), each
    product rounded to x's dtype as torch does. Launch without FMA contraction."""
    dt = x1.dtype
    a = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b = (x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    e = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    f = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    return (a - b).to(dt), (e + f).to(dt)


# ---------------------------------------------------------------------------- RMSNorm


@triton.jit
def unit_offset_norm_row(x, w, N, eps):
    """(x normalised in float32 times `1 + w`, the row's rstd) for one row `x [BLOCK]` (lanes past `N` zeros)
    and float32 `w`: Gemma 3's norm (transformers' Gemma3RMSNorm), not rounded before the weight."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    return xf * rstd * (1.0 + w), rstd


@triton.jit
def weighted_norm_row(x, w, N, eps, OFFSET: tl.constexpr):
    """(x RMS-normalised times its float32 weight `w`, in float32, the row's rstd) for one row `x [BLOCK]` (lanes past
    `N` zeros): Hugging Face's norm (`rms_norm_row`, rounded to x's dtype, then times w) or, `OFFSET`, Gemma 3's
    (`unit_offset_norm_row`: times 1 + w, not rounded before it)."""
    if OFFSET:
        out, rstd = unit_offset_norm_row(x, w, N, eps)
    else:
        y, rstd = rms_norm_row(x, N, eps)
        out = y.to(tl.float32) * w
    return out, rstd


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, N, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out, rstd = weighted_norm_row(x, w, N, eps, OFFSET)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


# Row counts vary with every micro-batch: specialising on them (divisible by 16, equal to 1)
# would compile another variant in the middle of a run; they are only loop bounds.
@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dout_ptr, dx_ptr, dw_part_ptr, n_rows, N, rows_per_program,
                         WITH_DW: tl.constexpr, BLOCK: tl.constexpr, OFFSET: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # out = (1 + w) * n, n unrounded
        w = tl.where(mask, 1.0 + w, 0.0)
    dw = tl.zeros([BLOCK], tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # int64 row offsets: rows * N may pass 2**31
    for r in range(start, tl.minimum(start + rows_per_program, n_rows)):
        offs = r * N + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        dy = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r)
        n = x.to(tl.float32) * rstd
        # out = w * y with y = n rounded: d/dn (straight through the rounding) is g = dy * w,
        # and d/dx of n = x * rstd(x) is rstd * (g - n * mean(g * n)).
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WITH_DW and OFFSET:
            dw += dy * n  # the unrounded normalised row the forward multiplied
        elif WITH_DW:
            dw += dy * n.to(x.dtype).to(tl.float32)  # the rounded y the forward multiplied
    if WITH_DW:
        tl.store(dw_part_ptr + pid * N + cols, dw, mask=mask)


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8


def rms_norm_fwd(x, weight, eps: float, unit_offset: bool = False):
    """RMSNorm of the rows of `x [..., N]` (contiguous; rows = every leading dim) times
    `weight [N]`: (out, x's shape in the promoted dtype of x and weight as `weight * y` gives
    it; rstd `[rows]` float32). `unit_offset` (Gemma 3's): times `1 + weight` in float32, rounded
    once to x's dtype."""
    n = x.shape[-1]
    r = x.numel() // n if n else 0
    dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rstd = torch.empty(r, dtype=torch.float32, device=x.device)
    if r:
        block = triton.next_power_of_2(n)
        _rms_norm_fwd_kernel[(r,)](x, weight, out, rstd, n, float(eps), BLOCK=block, OFFSET=unit_offset,
                                   num_warps=_norm_warps(block))
    return out, rstd


def rms_norm_bwd(x, weight, rstd, dout, with_dw: bool = True, programs: int = RMS_BWD_PROGRAMS,
                 unit_offset: bool = False):
    """Gradients of `rms_norm_fwd` (with its `unit_offset`) for the output gradient `dout` (x's shape,
    contiguous): (dx in x's dtype, dweight `[N]` in weight's dtype, summed over rows in float32, or None
    unless `with_dw`). `programs` caps the launch, each program taking a run of rows."""
    n = x.shape[-1]
    r = rstd.numel()
    dx = torch.empty_like(x)
    if not r:  # no rows, no program: dweight is an empty sum, zeros (as eager's)
        return dx, (torch.zeros_like(weight) if with_dw else None)
    grid = min(r, programs)
    rows_per_program = triton.cdiv(r, grid)
    grid = triton.cdiv(r, rows_per_program)
    # one float32 row per program, each written whole by its program
    dw_part = torch.empty(grid if with_dw else 1, n, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_bwd_kernel[(grid,)](x, weight, rstd, dout, dx, dw_part, r, n, rows_per_program,
                                  WITH_DW=with_dw, BLOCK=block, OFFSET=unit_offset, num_warps=_norm_warps(block))
    return dx, (dw_part.sum(0).to(weight.dtype) if with_dw else None)


# ---------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, numel, BLOCK: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, act_mul(g, u, GELU), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, dout_ptr, dg_ptr, du_ptr, out_ptr, numel, BLOCK: tl.constexpr,
                       WITH_OUT: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    dy = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        s = _gelu_tanh(g).to(u.dtype)  # the rounded GELU the forward multiplied
        ds = _gelu_tanh_grad(g)
    else:
        sig = 1.0 / (1.0 + tl.exp(-g))
        s = _silu(g).to(u.dtype)  # the rounded silu the forward multiplied
        ds = sig * (1.0 + g * (1.0 - sig))  # d silu / dg
    tl.store(dg_ptr + offs, (dy * u.to(tl.float32) * ds).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * s.to(tl.float32)).to(du_ptr.dtype.element_ty), mask=mask)
    if WITH_OUT:  # the forward's output again, rounded as `silu_mul` rounds it: the same bits
        tl.store(out_ptr + offs, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)


def swiglu_fwd(gate, up, act: str = "silu"):
    """`silu(gate) * up` of two contiguous tensors of one shape and dtype (`act` "gelu_tanh": the
    tanh-approximated GELU of the gate, Gemma 3's GeGLU)."""
    out = torch.empty_like(up)
    n = up.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](gate, up, out, n, BLOCK=SWIGLU_BLOCK,
                                                            GELU=act == "gelu_tanh", num_warps=4)
    return out


def swiglu_bwd(gate, up, dout, with_out: bool = False, act: str = "silu"):
    """(dgate, dup) of `swiglu_fwd` (with its `act`) for the output gradient `dout` (contiguous, same
    shape); with `with_out`, (dgate, dup, out): `swiglu_fwd(gate, up, act)` too, bit for bit, from the
    same reads."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    out = torch.empty_like(up) if with_out else None
    n = up.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](gate, up, dout, dg, du, out if with_out else du, n,
                                                            BLOCK=SWIGLU_BLOCK, WITH_OUT=with_out,
                                                            GELU=act == "gelu_tanh", num_warps=4)
    return (dg, du, out) if with_out else (dg, du)


# ---------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_heads(x_ptr, out_ptr, c1, s1, c2, s2, i, im, H: tl.constexpr, H_P: tl.constexpr,
                D: tl.constexpr, HALF: tl.constexpr):
    """Rotate the `H` heads `[H, D]` of one token at `x_ptr` into `out_ptr`."""
    h = tl.arange(0, H_P)[:, None]
    m = (h < H) & im[None, :]
    p = h * D + i[None, :]
    o1, o2 = rotate_half(tl.load(x_ptr + p, mask=m), tl.load(x_ptr + p + HALF, mask=m), c1, s1, c2, s2)
    tl.store(out_ptr + p, o1, mask=m)
    tl.store(out_ptr + p + HALF, o2, mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                 HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HQ_P: tl.constexpr,
                 HKV_P: tl.constexpr, HALF_P: tl.constexpr, BACKWARD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF_P)
    im = i < HALF
    cs = cos_ptr + t * D + i
    ss = sin_ptr + t * D + i
    c1 = tl.load(cs, mask=im, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cs + HALF, mask=im, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(ss, mask=im, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(ss + HALF, mask=im, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        # The transpose of the rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1, which is
        # the forward's formula with (s1, s2) -> (-s2, -s1).
        s1, s2 = -s2, -s1
    _rope_heads(q_ptr + t * (HQ * D), q_out_ptr + t * (HQ * D), c1, s1, c2, s2, i, im, HQ, HQ_P, D, HALF)
    _rope_heads(k_ptr + t * (HKV * D), k_out_ptr + t * (HKV * D), c1, s1, c2, s2, i, im, HKV, HKV_P, D, HALF)


def rope(q, k, cos, sin, backward: bool = False):
    """Rotate-half RoPE of `q [..., Hq, D]` and `k [..., Hkv, D]` with `cos, sin [..., D]` (the
    same leading dims, one row per token), all contiguous and of one dtype, into new tensors
    (q', k'); `backward` applies the transposed rotation (by -sin), which maps the outputs'
    gradients to the inputs'."""
    hq, d = q.shape[-2:]
    hkv = k.shape[-2]
    t = q.numel() // (hq * d)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if t:
        _rope_kernel[(t,)](q, k, cos, sin, q_out, k_out, HQ=hq, HKV=hkv, D=d, HQ_P=triton.next_power_of_2(hq),
                           HKV_P=triton.next_power_of_2(hkv), HALF_P=triton.next_power_of_2(d // 2),
                           BACKWARD=backward, num_warps=4 if hq * d >= 2048 else 2, **_NO_FMA)
    return q_out, k_out
