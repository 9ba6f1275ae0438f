"""Triton kernels against the PyTorch reference ops, on CPU under Triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton is imported and would change every later
`@triton.jit` in the process, so the checks run in one child process (this file run as a
script) and the tests here read its report; nothing leaks into the pytest process.
The interpreter emulates bf16 dot products wrongly (triton 3.9), so the checks use float32
and float16; bf16 is checked on the GPU (tests/gpu/test_engine_gpu.py).
"""

from __future__ import annotations

from tests import interpreter

CHECKS = ["linear", "gated_linear", "rms_norm", "silu_and_mul", "rms_norm_fp8", "silu_and_mul_fp8", "rope_and_cache", "decode_attention",
          "prefill_attention", "kv_cache_fp8", "sample_partials", "combine_partials", "pdl_switch", "sample_extremes",
          "engine_end_to_end", "engine_padded_prefill", "step_io", "engine_graphed_io", "qk_norm", "engine_qwen3",
          "engine_padded_head", "decode_attention_window", "prefill_attention_window", "engine_window",
          "interpreter_patches_once_a_launch"]


def _checks() -> dict:
    import contextlib
    import itertools

    import torch

    from rollout.attention import PREFILL_TILE, AttentionMetadata, decode_attention_ref
    from rollout.ops import TorchOps, sum_split_k
    from rollout.sampler import combine_partials as combine_ref
    from rollout.triton_kernels import TritonOps

    torch.manual_seed(0)
    torch.set_num_threads(1)

    close = interpreter.close

    @contextlib.contextmanager
    def gemv_launches():
        """The GEMV kernel's launches while inside: a fallback to F.linear would meet the error bounds too."""
        import rollout.triton_kernels as tk

        kernel, launches = tk._gemv_kernel, []

        class Counted:
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]

        tk._gemv_kernel = Counted()
        try:
            yield launches
        finally:
            tk._gemv_kernel = kernel

    def linear():
        # one row: the GEMV kernel (its launches counted), against float64 (N and K not multiples
        # of its blocks; bias or none); more rows: F.linear itself, no launch
        with gemv_launches() as launches:
            errs = []
            for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
                for n, k, bias in ((37, 1500, True), (16, 64, False), (5, 2048, True)):
                    x = torch.randn(1, k, dtype=dtype)
                    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
                    b = torch.randn(n, dtype=dtype) if bias else None
                    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
                    before = len(launches)
                    y = TritonOps.linear(x, w, b)
                    assert len(launches) == before + 1, "one row did not take the GEMV kernel"
                    assert y.shape == (1, n) and y.dtype == dtype
                    errs.append(close(y, ref, tol))
                x3 = torch.randn(3, 64, dtype=dtype)
                w3 = torch.randn(8, 64, dtype=dtype)
                before = len(launches)
                assert torch.equal(TritonOps.linear(x3, w3), torch.nn.functional.linear(x3, w3))
                assert len(launches) == before, "three rows launched the GEMV kernel"
        return max(errs)

    def gated_linear():
        # one row: gate and up in one GEMV launch, silu(gate) * up against float64 (N not a multiple
        # of the block, K past one weight tile, bias or none); more rows: cuBLAS, then the SiLU kernel
        with gemv_launches() as launches:
            errs = []
            # relative to the largest output: the unfused ops round gate, up, silu and the product
            # to the dtype (four half-ulps, 2e-3 in float16)
            for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
                for n, k, bias in ((21, 1500, True), (8, 64, False)):
                    x = torch.randn(1, k, dtype=dtype)
                    w = (torch.randn(2 * n, k) / k ** 0.5).to(dtype)
                    b = torch.randn(2 * n, dtype=dtype) if bias else None
                    gu = x.double() @ w.double().t() + (b.double() if bias else 0)
                    ref = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
                    before = len(launches)
                    y = TritonOps.gated_linear(x, w, b)
                    assert len(launches) == before + 1, "one row did not take the fused GEMV"
                    assert y.shape == (1, n) and y.dtype == dtype
                    errs.append(close(y / ref.abs().max(), ref / ref.abs().max(), tol))
                x3 = torch.randn(3, 64, dtype=dtype)
                w3 = torch.randn(16, 64, dtype=dtype) / 8
                before = len(launches)
                errs.append(close(TritonOps.gated_linear(x3, w3), TorchOps.gated_linear(x3, w3), tol))
                assert len(launches) == before, "three rows launched the GEMV kernel"
        return max(errs)

    def rms_norm():
        errs = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x = torch.randn(5, 96, dtype=dtype)
            res = torch.randn(5, 96, dtype=dtype)
            w = (1 + 0.1 * torch.randn(96)).to(dtype)
            ref_out, ref_res = TorchOps.rms_norm(x, w, 1e-6, res.clone())
            out, new_res = TritonOps.rms_norm(x, w, 1e-6, res)  # residual updated in place
            errs += [close(out, ref_out, tol), close(new_res, ref_res, 0), close(res, ref_res, 0)]
            out, same = TritonOps.rms_norm(x, w, 1e-6, None)
            errs.append(close(out, TorchOps.rms_norm(x, w, 1e-6)[0], tol))
            assert same is x
            # a projection's float32 split-K products, summed in order and rounded before the residual
            # add: the residual sum bit for bit the reference's
            parts = torch.randn(3, 5, 96)
            ref_out, ref_res = TorchOps.rms_norm(parts, w, 1e-6, res.clone())
            out, new_res = TritonOps.rms_norm(parts, w, 1e-6, res)
            assert out.dtype == dtype
            errs += [close(out, ref_out, tol), close(new_res, ref_res, 0)]
        return max(errs)

    def qk_norm():
        # Qwen3's per-head q/k norms in place over qkv rows wider than q | k | v (a strided view), head_dim
        # not a power of two; v and the columns past the view untouched
        errs = []
        hq, hkv, d = 4, 2, 24
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            wide = torch.randn(5, (hq + 2 * hkv) * d + 8, dtype=dtype)
            qkv = wide[:, :(hq + 2 * hkv) * d]
            qw, kw = (1 + 0.3 * torch.randn(d)).to(dtype), (1 + 0.3 * torch.randn(d)).to(dtype)
            ref = TorchOps.qk_norm(qkv.clone(), qw, kw, hq, hkv, d, 1e-6)
            before = wide.clone()
            got = TritonOps.qk_norm(qkv, qw, kw, hq, hkv, d, 1e-6)
            assert got.data_ptr() == qkv.data_ptr()
            assert torch.equal(wide[:, (hq + hkv) * d:], before[:, (hq + hkv) * d:])
            assert not torch.equal(wide[:, :hq * d], before[:, :hq * d])
            errs.append(close(got, ref, tol))
        return max(errs)

    def silu_and_mul():
        errs = []
        for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
            x = torch.randn(4, 2 * 80, dtype=dtype)
            errs.append(close(TritonOps.silu_and_mul(x), TorchOps.silu_and_mul(x), tol))
        return max(errs)

    def e4m3_ulps(a, ref):
        """Largest distance between e4m3 tensors in steps of the reference's spacing. The interpreter's float32 ->
        e4m3 conversion (not the GPU's) drops the carry when rounding up to a power of two (31.5 -> 16, not 32):
        those values are set aside here, and must be rare; the GPU suite checks the kernels on hardware."""
        fa, fr = a.float(), ref.float()
        carry = (fa * 2 == fr) & (torch.frexp(fr)[0].abs() == 0.5)
        assert carry.double().mean() < 0.05, f"{int(carry.sum())} values off by a dropped carry"
        step = torch.exp2(torch.floor(torch.log2(fr.abs().clamp(min=2.0 ** -6))) - 3)
        return ((fa - fr).abs() / step)[~carry].max().item()

    def rms_norm_fp8():
        # the fp8 path's norm: an fp8 down_proj's float32 rows times their scales, rounded once before the
        # residual add (bit for bit), the normed output times a float32 weight rounded to e4m3
        from rollout.ops import FP8
        x = torch.randn(5, 96) * 40
        res = torch.randn(5, 96, dtype=torch.float16)
        scale = torch.rand(5) + 0.1
        w = torch.full((96,), 448 / 96 ** 0.5)
        ref_out, ref_res = TorchOps.rms_norm(x, w, 1e-6, res.clone(), scale, out_dtype=FP8)
        out, new_res = TritonOps.rms_norm(x, w, 1e-6, res, scale, out_dtype=FP8)
        assert out.dtype == FP8 and torch.equal(new_res, ref_res)
        ulps = e4m3_ulps(out, ref_out)
        assert ulps <= 1, f"{ulps} e4m3 steps"
        # without the scales the residual sum is another
        assert not torch.equal(TorchOps.rms_norm(x, w, 1e-6, res.clone(), None)[1], ref_res)
        return ulps

    def silu_and_mul_fp8():
        # the row in registers, and (a lower limit for it) rows in blocks, two passes each; an all-zero row;
        # the row scales bit for bit
        import rollout.triton_kernels as tk

        x = torch.randn(4, 2 * 2500, dtype=torch.float16) * torch.tensor([1.0, 0.0, 30.0, 0.01], dtype=torch.float16)[:, None]
        ref_q, ref_scale = TorchOps.silu_and_mul_fp8(x)
        ulps = []
        for whole_row in (tk.SILU_FP8_WHOLE_ROW, 1024):
            saved, tk.SILU_FP8_WHOLE_ROW = tk.SILU_FP8_WHOLE_ROW, whole_row
            try:
                q, scale = TritonOps.silu_and_mul_fp8(x)
            finally:
                tk.SILU_FP8_WHOLE_ROW = saved
            assert torch.equal(scale, ref_scale) and not q[1].float().any()
            assert (q.float().abs().amax(-1) == torch.tensor([448.0, 0.0, 448.0, 448.0])).all()
            ulps.append(e4m3_ulps(q, ref_q))
            assert ulps[-1] <= 1, f"{ulps[-1]} e4m3 steps"
        return max(ulps)

    def paged_setup(dtype, hkv, d, lengths, page=4, num_blocks=40):
        """A KV pool holding `lengths` tokens per sequence in scattered pages."""
        k_cache = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
        v_cache = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
        perm = torch.randperm(num_blocks).tolist()
        width = max(-(-n // page) for n in lengths) + 1
        bt = torch.zeros(len(lengths) + 1, width, dtype=torch.int32)
        slots = torch.tensor([len(lengths) - i for i in range(len(lengths))], dtype=torch.int32)  # not 0..N-1
        for i, n in enumerate(lengths):
            for c in range(-(-n // page)):
                bt[slots[i], c] = perm.pop()
        return k_cache, v_cache, bt, slots

    def rope_and_cache():
        # head dims of a power of two, and 80, 96 and 8 (padded to 128, 128 and 16 lanes: `head_lanes`)
        from models import ModelArgs
        from models.transformer import rope_cos_sin, rope_inv_freq

        errs = []
        for (dtype, tol), d in itertools.product(((torch.float32, 1e-6), (torch.float16, 0.0)), (16, 80, 96, 8)):
            hq, hkv, t = 6, 2, 7
            args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
            cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(64), dtype)
            cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
            k_ref, v_ref, bt, _ = paged_setup(dtype, hkv, d, [20, 20])
            k_tri, v_tri = k_ref.clone(), v_ref.clone()
            qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype)
            positions = torch.tensor([0, 5, 19, 3, 4, 17, 9], dtype=torch.int32)
            token_slots = torch.tensor([2, 2, 2, 1, 1, 1, 2], dtype=torch.int32)
            q_ref = TorchOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
            qkv_tri = qkv.clone()
            q_tri = TritonOps.rope_and_cache(qkv_tri, positions, token_slots, cos, sin, k_tri, v_tri, bt, hq, hkv, d)
            errs += [close(q_tri, q_ref, tol), close(k_tri, k_ref, tol), close(v_tri, v_ref, 0)]
            assert q_tri.data_ptr() == qkv_tri.data_ptr()  # q is rotated in place
            assert torch.equal(qkv_tri[:, hq * d:], qkv[:, hq * d:])  # k and v as they were
        return max(errs)

    def decode_attention():
        # RoPE and the K/V write of each sequence's new token (at context_lens - 1), then attention:
        # against `rope_and_cache` + the reference attention in float32 (the written K/V included).
        from models import ModelArgs
        from models.transformer import rope_cos_sin, rope_inv_freq

        errs = []
        # head dims of a power of two, and padded ones (80, 96; 8: `tl.dot` reduces over 16 or more)
        for dtype, tol, shapes in ((torch.float32, 2e-5, ((4, 2, 16), (14, 2, 32), (6, 2, 80), (3, 1, 96), (4, 2, 8))),
                                   (torch.float16, 2e-3, ((4, 2, 16), (6, 2, 80)))):
            for hq, hkv, d in shapes:
                args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
                cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(64), dtype)
                cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
                lengths = [1, 9, 33, 16]
                k_cache, v_cache, bt, slots = paged_setup(dtype, hkv, d, lengths)
                qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, dtype=dtype)
                for splits in (1, 3):  # fused (one split a sequence) and after `rope_and_cache`
                    meta = AttentionMetadata(is_decode=True, slots=slots,
                                             context_lens=torch.tensor(lengths, dtype=torch.int32),
                                             max_context_len=max(lengths), num_splits=splits)
                    # The reference rotates in the kernel's dtype (same roundings) and attends in float32.
                    k_ref, v_ref, k_tri, v_tri = (c.clone() for c in (k_cache, v_cache, k_cache, v_cache))
                    pos = meta.context_lens - 1
                    q = TorchOps.rope_and_cache(qkv, pos, slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
                    ref = decode_attention_ref(q.float(), k_ref.float(), v_ref.float(), bt, meta, d ** -0.5)
                    if dtype == torch.float32:
                        k2, v2 = k_cache.clone(), v_cache.clone()
                        both = TorchOps.decode_attention(qkv, pos, cos, sin, k2, v2, bt, meta, d ** -0.5, hq, hkv, d)
                        assert torch.equal(both, ref) and torch.equal(k2, k_ref) and torch.equal(v2, v_ref)
                    out = TritonOps.decode_attention(qkv.clone(), pos, cos, sin, k_tri, v_tri, bt, meta, d ** -0.5, hq, hkv, d)
                    errs += [close(out, ref, tol), close(k_tri, k_ref, 1e-6 if dtype == torch.float32 else 0.0),
                             close(v_tri, v_ref, 0)]
                    assert not torch.equal(k_tri, k_cache) and not torch.equal(v_tri, v_cache)  # the new K/V landed
                # qkv as two float32 split-K products plus a bias, summed in the fused kernel (one split a
                # sequence): as the reference path on their sum rounded once (`sum_split_k`)
                parts, bias = torch.randn(2, len(lengths), qkv.shape[1]), torch.randn(qkv.shape[1], dtype=dtype)
                meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(lengths, dtype=torch.int32),
                                         max_context_len=max(lengths), num_splits=1)
                k_ref, v_ref, k_tri, v_tri = (c.clone() for c in (k_cache, v_cache, k_cache, v_cache))
                pos = meta.context_lens - 1
                summed = sum_split_k(parts, dtype, bias)
                q = TorchOps.rope_and_cache(summed, pos, slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
                ref = decode_attention_ref(q.float(), k_ref.float(), v_ref.float(), bt, meta, d ** -0.5)
                out = TritonOps.decode_attention(parts, pos, cos, sin, k_tri, v_tri, bt, meta, d ** -0.5, hq, hkv, d,
                                                 qkv_bias=bias)
                assert out.dtype == dtype
                errs += [close(out, ref, tol), close(k_tri, k_ref, 1e-6 if dtype == torch.float32 else 0.0),
                         close(v_tri, v_ref, 0)]
        return max(errs)

    def prefill_attention():
        errs = []
        shapes = ((4, 2, 16), (6, 2, 80), (4, 1, 96), (4, 2, 8))  # padded head dims too (`head_lanes`)
        for (dtype, tol), (hq, hkv, d) in itertools.product(((torch.float32, 2e-5), (torch.float16, 2e-3)), shapes):
            # a fresh prompt over 2 tiles, decodes (one query: the heads of a KV head in one tile), one
            # over several key blocks, a chunk
            starts, q_lens = [0, 7, 3, 150], [PREFILL_TILE + 5, 1, 12, 1]
            ctx = [s + n for s, n in zip(starts, q_lens)]
            k_cache, v_cache, bt, slots = paged_setup(dtype, hkv, d, ctx, num_blocks=96)
            meta = AttentionMetadata.prefill(slots, q_lens, ctx)
            q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
            ref = TorchOps.prefill_attention(q.float(), k_cache.float(), v_cache.float(), bt, meta, d ** -0.5)
            errs.append(close(TritonOps.prefill_attention(q, k_cache, v_cache, bt, meta, d ** -0.5), ref, tol))
        return max(errs)

    def kv_cache_fp8():
        # The e4m3 KV cache (float32 engine): the RoPE / cache-write kernel and the fused decode write against
        # `quantize_rows` (scales to float32 noise, values within one e4m3 step, the interpreter's dropped carries
        # aside); decode (fused and split) and prefill attention against the reference over the cache the kernel
        # wrote (every row times its scale). Head dims 16 and 80 (padded lanes: no part of a row's scale).
        return max(kv_cache_fp8_of(16), kv_cache_fp8_of(80))

    def kv_cache_fp8_of(d):
        from models import ModelArgs
        from models.transformer import rope_cos_sin, rope_inv_freq
        from rollout.ops import quantize_rows

        hq, hkv = 4, 2
        args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
        cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(256), torch.float32)
        cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()

        def fp8_pool(lengths, num_blocks=40):
            k, v, bt, slots = paged_setup(torch.float32, hkv, d, lengths, num_blocks=num_blocks)
            (k8, ks), (v8, vs) = quantize_rows(k * 3), quantize_rows(v)
            return [k8, v8, ks, vs], bt, slots

        errs, ulps = [], []

        def same_cache(tri, ref):
            ulps.extend([e4m3_ulps(tri[0], ref[0]), e4m3_ulps(tri[1], ref[1])])
            errs.extend([close(tri[2] / ref[2].clamp(min=1e-30), torch.ones_like(ref[2]), 1e-6),
                         close(tri[3] / ref[3].clamp(min=1e-30), torch.ones_like(ref[3]), 1e-6)])
            assert ulps[-1] <= 1 and ulps[-2] <= 1, ulps[-2:]

        pool, bt, _ = fp8_pool([20, 20])
        qkv = torch.randn(7, (hq + 2 * hkv) * d) * 2
        positions = torch.tensor([0, 5, 19, 3, 4, 17, 9], dtype=torch.int32)
        token_slots = torch.tensor([2, 2, 2, 1, 1, 1, 2], dtype=torch.int32)
        ref, tri = [t.clone() for t in pool], [t.clone() for t in pool]
        q_ref = TorchOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, ref[0], ref[1], bt, hq, hkv, d,
                                        ref[2], ref[3])
        q_tri = TritonOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, tri[0], tri[1], bt, hq, hkv, d,
                                         tri[2], tri[3])
        errs.append(close(q_tri, q_ref, 1e-6))
        same_cache(tri, ref)
        assert not torch.equal(tri[2], pool[2])  # the scales were written

        lengths = [1, 9, 33, 16]
        pool, bt, slots = fp8_pool(lengths)
        qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d) * 2
        for splits in (1, 3):
            meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(lengths, dtype=torch.int32),
                                     max_context_len=max(lengths), num_splits=splits)
            pos = meta.context_lens - 1
            ref, tri = [t.clone() for t in pool], [t.clone() for t in pool]
            q = TorchOps.rope_and_cache(qkv.clone(), pos, slots, cos, sin, ref[0], ref[1], bt, hq, hkv, d, ref[2], ref[3])
            out = TritonOps.decode_attention(qkv.clone(), pos, cos, sin, tri[0], tri[1], bt, meta, d ** -0.5, hq, hkv, d,
                                             None, tri[2], tri[3])
            same_cache(tri, ref)
            errs.append(close(out, decode_attention_ref(q, tri[0], tri[1], bt, meta, d ** -0.5, tri[2], tri[3]), 2e-5))

        starts, q_lens = [0, 7, 3, 150], [PREFILL_TILE + 5, 1, 12, 1]
        ctx = [s + n for s, n in zip(starts, q_lens)]
        pool, bt, slots = fp8_pool(ctx, num_blocks=96)
        meta = AttentionMetadata.prefill(slots, q_lens, ctx)
        q = torch.randn(sum(q_lens), hq, d)
        errs.append(close(TritonOps.prefill_attention(q, *pool[:2], bt, meta, d ** -0.5, *pool[2:]),
                          TorchOps.prefill_attention(q, *pool[:2], bt, meta, d ** -0.5, *pool[2:]), 2e-5))
        return max(errs + ulps)

    def sample_partials():
        r, v = 4, 2100
        logits = torch.randn(r, v) * 2
        logits[0, 10] = logits[0, 2000] = 50.0  # a greedy tie across kernel splits: lowest id wins
        keys = torch.randint(-2**31, 2**31 - 1, (r,), dtype=torch.int32)
        pos = torch.arange(r, dtype=torch.int32) * 7
        for temperature in (0.0, 0.7):
            inv_t = torch.tensor(1.0 if temperature == 0 else 1 / temperature)
            noise = torch.tensor(0.0 if temperature == 0 else 1.0)
            # A strided threshold (a column of topk values, as top-k produces it) must work too.
            top = torch.topk(logits.float() * inv_t, 20, dim=-1).values[:, -1]
            # Groups of 1 (2,100 tokens) and of 16 (the first 2,096).
            for (thresh, start), group in itertools.product(((None, 0), (top, 4096)), (1, 16)):
                x = logits[:, :v - v % group]
                ref = combine_ref(TorchOps.sample_partials(x, keys, pos, inv_t, noise, thresh, start, 1, group))
                for splits in (1, 3):
                    got = combine_ref(TritonOps.sample_partials(x, keys, pos, inv_t, noise, thresh,
                                                                start, splits, group))
                    assert torch.equal(got[0], ref[0]), (temperature, group, splits, got[0], ref[0])
                    close(got[1], ref[1], 1e-5)
                if temperature == 0:
                    assert got[0][0].item() == start + 10
        return 0.0

    def combine_partials():
        # random partials with the race's edge cases: a tie for the best score across chunks (the
        # first chunk wins, as torch.argmax), empty chunks (no token in the race: score -inf, z 0)
        r, p = 5, 7
        parts = torch.randn(r, p, 5)
        parts[..., 4] = torch.rand(r, p) * 100 + 1
        parts.view(torch.int32)[..., 1] = torch.randint(0, 150_000, (r, p), dtype=torch.int32)
        parts[0, 2, 0] = parts[0, 5, 0] = 9.0
        parts[1, 1:4, 0] = parts[1, 1:4, 3] = float("-inf")
        parts[1, 1:4, 4] = 0.0
        ref_t, ref_lp = combine_ref(parts)
        got_t, got_lp = TritonOps.combine_partials(parts)
        assert torch.equal(got_t, ref_t) and got_t.dtype == torch.int64 and ref_t[0] == parts.view(torch.int32)[0, 2, 1]
        out = (torch.full((r,), -1, dtype=torch.int64), torch.zeros(r))
        written = TritonOps.combine_partials(parts, out)
        assert written[0] is out[0] and torch.equal(out[0], ref_t)
        return max(close(got_lp, ref_lp, 1e-5), close(out[1], ref_lp, 1e-5))

    def step_io():
        # a captured step's I/O: inputs from the half of [2, 3, R] that the parity names, results into
        # the same half of [2, R]; the other half and the rows past `rows` untouched (rows not a
        # power of two, nor a multiple of the kernel's block)
        r = 300
        src = torch.randint(-2**31, 2**31 - 1, (2, 3, r), dtype=torch.int32)
        tokens, logprobs = torch.randint(0, 150_000, (r,)), torch.randn(r)
        for half in (0, 1):
            parity = torch.tensor([half], dtype=torch.int32)
            for rows in (1, 257, r):
                got, ref = torch.full((3, r), -7, dtype=torch.int32), torch.full((3, r), -7, dtype=torch.int32)
                TritonOps.step_inputs(src, parity, got, rows)
                TorchOps.step_inputs(src, parity, ref, rows)
                assert torch.equal(got, ref) and torch.equal(got[:, :rows], src[half, :, :rows])
                assert (got[:, rows:] == -7).all()
                tok, lp = torch.full((2, r), -1, dtype=torch.int64), torch.full((2, r), -1.0)
                tok_ref, lp_ref = tok.clone(), lp.clone()
                TritonOps.step_outputs(tokens, logprobs, parity, tok, lp, rows)
                TorchOps.step_outputs(tokens, logprobs, parity, tok_ref, lp_ref, rows)
                assert torch.equal(tok, tok_ref) and torch.equal(lp, lp_ref)
                assert torch.equal(tok[half, :rows], tokens[:rows]) and (tok[1 - half] == -1).all()
                assert (tok[half, rows:] == -1).all() and (lp[1 - half] == -1).all()
        return 0.0

    def pdl_switch():
        # programmatic dependent launch: never for CPU tensors, `MESHPPO_PDL` checked on every launch
        from unittest import mock

        import rollout.triton_kernels as tk

        x = torch.zeros(1)
        for value in ("auto", "off"):
            with mock.patch.dict("os.environ", {tk.PDL_ENV: value}):
                assert tk._launch(x) == {"PDL": False, "launch_pdl": False}
        with mock.patch.dict("os.environ", {tk.PDL_ENV: "on"}):
            try:
                tk._launch(x)
            except ValueError as e:
                assert tk.PDL_ENV in str(e) and "'on'" in str(e)
            else:
                raise AssertionError(f"{tk.PDL_ENV}=on was accepted")
        return 0.0

    def sample_extremes():
        # The interpreter runs a row in ~16 ms, too slow for the goodness-of-fit draws: those run on
        # the PyTorch path (same integers and uniforms: `sample_partials` above asserts equal tokens)
        # and on the GPU (tests/gpu/test_engine_gpu.py).
        from tests.unit.test_sampler import check_extremes, check_group_extremes

        for splits in (1, 2):
            check_extremes(TritonOps, num_splits=splits)
            check_group_extremes(TritonOps, num_splits=splits)
        return 0.0

    def interpreter_patches_once_a_launch():
        # tests/interpreter.py's patch_language_once_a_launch: a launch of three programs calling tl.sum (a
        # `@triton.jit` function calling others) four times each patches triton.language once, and
        # triton.language.core (which tl.sum sees) once, not at every call; its results are bit for bit those
        # of the interpreter's own patching
        import triton
        import triton.language as tl
        from triton.runtime import interpreter as ti

        @triton.jit
        def kernel(x_ptr, out_ptr, N: tl.constexpr):
            row = tl.program_id(0)
            x = tl.load(x_ptr + row * N + tl.arange(0, N))
            total = 0.0
            for i in range(4):
                total += tl.sum(x * (i + 1.0), axis=0)
            tl.store(out_ptr + row, total)

        once = getattr(ti, "_patch_lang", None)
        if not hasattr(once, "__wrapped__"):  # a Triton without the internals it patches: left as it is
            assert not interpreter.patch_language_once_a_launch()
            return 0.0
        x, calls = torch.randn(3, 16), []
        outs = [torch.zeros(3) for _ in range(2)]
        ti._patch_lang = lambda fn: calls.append(fn.__name__) or once.__wrapped__(fn)
        try:
            assert interpreter.patch_language_once_a_launch()  # over the counting patch
            kernel[(3,)](x, outs[0], N=16)
            assert calls == ["kernel", "sum"], calls
            ti._patch_lang = once.__wrapped__  # the interpreter's own: at every call
            kernel[(3,)](x, outs[1], N=16)
        finally:
            ti._patch_lang = once
        assert torch.equal(outs[0], outs[1])
        return close(outs[0], (x.double() * 10).sum(1), 1e-5)

    def tiny_model():
        """A one-layer model whose weights are large enough to make every token choice matter."""
        from models import ModelArgs, Transformer

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.3)
        return args, model

    def decode_attention_window():
        # a sliding window (keys ctx - window .. ctx - 1 only), one split a sequence (RoPE fused) and several
        # (splits over the window's keys, some empty for short contexts), against the reference path's window;
        # the window hides keys of the longer contexts (its reference differs from the full one)
        from models import ModelArgs
        from models.transformer import rope_cos_sin, rope_inv_freq

        errs = []
        for (hq, hkv, d), window in itertools.product(((4, 2, 16), (6, 2, 80)), (1, 5, 16, 33)):
            args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
            cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(128), torch.float32)
            cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
            lengths = [1, 9, 33, 70]
            k_cache, v_cache, bt, slots = paged_setup(torch.float32, hkv, d, lengths)
            qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d)
            for splits in (1, 3):
                meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(lengths, dtype=torch.int32),
                                         max_context_len=max(lengths), num_splits=splits)
                k_ref, v_ref, k_tri, v_tri = (c.clone() for c in (k_cache, v_cache, k_cache, v_cache))
                pos = meta.context_lens - 1
                q = TorchOps.rope_and_cache(qkv, pos, slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
                ref = decode_attention_ref(q, k_ref, v_ref, bt, meta, d ** -0.5, window=window)
                full = decode_attention_ref(q, k_ref, v_ref, bt, meta, d ** -0.5)
                assert (ref[3] - full[3]).abs().max() > 1e-3 and torch.equal(ref[0], full[0])
                out = TritonOps.decode_attention(qkv.clone(), pos, cos, sin, k_tri, v_tri, bt, meta, d ** -0.5, hq, hkv,
                                                 d, window=window)
                errs += [close(out, ref, 2e-5), close(k_tri, k_ref, 1e-6), close(v_tri, v_ref, 0)]
        return max(errs)

    def prefill_attention_window():
        # a sliding window over prefill tiles: a fresh prompt over 2 tiles, one-query rows, a chunk after a
        # cached prefix; windows of 1, 5 (a tile's later rows see nothing of its first key blocks: they must stay
        # empty, not NaN) and 40; against the reference path's window, which differs from the full attention
        from rollout.attention import prefill_attention_ref

        errs = []
        for (hq, hkv, d), window in itertools.product(((4, 2, 16), (6, 2, 80)), (1, 5, 40)):
            starts, q_lens = [0, 7, 3, 150, 30], [PREFILL_TILE + 5, 1, 12, 1, 40]
            ctx = [s + n for s, n in zip(starts, q_lens)]
            k_cache, v_cache, bt, slots = paged_setup(torch.float32, hkv, d, ctx, num_blocks=110)
            meta = AttentionMetadata.prefill(slots, q_lens, ctx)
            q = torch.randn(sum(q_lens), hq, d)
            ref = prefill_attention_ref(q, k_cache, v_cache, bt, meta, d ** -0.5, window=window)
            full = prefill_attention_ref(q, k_cache, v_cache, bt, meta, d ** -0.5)
            assert (ref - full).abs().max() > 1e-3
            got = TritonOps.prefill_attention(q, k_cache, v_cache, bt, meta, d ** -0.5, window=window)
            assert not got.isnan().any()
            errs.append(close(got, ref, 2e-5))
        return max(errs)

    def engine_window():
        # a Mistral whose every layer attends through a window of 6, generating past it (prompts of 3 and 10,
        # 6 new tokens: the first prompt's decode steps pass the window too; chunked prefill of 8 tokens a step): the
        # Triton path's tokens are the PyTorch path's, its log-probs within 1e-4 of the PyTorch path's, which differ
        # by more than 1e-3 from the whole context's
        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, model_type="mistral",
                         extra_hf={"sliding_window": 6})
        engine = interpreter.cpu_engine(args, interpreter.random_model(args))
        assert engine.model.windows == [6, 6]
        sp = interpreter.sampled(max_tokens=6)
        windowed = engine.generate(interpreter.PROMPTS, sp)
        engine.model.windows = [None, None]  # the whole context: other log-probs past the window
        full = engine.generate(interpreter.PROMPTS, sp)
        assert interpreter.logprob_gap(full, windowed) > 1e-3
        engine.model.windows = [6, 6]
        return interpreter.engine_matches_torch(engine, [(interpreter.PROMPTS, sp)])

    # the two prompts sampled twice each, then one sequence alone (decode steps of one row; several splits)
    def two_runs(max_tokens):
        return [(interpreter.PROMPTS, interpreter.sampled(max_tokens)),
                (interpreter.PROMPTS[:1], interpreter.sampled(n=1, seed=2))]

    def engine_end_to_end():
        return interpreter.engine_matches_torch(interpreter.cpu_engine(*tiny_model()), two_runs(3))

    def engine_qwen3():
        # a Qwen3 model (per-head q/k norms, head_dim 16 against hidden / heads 8): the Triton path's tokens
        # are the PyTorch path's, in prefill and decode steps
        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         model_type="qwen3")
        return interpreter.engine_matches_torch(interpreter.cpu_engine(args, interpreter.random_model(args)))

    def engine_padded_head():
        # head_dim 20 and 8 (GQA 2): heads padded to 32 and 16 lanes in the RoPE and attention kernels
        # (`head_lanes`); the Triton path's tokens are the PyTorch path's, in prefill and decode steps, one
        # split a sequence and several (head_dim 8's several: `engine_end_to_end`'s one row, at the same head dim,
        # not run again here)
        from models import ModelArgs
        from rollout.triton_kernels import head_lanes

        dims = (4, 8, 16, 20, 64, 80, 96, 100, 128, 256)
        assert [head_lanes(d) for d in dims] == [16, 16, 16, 32, 64, 128, 128, 128, 128, 256]
        errs = []
        for head_dim in (20, 8):
            args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                             max_position_embeddings=64)
            engine = interpreter.cpu_engine(args, interpreter.random_model(args))
            errs.append(interpreter.engine_matches_torch(engine, two_runs(4)[:1] if head_dim == 8 else two_runs(4)))
        return max(errs)

    def engine_padded_prefill():
        # Prefill steps through the padded layout that CUDA graphs replay (here eagerly): padding
        # tokens, sequences, tiles and sample rows; chunked prompts, steps with no sampled row
        # (partial chunks only), forked samples, a preemption's recompute. Same tokens as the
        # unpadded PyTorch path (log-probs within 1e-4), and the padded path did run with real padding.
        from rollout import EngineConfig, LLMEngine, SamplingParams
        from rollout.runner import prefill_bucket

        args, model = tiny_model()
        prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40], [7, 7, 9, 30, 31, 2]]
        sp = SamplingParams(temperature=0.9, n=3, max_tokens=6, seed=1)
        outs, stats = [], []
        for padded in (False, True):
            engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=10, max_num_seqs=8,
                                                  max_num_batched_tokens=12, cudagraph_capture_sizes=[2, 4]),
                               device="cpu")
            engine.load_weights(model.named_parameters())
            engine.runner.use_triton = padded  # the reference on the PyTorch path: the interpreter runs it no faster
            if padded:
                engine.runner.setup_padded_prefill(12)
                steps = []
                run = engine.runner._run_prefill_padded
                engine.runner._run_prefill_padded = lambda a: steps.append((len(a["ids"]), len(a["src"]))) or run(a)
            outs.append(engine.generate(prompts, sp))
            stats.append(engine.last_stats)
        assert stats[1]["preemptions"] > 0 and stats[1]["prefill_steps_decoding"] > 0, stats[1]
        assert any(prefill_bucket(t, 12) > t for t, _ in steps), steps  # padded tokens
        # no sampled row; rows padded to the ladder (2, 4), and past its end to max_num_seqs (8)
        assert {0, 3}.issubset(r for _, r in steps) and any(4 < r < 8 for _, r in steps), steps
        assert {k[0] for k in engine.runner._prefill_uses} == {"prefill", "sample"}
        assert engine.runner._pre_dev is not None
        engine.free_graphs()  # the padded prefill's buffers and use counts go with the graphs
        assert engine.runner._pre_dev is None and engine.runner._pre_h is None and not engine.runner._prefill_uses
        err = interpreter.same_tokens(outs[1], outs[0])
        assert err <= 1e-4, f"log-probs differ by {err}"
        return err

    def engine_graphed_io():
        # The captured decode step's I/O through the pinned halves, with a graph stood in for by its
        # body run at each replay: decode steps of 1-8 rows padded to the ladder, steps interleaved
        # with prefill steps (whose results are copied), both halves in turn. Same tokens as the
        # engine whose decode steps copy their inputs and results (on the PyTorch path: log-probs within
        # 1e-4); a step reading the wrong half would read the previous step's positions and slots.
        from rollout import EngineConfig, LLMEngine, SamplingParams

        args, model = tiny_model()
        prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40], [7, 7, 9, 30, 31, 2]]
        # eight EOS ids of 64: samples end at different steps, and the decode batch shrinks
        sp = SamplingParams(temperature=0.9, n=2, max_tokens=16, seed=3, eos_token_id=list(range(0, 64, 8)))
        outs, replays = [], []

        class Graph:  # what replaying a captured body does, without CUDA
            def __init__(self, body):
                self.body = body

            def replay(self):
                replays.append(1)
                self.body()

        for graphed in (False, True):
            engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24, max_num_seqs=8,
                                                  max_num_batched_tokens=12), device="cpu")
            engine.load_weights(model.named_parameters())
            runner = engine.runner
            runner.use_triton = graphed  # the reference on the PyTorch path: the interpreter runs it no faster
            if graphed:
                runner.capture_sizes = [2, 4, 8]
                runner._capture = lambda key, r=runner: r.graphs.__setitem__(
                    key, Graph(lambda: r._graphed_decode(key[0])))
            outs.append(engine.generate(prompts, sp))
        assert len(replays) == engine.last_stats["decode_steps"] > 4
        assert len({k[0] for k in engine.runner.graphs}) >= 2, engine.runner.graphs.keys()
        assert len({len(o.token_ids) for o in outs[1]}) >= 3
        err = interpreter.same_tokens(outs[1], outs[0])
        assert err <= 1e-4, f"log-probs differ by {err}"
        return err

    return locals()


interpreter_report, test_triton_kernel_matches_torch_under_interpreter, test_engine_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
