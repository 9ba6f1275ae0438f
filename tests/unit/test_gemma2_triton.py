"""Gemma 2's soft caps in the engine's Triton kernels: the decode and prefill attention with SOFTCAP against the
PyTorch reference (decode with one split, where RoPE and the K/V write are fused, and with several; prefill over
chunks with a cached prefix), the sampler's race capping the logits it reads (SOFTCAP) against `soft_cap` then the
uncapped race, and an engine's Triton path against its PyTorch path on a capped Gemma 2 (head_dim 16 with a sliding
layer, head_dim 256: Gemma 2's), on CPU under Triton's interpreter (`tests/interpreter.py`: the checks run in a child
process, and every launch they made is compiled for sm_90). The caps are small (1 on the attention, 2 on the logits;
the sampler's 30, Gemma 2's, and 5) so that they bite: each check also holds the uncapped result far from the capped
one."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["capped_attention", "capped_sampler", "engine_gemma2", "engine_gemma2_head_dim_256"]


def _checks() -> dict:
    import itertools

    import torch

    from rollout.attention import AttentionMetadata
    from rollout.ops import TorchOps
    from rollout.sampler import combine_partials as combine_ref
    from rollout.triton_kernels import TritonOps

    torch.manual_seed(0)
    torch.set_num_threads(1)

    close = interpreter.close

    def capped_attention():
        # 3 sequences in a cache of 4-token blocks; scores of several units (q, k ~ 3 N(0, 1), scale 1/4) against a
        # cap of 1; a window of 5 on half the calls
        errs = []
        hq, hkv, d, bs, cap = 4, 2, 16, 4, 1.0
        k_cache, v_cache = torch.randn(12, bs, hkv, d) * 3, torch.randn(12, bs, hkv, d)
        block_tables = torch.arange(12, dtype=torch.int32).view(3, 4)
        slots = torch.arange(3, dtype=torch.int32)
        ctx = [7, 13, 16]
        cos, sin = torch.ones(32, d // 2), torch.zeros(32, d // 2)  # RoPE by angle 0: the cache as it is
        for window in (None, 5):
            for splits in (1, 3):
                qkv = torch.randn(3, (hq + 2 * hkv) * d) * 3
                meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(ctx, dtype=torch.int32),
                                         max_context_len=16, num_splits=splits)
                pos = meta.context_lens - 1
                outs = [ops.decode_attention(qkv.clone(), pos, cos, sin, k_cache.clone(), v_cache.clone(), block_tables,
                                             meta, 0.25, hq, hkv, d, window=window, softcap=c)
                        for ops, c in ((TritonOps, cap), (TorchOps, cap), (TorchOps, None))]
                errs.append(close(outs[0], outs[1], 1e-5))
                assert (outs[1] - outs[2]).abs().max() > 1e-2
            meta = AttentionMetadata.prefill(slots, [3, 9, 1], ctx)
            q = torch.randn(13, hq, d) * 3
            outs = [ops.prefill_attention(q, k_cache, v_cache, block_tables, meta, 0.25, window=window, softcap=c)
                    for ops, c in ((TritonOps, cap), (TorchOps, cap), (TorchOps, None))]
            errs.append(close(outs[0], outs[1], 1e-5))
            assert (outs[1] - outs[2]).abs().max() > 1e-2
        return max(errs)

    def capped_sampler():
        # The race over logits [4, 528] capped in the kernel (`TritonOps.sample_partials(..., softcap)`) against the
        # explicit path, `soft_cap` in PyTorch then the uncapped reference race, on the same keys: greedy and T = 0.7,
        # a top-k threshold on the capped scores or none, groups of 1 and 16, 1 and 3 splits. In bf16 (the
        # interpreter's conversions rounded to nearest even, as the GPU's) the kernel's capped values are PyTorch's bit
        # for bit wherever |logit| >= 2**-8 (below, the approximate tanh is off by up to ~4e-6; no logit here is that
        # small): the winner's s and each split's max s are the explicit path's exactly, the tokens equal, the
        # log-probs within float32 rounding. In float32 (nothing rounded between the steps) the tanh's few ulps:
        # s within 1e-5. Row 0 holds 8 and 12 caps, both capped to the cap in bf16: greedy takes the first.
        from models.attention import soft_cap
        from rollout.parallel import TPGroup
        from rollout.sampler import Sampler, truncation_threshold

        r, v = 4, 528
        keys = torch.randint(-2**31, 2**31 - 1, (r,), dtype=torch.int32)
        pos = torch.arange(r, dtype=torch.int32) * 5
        errs = []
        with interpreter.bf16_rounds_to_nearest_even():
            for cap in (30.0, 5.0):
                raw = torch.randn(r, v) * cap
                raw = torch.where(raw.abs() < 2**-8, 2**-8, raw)
                raw[0, 10], raw[0, 300] = 8 * cap, 12 * cap
                for dtype in (torch.bfloat16, torch.float32):
                    x = raw.to(dtype)
                    capped = soft_cap(x, cap)
                    for temperature in (0.0, 0.7):
                        inv_t = torch.tensor(1.0 if temperature == 0 else 1 / temperature)
                        noise = torch.tensor(0.0 if temperature == 0 else 1.0)
                        s = capped.float() * inv_t
                        top = truncation_threshold(s, 20, 1.0)
                        for thresh, group in itertools.product((None, top), (1, 16)):
                            want = combine_ref(TorchOps.sample_partials(capped, keys, pos, inv_t, noise, thresh, 0, 1,
                                                                        group))
                            for splits in (1, 3):
                                parts = TritonOps.sample_partials(x, keys, pos, inv_t, noise, thresh, 0, splits, group,
                                                                  cap)
                                got = combine_ref(parts)
                                assert torch.equal(got[0], want[0]), (cap, dtype, temperature, group, splits)
                                errs.append(close(got[1], want[1], 1e-5))
                                s_win = parts[..., 2].gather(1, parts[..., 0].argmax(1, keepdim=True))[:, 0]
                                s_tok, m = s.gather(1, got[0][:, None])[:, 0], s.max(-1).values
                                tol = 0.0 if dtype == torch.bfloat16 else 1e-5
                                close(s_win, s_tok, tol)
                                close(parts[..., 3].max(-1).values, m, tol)
                                if thresh is not None:
                                    assert (s_tok >= thresh).all()
                                if temperature == 0:
                                    assert torch.equal(got[0], s.argmax(-1))
                                    if dtype == torch.bfloat16:
                                        assert got[0][0] == 10 and raw[0].argmax() == 300
                        uncapped = combine_ref(TritonOps.sample_partials(x, keys, pos, inv_t, noise, None, 0, 1, 16))
                        assert (uncapped[1] - want[1]).abs().max() > 0.1
                    # `Sampler.sample` (the runner's call: the cap in the race, or with top-k / top-p once in PyTorch
                    # before the threshold) and a call with its threshold: the explicit path's tokens and log-probs
                    sampler, plain = Sampler(TPGroup(None), v, "cpu", softcap=cap), Sampler(TPGroup(None), v, "cpu")
                    for params in ((0.0, -1, 1.0), (0.8, -1, 1.0), (0.8, 20, 0.9)):
                        sampler.set_params(*params)
                        plain.set_params(*params)
                        want = plain(capped, keys, pos, TorchOps, plain.threshold(capped))
                        for got in (sampler.sample(x, keys, pos, TritonOps, 3),
                                    sampler(x, keys, pos, TritonOps, sampler.threshold(x), 2)):
                            assert torch.equal(got[0], want[0]), (cap, dtype, params)
                            errs.append(close(got[1], want[1], 1e-5))
        return max(errs)

    def engine(head_dim: int, layers: list[str], window: int):
        # a capped Gemma 2: the Triton path's tokens are the PyTorch path's (sampled: the sampler reads the capped
        # logits), and the caps move the PyTorch path's log-probs
        import dataclasses

        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64,
                         model_type="gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                         extra_hf={"sliding_window": window, "layer_types": layers, "query_pre_attn_scalar": 12})
        model = interpreter.random_model(args, norm_mean=0.0, norm_std=0.3)
        uncapped = interpreter.cpu_engine(dataclasses.replace(args, attn_logit_softcapping=None,
                                                              final_logit_softcapping=None), model)
        engine = interpreter.cpu_engine(args, model)
        runs = [(interpreter.PROMPTS, interpreter.greedy())]
        capped_lp = engine.generate(*runs[0])
        assert interpreter.logprob_gap(capped_lp, uncapped.generate(*runs[0])) > 1e-2
        return interpreter.engine_matches_torch(engine, runs + [(interpreter.PROMPTS, interpreter.sampled())])

    def engine_gemma2():
        return engine(16, ["sliding_attention", "full_attention"], 3)

    def engine_gemma2_head_dim_256():
        return engine(256, ["sliding_attention"], 5)

    return locals()


interpreter_report, test_gemma2_kernel_matches_torch_under_interpreter, test_gemma2_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
