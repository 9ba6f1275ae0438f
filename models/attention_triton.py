"""A FlashAttention-2-style Triton attention for packed (variable-length) batches with an optional soft cap of the
scores (Gemma 2's attn_logit_softcapping), forward and backward; CUDA, or CPU under `TRITON_INTERPRET=1`.

`models.attention.attention_packed` takes it for a capped model (neither torch's FlashAttention nor SDPA can cap),
with the semantics of its docstring and `block_causal_mask`: q `[T, Hq, D]`, k / v `[Tk, Hkv, D]`, `cu_seqlens [N+1]`
and `cu_seqlens_k [N+1]` (int32) delimiting each segment's queries and keys; causal inside a segment, queries aligned
with the last keys of their segment (a shared prefix: keys longer than queries); an optional sliding `window` (a query
at position p sees keys p - window + 1 .. p); fewer K/V heads than query heads (GQA); the positions past
`cu_seqlens[-1]` (and `cu_seqlens_k[-1]`: Ulysses' padding of the row) an (N+1)-th segment, as `_layout` reads them.
The scores are `cap·tanh(scale·q·k / cap)` (`SOFTCAP`, a constexpr: 0 compiles the uncapped kernel, which SDPA
checks), masked, softmaxed online in float32 (FlashAttention's running max and sum), so no `[T, Tk]` score matrix
exists: the forward keeps only its output and the rows' log-sum-exp `lse [Hq, T]` (float32) for the backward, memory
linear in the tokens where the explicit path's grows with the squared lengths.

Kernels (one program per block of a segment and a head; a program loops over further blocks of its segment when
the segment is longer than `max_seqlen` says, which only the trailing padding segment can be):

* `_fwd_kernel`: a query block against the key blocks it sees; out and lse.
* `_delta_kernel`: delta = rowsum(dout · out) (float32), the softmax backward's correction.
* `_dkdv_kernel`: a key block of one K/V head against every query block that sees it, of every query head of its
  GQA group in turn: dk and dv accumulated in the program, no atomics.
* `_dq_kernel`: a query block against its key blocks again: dq.

The backward recomputes the probabilities (twice: once for dk / dv, once for dq) from q, k and lse and multiplies
the capped scores' gradient by the cap's derivative 1 - tanh². Each output element is summed by one program in a
fixed order: reruns are bitwise equal (torch's deterministic mode, fsdp_config.full_determinism, asks no more).

`torch.compile` traces the custom ops `meshppo::capped_attention` and `meshppo::capped_attention_backward`
(`torch.library`, with fake implementations and `register_autograd`): a compiled block keeps the kernel in its graph.
Head dims up to 256 (any size: the kernels pad it to a power of two with masked loads); float32 inputs use IEEE
float32 products (no TF32), 16-bit inputs round the probabilities to their dtype before the product with v, as
FlashAttention and `models.attention.sdpa` do.

Imported only where it runs (`models.attention`'s dispatch), so triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.block_triton import soft_cap

from models.attention import CAPPED_TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM


@triton.jit
def _segment(cu_ptr, seg, N, total):
    """Segment `seg`'s first position and length: `cu`'s N segments, and the positions past `cu[N]` as the
    (N+1)-th (`models.attention._layout`)."""
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1, mask=seg < N, other=total)
    return start, end - start


@triton.jit
def _visible(rows, cols, offset, window):
    """Whether query `rows` (offsets in the segment's queries) see key `cols` (offsets in its keys): causal with the
    queries aligned with the last keys (`offset` = keys - queries), and within the last `window` (0: no window)."""
    pos = rows + offset
    return (cols <= pos) & ((window == 0) | (cols > pos - window))


@triton.jit
def _tile(ptr, t, stride_t, head, stride_h, rd, mask):
    """Rows `t` (int64 token indices) of head `head`, lanes `rd`, of a [tokens, heads, D] tensor; 0 where masked."""
    return tl.load(ptr + t[:, None] * stride_t + head * stride_h + rd[None, :], mask=mask, other=0.0)


@triton.jit
def _key_range(m0, BLOCK_M: tl.constexpr, offset, k_len, window):
    """The keys that queries m0 .. m0 + BLOCK_M - 1 see, [lo, hi): up to the last query's position, from the first
    query's window on."""
    hi = tl.minimum(k_len, m0 + BLOCK_M + offset)
    lo = tl.where(window > 0, tl.maximum(0, m0 + offset - window + 1), 0)
    return lo, hi


@triton.jit
def _query_range(n0, BLOCK_N: tl.constexpr, offset, q_len, window):
    """The queries that see any of keys n0 .. n0 + BLOCK_N - 1, [lo, hi): from the one at the first key's position,
    up to the last whose window reaches the last key."""
    lo = tl.maximum(0, n0 - offset)
    hi = tl.where(window > 0, tl.minimum(q_len, n0 + BLOCK_N - 1 - offset + window), q_len)
    return lo, hi


@triton.jit
def _scores(a, b, scale, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """The capped, scaled scores `a @ b.T` in float32 (cap·tanh(s / cap) with a cap)."""
    return soft_cap(tl.dot(a, tl.trans(b), input_precision=PRECISION) * scale, SOFTCAP)


@triton.jit
def _cap_grad(ds, c, SOFTCAP: tl.constexpr):
    """d(loss)/d(scores before the cap) from d(loss)/d(capped scores `c`): times 1 - tanh², tanh = c / cap."""
    if SOFTCAP > 0:
        t = c / SOFTCAP
        return ds * (1.0 - t * t)
    return ds


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, N, T, TK, scale, window, group,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    seg, h = tl.program_id(1), tl.program_id(2)
    q_start, q_len = _segment(cu_q_ptr, seg, N, T)
    k_start, k_len = _segment(cu_k_ptr, seg, N, TK)
    offset = k_len - q_len
    kh = h // group
    rm, rn, rd = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_ok = rd < D
    for m0 in range(tl.program_id(0) * BLOCK_M, q_len, tl.num_programs(0) * BLOCK_M):
        rows = m0 + rm
        row_ok = rows < q_len
        tq = (q_start + rows).to(tl.int64)
        q = _tile(q_ptr, tq, stride_qt, h, stride_qh, rd, row_ok[:, None] & d_ok[None, :])
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, hi = _key_range(m0, BLOCK_M, offset, k_len, window)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + rn
            col_ok = cols < k_len
            tk = (k_start + cols).to(tl.int64)
            kv_mask = col_ok[:, None] & d_ok[None, :]
            k = _tile(k_ptr, tk, stride_kt, kh, stride_kh, rd, kv_mask)
            v = _tile(v_ptr, tk, stride_vt, kh, stride_vh, rd, kv_mask)
            s = _scores(q, k, scale, SOFTCAP, PRECISION)
            s = tl.where(_visible(rows[:, None], cols[None, :], offset, window) & col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees none of these keys yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the segment's queries
        tl.store(o_ptr + tq[:, None] * stride_ot + h * stride_oh + rd[None, :], (acc / l_safe[:, None]).to(q.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + h * T + tq, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, T, stride_ot, stride_oh, stride_dt, stride_dh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (rd < D)[None, :]
    t = rows.to(tl.int64)
    o = _tile(o_ptr, t, stride_ot, h, stride_oh, rd, mask).to(tl.float32)
    do = _tile(do_ptr, t, stride_dt, h, stride_dh, rd, mask).to(tl.float32)
    tl.store(delta_ptr + h * T + rows, tl.sum(o * do, axis=1), mask=rows < T)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
                 N, T, TK, scale, window, group,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """dk, dv of a key block of K/V head `kh`: summed over the query heads of its group and the query blocks that
    see it, in this program (dk and dv are written contiguous, [TK, Hkv, D])."""
    seg, kh = tl.program_id(1), tl.program_id(2)
    n_kv_heads = tl.num_programs(2)
    q_start, q_len = _segment(cu_q_ptr, seg, N, T)
    k_start, k_len = _segment(cu_k_ptr, seg, N, TK)
    offset = k_len - q_len
    rm, rn, rd = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_ok = rd < D
    for n0 in range(tl.program_id(0) * BLOCK_N, k_len, tl.num_programs(0) * BLOCK_N):
        cols = n0 + rn
        col_ok = cols < k_len
        tk = (k_start + cols).to(tl.int64)
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = _tile(k_ptr, tk, stride_kt, kh, stride_kh, rd, kv_mask)
        v = _tile(v_ptr, tk, stride_vt, kh, stride_vh, rd, kv_mask)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo, hi = _query_range(n0, BLOCK_N, offset, q_len, window)
        for g in range(group):
            h = kh * group + g
            for m0 in range(lo, hi, BLOCK_M):
                rows = m0 + rm
                row_ok = rows < q_len
                tq = (q_start + rows).to(tl.int64)
                q_mask = row_ok[:, None] & d_ok[None, :]
                q = _tile(q_ptr, tq, stride_qt, h, stride_qh, rd, q_mask)
                do = _tile(do_ptr, tq, stride_dot, h, stride_doh, rd, q_mask)
                lse = tl.load(lse_ptr + h * T + tq, mask=row_ok, other=0.0)
                delta = tl.load(delta_ptr + h * T + tq, mask=row_ok, other=0.0)
                c = _scores(k, q, scale, SOFTCAP, PRECISION)  # [BLOCK_N, BLOCK_M]: the scores transposed
                seen = _visible(rows[None, :], cols[:, None], offset, window) & row_ok[None, :] & col_ok[:, None]
                p = tl.where(seen, tl.exp(c - lse[None, :]), 0.0)
                dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds = _cap_grad(p * (dp - delta[None, :]), c, SOFTCAP)
                dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
        out = tk[:, None] * (n_kv_heads * D) + kh * D + rd[None, :]
        tl.store(dk_ptr + out, (dk * scale).to(k.dtype), mask=kv_mask)
        tl.store(dv_ptr + out, dv.to(v.dtype), mask=kv_mask)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
               N, T, TK, scale, window, group,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """dq of a query block of head `h` (written contiguous, [T, Hq, D])."""
    seg, h = tl.program_id(1), tl.program_id(2)
    n_heads = tl.num_programs(2)
    q_start, q_len = _segment(cu_q_ptr, seg, N, T)
    k_start, k_len = _segment(cu_k_ptr, seg, N, TK)
    offset = k_len - q_len
    kh = h // group
    rm, rn, rd = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_ok = rd < D
    for m0 in range(tl.program_id(0) * BLOCK_M, q_len, tl.num_programs(0) * BLOCK_M):
        rows = m0 + rm
        row_ok = rows < q_len
        tq = (q_start + rows).to(tl.int64)
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = _tile(q_ptr, tq, stride_qt, h, stride_qh, rd, q_mask)
        do = _tile(do_ptr, tq, stride_dot, h, stride_doh, rd, q_mask)
        lse = tl.load(lse_ptr + h * T + tq, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + h * T + tq, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, hi = _key_range(m0, BLOCK_M, offset, k_len, window)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + rn
            col_ok = cols < k_len
            tk = (k_start + cols).to(tl.int64)
            kv_mask = col_ok[:, None] & d_ok[None, :]
            k = _tile(k_ptr, tk, stride_kt, kh, stride_kh, rd, kv_mask)
            v = _tile(v_ptr, tk, stride_vt, kh, stride_vh, rd, kv_mask)
            c = _scores(q, k, scale, SOFTCAP, PRECISION)
            seen = _visible(rows[:, None], cols[None, :], offset, window) & row_ok[:, None] & col_ok[None, :]
            p = tl.where(seen, tl.exp(c - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = _cap_grad(p * (dp - delta[:, None]), c, SOFTCAP)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(dq_ptr + tq[:, None] * (n_heads * D) + h * D + rd[None, :], (dq * scale).to(q.dtype), mask=q_mask)


def blocks(head_dim: int, dtype: torch.dtype, backward: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on the GPU for `head_dim` and `dtype`, of the forward or of the
    backward's kernels. The backward's key program holds dk and dv, `[BLOCK_N, head_dim]` float32 each, in registers
    besides k and v: at head_dim 256 (Gemma 2's 2b and 9b) key blocks of 32. Measured on one H100 in bf16
    (BENCHMARKS.md "Fifty-third pass" and "Fifty-fourth pass"), the best of each sweep: at Gemma-2-2b's shape (8 query
    and 4 K/V heads, head_dim 256, one 8,192-token sequence) the forward's 64 x 32 with 4 warps took 1.64 ms where
    32 x 32 with 8 took 4.80, the backward's 128 x 32 with 8 warps 4.97 ms where 32 x 32 took 11.51 (14 tilings
    each; 64 x 64 with 3 stages exceeds the shared memory); at Gemma-2-27b's (32 query and 16 K/V heads, head_dim
    128; one 8,192-token sequence with a 4,096 window, and four of 2,048) 64 x 64 with 4 warps took 2.72 / 1.13 ms
    forward where 64 x 32 took 3.12 / 1.36, and 7.29 / 2.79 ms backward where 64 x 32 took 8.14 / 3.05 (9 tilings
    each; 8 warps lost at every tiling). float32 inputs take half the rows (twice the bytes a row).
    tests/unit/test_attention_triton.py compiles the bf16 launches of both at head dims 128 and 256 for sm_90 and
    checks their shared memory."""
    if head_dim <= 128:
        bm, bn, warps = 64, 64, 4
    elif not backward:
        bm, bn, warps = 64, 32, 4
    else:
        bm, bn, warps = 128, 32, 8
    if dtype == torch.float32:
        bm, bn = bm // 2, bn // 2
    return bm, bn, warps, 2


def _launch_options(q: torch.Tensor, block_m: int, block_n: int, backward: bool = False) -> dict:
    d = q.shape[-1]
    bm, bn, warps, stages = blocks(d, q.dtype, backward)
    return dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m or bm, BLOCK_N=block_n or bn,
                num_warps=warps, num_stages=stages)


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # (16-bit products are exact in either)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the kernels take; a ValueError saying what else was given."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"capped attention takes q [T, Hq, D] and k, v [Tk, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"capped attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"the Triton capped attention takes head dims up to {MAX_HEAD_DIM}, got {q.shape[2]} "
                         "(MESHPPO_CAPPED_ATTENTION=torch takes the explicit scores)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"capped attention takes float32, bfloat16 or float16 q, k, v of one dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("meshppo::capped_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             cu_seqlens_k: torch.Tensor, max_seqlen: int, max_seqlen_k: int, scale: float, window: int,
             softcap: float, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D] in q's dtype, lse [Hq, T] float32)."""
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    t, hq, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, t, dtype=torch.float32, device=q.device)
    if t:
        opts = _launch_options(q, block_m, block_n)
        n = cu_seqlens.numel() - 1
        grid = (max(1, triton.cdiv(max_seqlen, opts["BLOCK_M"])), n + 1, hq)
        _fwd_kernel[grid](q, k, v, out, lse, cu_seqlens, cu_seqlens_k, n, t, k.shape[0], float(scale), int(window),
                          hq // k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                          v.stride(1), out.stride(0), out.stride(1), SOFTCAP=float(softcap), PRECISION=_precision(q),
                          **opts)
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, scale, window, softcap, block_m, block_n):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[1], q.shape[0],
                                                                                   dtype=torch.float32)


@torch.library.custom_op("meshppo::capped_attention_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen: int,
              max_seqlen_k: int, scale: float, window: int, softcap: float, block_m: int,
              block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in q's dtype."""
    dout, q, k, v = (_contiguous_last(x) for x in (dout, q, k, v))
    t, hq, _ = q.shape
    tk, hkv, _ = k.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not t:
        return dq, dk.zero_(), dv.zero_()
    opts = _launch_options(q, block_m, block_n, backward=True)
    delta = torch.empty(hq, t, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(t, opts["BLOCK_M"]), hq)](
        out, dout, delta, t, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), D=opts["D"],
        BLOCK_D=opts["BLOCK_D"], BLOCK_M=opts["BLOCK_M"], num_warps=opts["num_warps"])
    n, group = cu_seqlens.numel() - 1, hq // hkv
    common = (cu_seqlens, cu_seqlens_k, n, t, tk, float(scale), int(window), group, q.stride(0), q.stride(1),
              k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1))
    constants = dict(SOFTCAP=float(softcap), PRECISION=_precision(q), **opts)
    if tk:
        _dkdv_kernel[(max(1, triton.cdiv(max_seqlen_k, opts["BLOCK_N"])), n + 1, hkv)](
            q, k, v, dout, lse, delta, dk, dv, *common, **constants)
    _dq_kernel[(max(1, triton.cdiv(max_seqlen, opts["BLOCK_M"])), n + 1, hq)](
        q, k, v, dout, lse, delta, dq, *common, **constants)
    return dq, dk, dv


@_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, scale, window, softcap, block_m,
      block_n):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, cu, cu_k, *ctx.args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu, cu_k)


def _autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu, cu_k = ctx.saved_tensors
    dq, dk, dv = _backward(dout, q, k, v, out, lse, cu, cu_k, *ctx.args)
    return dq, dk, dv, *[None] * (2 + len(ctx.args))


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen: int, max_seqlen_k: int, scale: float,
                     window: int | None = None, softcap: float | None = None, block_m: int = 0,
                     block_n: int = 0) -> torch.Tensor:
    """Attention of packed q [T, Hq, D] over k, v [Tk, Hkv, D] (module docstring), differentiable in q, k and v;
    `softcap` None: uncapped; `block_m` / `block_n`: the query and key blocks (0: `blocks`' choice)."""
    check_inputs(q, k, v)
    out, _ = torch.ops.meshppo.capped_attention(q, k, v, cu_seqlens.to(torch.int32), cu_seqlens_k.to(torch.int32),
                                                max_seqlen, max_seqlen_k, float(scale), int(window or 0),
                                                float(softcap or 0.0), block_m, block_n)
    return out
