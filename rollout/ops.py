"""The engine's fused operations, as a PyTorch reference (`TorchOps`) and Triton kernels (`TritonOps`).

Both classes have the same methods and the same numerics contract: every op reproduces the
rounding of the training model (`models.transformer`) in the model dtype, so that the
engine's bf16 logits track the trainer's. `TorchOps` runs everywhere (it is the CPU path
and the reference in tests); `TritonOps` (in `rollout.triton_kernels`, imported only when
asked for) runs on CUDA, or on CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.transformer import apply_rope
from rollout.attention import AttentionMetadata, decode_attention_ref, prefill_attention_ref
from rollout.sampler import combine_partials, sample_partials_ref


def split_k_products(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`x [T, K] @ weight [N, K]^T` as `splits` float32 products over consecutive ranges of K, `[S, T, N]`.

    Their sum, taken in order and rounded once, is the projection with float32 accumulation, as
    `F.linear` computes it: `rms_norm` takes the products in place of its input. On CUDA one
    strided batched cuBLAS GEMM reads the bf16 operands where they are; elsewhere the product
    runs in float32 on the operands' exact float32 values.
    """
    t, k = x.shape
    n = weight.shape[0]
    if k % splits:
        raise ValueError(f"split-K: K={k} is not a multiple of {splits} splits")
    a = x.view(t, splits, k // splits).transpose(0, 1)
    b = weight.view(n, splits, k // splits).permute(1, 2, 0)
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


# fp8 rollout (`EngineConfig.quantization = "fp8"`): e4m3 weights and activations, float32 scales.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_TINY = 1e-30  # the smallest row maximum `silu_and_mul_fp8` scales by (an all-zero row: scale 448e30, stays 0)


def quantize_fp8(t: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` as e4m3 values and one float32 scale (`t ~ q * scale`): the largest |t| (or `amax`, when `t` is
    one shard of a tensor whose largest |value| that is) maps to 448.

    e4m3 is a float: every value within 2^14 of the largest keeps a 3-bit mantissa (relative error
    at most 2^-4), so one scale a tensor loses nothing where the values are but in far-off tails.
    """
    f = t.float()
    amax = (f.abs().amax() if amax is None else amax.float()).clamp(min=FP8_TINY)
    return (f * (FP8_MAX / amax)).to(FP8), amax / FP8_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x [..., D]` as e4m3 values and one float32 scale per row `[...]` (its largest |value| maps to 448,
    `x ~ q * scale`; an all-zero row stays zero): an e4m3 KV cache's K and V rows (the Triton cache writes compute
    the same) and fp8 `down_proj`'s input rows (`silu_and_mul_fp8`)."""
    f = x.float()
    amax = f.abs().amax(-1).clamp(min=FP8_TINY)
    return (f * (FP8_MAX / amax)[..., None]).to(FP8), amax / FP8_MAX


# cuBLASLt's e4m3 GEMM with fast accumulation from this many rows up: the sums stay in the tensor cores'
# accumulator instead of being added into float32 registers every few K steps (CUTLASS's "FP8FastAccum"
# schedules, the usual choice for fp8 inference). On an H200, chains of the projections at qwen2.5-0.5b's,
# 1.5b's and 7b's shapes ran up to 19 % faster with it at 128-512 rows (at most 1.2 % slower) and gained
# nothing on balance at 1-64 rows, where a decode step reads the weights at bandwidth; the 1.5b x 256 decode
# step went 2.350 -> 2.206-2.243 ms (BENCHMARKS.md, "Twenty-second pass"). Its summation error (2.4e-3
# relative at K = 8,960) stays below e4m3's rounding of the operands (the engine's log-probs did not move).
FP8_FAST_ACCUM_MIN_ROWS = 128


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`(x * x_scale) @ (weight * w_scale)^T (+ bias)` in `out_dtype` from e4m3 `x [T, K]`, `weight [N, K]` and
    one-element float32 scales (cuBLASLt's fp8 GEMM on CUDA, torch's on CPU). The products are exact in float32;
    the CPU sums them in float32, Hopper's tensor cores with less (`FP8_FAST_ACCUM_MIN_ROWS`). cuBLASLt adds a
    bias only to a 16-bit output: a float32 one gets it after."""
    mm = dict(scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype,
              use_fast_accum=x.shape[0] >= FP8_FAST_ACCUM_MIN_ROWS)
    if bias is None or out_dtype != torch.float32:
        return torch._scaled_mm(x, weight.t(), bias=bias, **mm)
    return torch._scaled_mm(x, weight.t(), **mm).add_(bias)


def sum_split_k(parts: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The projection `[T, N]` in `dtype` from its split-K products `[S, T, N]`: summed in order, the
    bias added last, rounded once (as `F.linear` with a bias rounds)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    if bias is not None:
        acc += bias.float()
    return acc.to(dtype)


def slot_mapping(block_tables, token_slots, positions, block_size: int) -> torch.Tensor:
    """Cache row `[T]` (int64) of each token: its page's id times block_size plus the offset in the page."""
    pos = positions.long()
    pages = block_tables[token_slots.long(), pos // block_size].long()
    return pages * block_size + pos % block_size


class TorchOps:
    name = "torch"

    @staticmethod
    def linear(x, weight, bias=None):
        """`x [T, K] @ weight [N, K]^T (+ bias)`: the projections of a decode or prefill step."""
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x, weight, eps: float, residual=None, x_scale=None, out_dtype=None, scale: float = 1.0,
                 unit_offset: bool = False):
        """(norm(x + residual) [T, H], x + residual); the norm of `models.transformer.RMSNorm`.

        `x` is `[T, H]`, or a projection's split-K products `[S, T, H]` (float32, `split_k_products`),
        summed in order and rounded to the residual's dtype first (a residual is then required).
        `x_scale [T]` (float32, with a residual): `x` is an fp8 projection's output whose row t is still
        to be multiplied by `x_scale[t]` (`silu_and_mul_fp8`), in float32, then rounded to the residual's
        dtype. `out_dtype` (default: the residual's) is the normed output's: the product of the rounded
        norm and `weight` (float32 `weight`: the fp8 path's constant scale) is rounded once to it. `scale` (with a
        residual): `x`, a block branch's output, is multiplied by it and rounded before the add (Granite's
        residual_multiplier), as the training model's `x + branch * scale`. `unit_offset` (Gemma 3's norms): the
        float32 normalised row times `1 + weight`, rounded once.
        """
        if x.dim() == 3 or x_scale is not None or scale != 1.0:
            if residual is None:
                raise ValueError("rms_norm of split-K products or scaled rows needs the residual (its dtype is the sum's)")
            if x.dim() == 3:
                x = sum_split_k(x, residual.dtype)
            elif x_scale is not None:
                x = (x.float() * x_scale[:, None]).to(residual.dtype)
            if scale != 1.0:
                x = x * scale
        if residual is not None:
            x = x + residual
        xf = x.float()
        if unit_offset:
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(
                out_dtype or x.dtype), x
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (weight.float() * y.float()).to(out_dtype or x.dtype), x

    @staticmethod
    def qk_norm(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                unit_offset: bool = False):
        """`qkv [T, (Hq + 2 Hkv) D]` with each head of q normed by `q_weight [D]` and each of k by `k_weight`
        (Qwen3's and Gemma 3's `q_norm` / `k_norm`: `models.transformer.RMSNorm` over a head; `unit_offset`:
        Gemma 3's, by 1 + weight), v unchanged; in place."""
        t, d = qkv.shape[0], head_dim
        for start, heads, weight in ((0, num_heads, q_weight), (num_heads * d, num_kv_heads, k_weight)):
            part = qkv[:, start:start + heads * d]
            normed = TorchOps.rms_norm(part.reshape(t * heads, d), weight, eps, unit_offset=unit_offset)[0]
            part.copy_(normed.view(t, heads * d))
        return qkv

    @staticmethod
    def post_norm_add(x, weight, eps: float, residual, unit_offset: bool = False):
        """`residual + norm(x)` `[T, H]`: a post-norm block's branch output `x` normed (`rms_norm`, `unit_offset`:
        Gemma 3's) and added to the residual stream, rounded as the training model's `x + RMSNorm(branch)` (OLMo-2's,
        Gemma 3's); the Triton op writes the sum into `residual` in place."""
        return residual + TorchOps.rms_norm(x, weight, eps, unit_offset=unit_offset)[0]

    @staticmethod
    def qk_square_sums(qkv, q_width: int, k_width: int):
        """`[T, 2]` float32: each row's sum of squares of q (`qkv`'s first `q_width` columns) and of k (the next
        `k_width`), the float32 values as `models.transformer.RMSNorm` squares them; a TP rank's columns only."""
        x = qkv[:, :q_width + k_width].float().pow(2)
        return torch.stack([x[:, :q_width].sum(-1), x[:, q_width:].sum(-1)], dim=-1)

    @staticmethod
    def full_qk_norm(qkv, q_weight, k_weight, sums, widths: tuple[int, int], eps: float):
        """OLMo-2's q / k norms over the whole projections, in place: q (`qkv`'s first `len(q_weight)` columns) and k
        (the next `len(k_weight)`) normed as `models.transformer.RMSNorm` norms a row of `widths` (q's, k's: the whole
        projection's) columns whose sums of squares are `sums [T, 2]` (`qk_square_sums`, all-reduced over TP ranks),
        each column times its weight; v unchanged."""
        start = 0
        for j, weight in enumerate((q_weight, k_weight)):
            part = qkv[:, start:start + weight.shape[0]]
            rstd = torch.rsqrt(sums[:, j:j + 1] / widths[j] + eps)
            y = (part.float() * rstd).to(qkv.dtype)
            part.copy_((weight.float() * y.float()).to(qkv.dtype))
            start += weight.shape[0]
        return qkv

    @staticmethod
    def silu_and_mul(gate_up, act: str = "silu"):
        """[T, 2I] (gate | up) -> silu(gate) * up [T, I] (`act` "gelu_tanh": Gemma 3's tanh-approximated GELU of
        the gate)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    @staticmethod
    def gated_linear(x, weight, bias=None, act: str = "silu"):
        """The gated MLP's input half: `silu_and_mul(linear(x, weight, bias), act)`, weight `[2I, K]` = [gate | up]."""
        return TorchOps.silu_and_mul(F.linear(x, weight, bias), act)

    @staticmethod
    def silu_and_mul_fp8(gate_up):
        """`silu_and_mul(gate_up)` `[T, I]` as e4m3 rows and their float32 scales `[T]`: row t's largest |value|
        maps to 448 (`value ~ q[t] * scale[t]`; an all-zero row stays zero). The input of an fp8 `down_proj`."""
        return quantize_rows(TorchOps.silu_and_mul(gate_up))

    scaled_linear = staticmethod(scaled_linear)

    @staticmethod
    def rope_and_cache(qkv, positions, token_slots, cos, sin, k_cache, v_cache, block_tables,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_scale=None, v_scale=None):
        """Rotate q and k of `qkv [T, (Hq + 2 Hkv) D]`, write k and v into the cache; return q `[T, Hq, D]`.

        `cos, sin [max_pos, D/2]` in the model dtype (both halves of HF's cos/sin are equal). With `k_scale`,
        `v_scale [blocks, block_size, Hkv]` (an e4m3 cache), each head's rotated k and v (in the model dtype)
        are written as e4m3 values and their scale (`quantize_rows`).
        """
        t = qkv.shape[0]
        hq, hkv, d = num_heads, num_kv_heads, head_dim
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        pos = positions.long()
        c, s = cos[pos], sin[pos]
        c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        rows = slot_mapping(block_tables, token_slots, positions, k_cache.shape[1])
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            if scales is not None:  # copied as bytes: index_copy_ has no e4m3 kernel on the CPU
                x, x_scale = quantize_rows(x)
                x, cache = x.view(torch.uint8), cache.view(torch.uint8)
                scales.view(-1, hkv).index_copy_(0, rows, x_scale)
            cache.view(-1, hkv, d).index_copy_(0, rows, x)
        return q

    @staticmethod
    def decode_attention(qkv, positions, cos, sin, k_cache, v_cache, block_tables, meta: AttentionMetadata,
                         scale: float, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias=None,
                         k_scale=None, v_scale=None, window: int | None = None, softcap: float | None = None):
        """A decode step's attention from its projections `qkv [B, (Hq + 2 Hkv) D]`: RoPE and the K/V write of
        each sequence's new token (at `positions` = `context_lens - 1`, `rope_and_cache`), then attention.

        `qkv` may be the projection's split-K products `[S, B, (Hq + 2 Hkv) D]` (float32, `split_k_products`),
        summed with `qkv_bias` and rounded to the model dtype (`cos`'s) first (`sum_split_k`).
        `k_scale`, `v_scale`: an e4m3 cache's scales (`rope_and_cache`); `window`: the layer's sliding window,
        `softcap` its scores' soft cap (`rollout.attention`).
        """
        if qkv.dim() == 3:
            qkv = sum_split_k(qkv, cos.dtype, qkv_bias)
        q = TorchOps.rope_and_cache(qkv, positions, meta.slots, cos, sin, k_cache, v_cache, block_tables,
                                    num_heads, num_kv_heads, head_dim, k_scale, v_scale)
        return decode_attention_ref(q, k_cache, v_cache, block_tables, meta, scale, k_scale, v_scale, window,
                                    softcap)

    @staticmethod
    def prefill_attention(q, k_cache, v_cache, block_tables, meta: AttentionMetadata, scale: float,
                          k_scale=None, v_scale=None, window: int | None = None, softcap: float | None = None):
        return prefill_attention_ref(q, k_cache, v_cache, block_tables, meta, scale, k_scale, v_scale, window,
                                     softcap)

    @staticmethod
    def sample_partials(logits, keys, positions, inv_temp, noise_scale, thresh, vocab_start: int, num_splits: int,
                        group: int = 1, softcap: float | None = None):
        return sample_partials_ref(logits, keys, positions, inv_temp, noise_scale, thresh, vocab_start, group, softcap)

    @staticmethod
    def combine_partials(parts, out=None):
        """Tokens `[R]` int64 and log-probs `[R]` of partials `[R, P, 5]` (`rollout.sampler.combine_partials`),
        written into `out = (tokens, logprobs)` when given."""
        tokens, logprobs = combine_partials(parts)
        if out is None:
            return tokens, logprobs
        out[0].copy_(tokens)
        out[1].copy_(logprobs)
        return out

    @staticmethod
    def step_inputs(src, parity, dst, rows: int):
        """`dst[:, :rows] = src[parity, :, :rows]`: a captured decode step's inputs `[V, R]` from the half of the
        pinned buffers `src [2, V, R]` that `parity` (`[1]` int32, on the device) names. The reference of the
        Triton kernel (it reads the parity on the host)."""
        dst[:, :rows].copy_(src[int(parity[0])][:, :rows])
        return dst

    @staticmethod
    def step_outputs(tokens, logprobs, parity, tok_dst, lp_dst, rows: int):
        """A captured decode step's first `rows` tokens and log-probs into the half of the pinned buffers
        `tok_dst`, `lp_dst` `[2, R]` that `parity` names (the reference of the Triton kernel)."""
        half = int(parity[0])
        tok_dst[half, :rows].copy_(tokens[:rows])
        lp_dst[half, :rows].copy_(logprobs[:rows])


def get_ops(use_triton: bool):
    if use_triton:
        from rollout.triton_kernels import TritonOps

        return TritonOps
    return TorchOps
