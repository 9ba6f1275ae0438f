"""Gemma 2's soft caps in the engine's Triton kernels: the decode and prefill attention with SOFTCAP against the
PyTorch reference (decode with one split, where RoPE and the K/V write are fused, and with several; prefill over
chunks with a cached prefix), and an engine's Triton path against its PyTorch path on a capped Gemma 2 (head_dim 16
with a sliding layer, head_dim 256: Gemma 2's), on CPU under Triton's interpreter (`tests/interpreter.py`: the
checks run in a child process, and every launch they made is compiled for sm_90). The caps are small (1 on the
attention, 2 on the logits) so that they bite: each check also holds the uncapped result far from the capped one."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["capped_attention", "engine_gemma2", "engine_gemma2_head_dim_256"]


def _checks() -> dict:
    import torch

    from rollout.attention import AttentionMetadata
    from rollout.ops import TorchOps
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
