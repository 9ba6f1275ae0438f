"""Gemma 3's engine kernels (norms by 1 + weight: the residual RMSNorm, the per-head q / k norm at head_dim 256, the
post-norm residual add; the GeGLU activation and one-row gated GEMV) against the PyTorch reference ops, and an
engine's Triton path against its PyTorch path (head_dim 16 with a sliding layer, and head_dim 256: Gemma 3's), on
CPU under Triton's interpreter (`tests/interpreter.py`: the checks run in a child process, and every launch they
made is compiled for sm_90, its shared memory within a Hopper block's)."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["unit_offset_norms", "geglu", "engine_gemma3", "engine_gemma3_head_dim_256", "engine_gemma3_fp16"]


def _checks() -> dict:
    import torch

    from rollout.ops import TorchOps
    from rollout.triton_kernels import TritonOps

    torch.manual_seed(0)
    torch.set_num_threads(1)

    close = interpreter.close

    def unit_offset_norms():
        # each against TorchOps with unit_offset, and far from the norm by the weight alone; hidden 96 (not a power
        # of two), q / k heads of 256 (gemma-3-1b: 4 query heads, 1 KV head)
        errs = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x, res = torch.randn(5, 96, dtype=dtype) * 3, torch.randn(5, 96, dtype=dtype)
            w = (0.3 * torch.randn(96)).to(dtype)
            for residual in (None, res):
                r1 = None if residual is None else residual.clone()
                ref, ref_sum = TorchOps.rms_norm(x, w, 1e-6, r1, unit_offset=True)
                r2 = None if residual is None else residual.clone()
                got, got_sum = TritonOps.rms_norm(x, w, 1e-6, r2, unit_offset=True)
                errs.append(close(got, ref, tol))
                errs.append(close(got_sum, ref_sum, 0))
                assert (got.float() - TorchOps.rms_norm(x, w, 1e-6, residual)[0].float()).abs().max() > 0.5
            ref = TorchOps.post_norm_add(x, w, 1e-6, res.clone(), unit_offset=True)
            got = TritonOps.post_norm_add(x, w, 1e-6, res.clone(), unit_offset=True)
            errs.append(close(got, ref, tol))
            hq, hkv, d = 4, 1, 256
            qkv = torch.randn(3, (hq + 2 * hkv) * d, dtype=dtype) * 2
            qn, kn = (0.3 * torch.randn(d)).to(dtype), (0.3 * torch.randn(d)).to(dtype)
            ref = TorchOps.qk_norm(qkv.clone(), qn, kn, hq, hkv, d, 1e-6, unit_offset=True)
            got = TritonOps.qk_norm(qkv.clone(), qn, kn, hq, hkv, d, 1e-6, unit_offset=True)
            errs.append(close(got, ref, tol))
            assert torch.equal(got[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # v untouched
        return max(errs)

    def geglu():
        # GeGLU of several rows (the activation kernel) and of one row (the gated GEMV), with and without a bias
        errs = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            gate_up = (torch.randn(6, 2 * 72) * 2).to(dtype)
            ref = TorchOps.silu_and_mul(gate_up, act="gelu_tanh")
            errs.append(close(TritonOps.silu_and_mul(gate_up, act="gelu_tanh"), ref, tol))
            assert (ref.float() - TorchOps.silu_and_mul(gate_up).float()).abs().max() > 1e-2
            x, w = torch.randn(1, 48).to(dtype), (torch.randn(2 * 72, 48) / 7).to(dtype)
            for b in (None, torch.randn(2 * 72).to(dtype)):
                ref = TorchOps.gated_linear(x, w, b, act="gelu_tanh")
                errs.append(close(TritonOps.gated_linear(x, w, b, act="gelu_tanh"), ref, tol))
        return max(errs)

    def engine(head_dim: int, layers: list[str], window: int, dtype=torch.float32):
        # a Gemma 3 model: the Triton path's tokens are the PyTorch path's, in prefill and decode steps
        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64,
                         model_type="gemma3_text", extra_hf={"sliding_window": window, "layer_types": layers,
                                                             "query_pre_attn_scalar": 12})
        engine = interpreter.cpu_engine(args, interpreter.random_model(args, norm_mean=0.0, norm_std=0.3), dtype)
        if dtype == torch.float32:
            return interpreter.engine_matches_torch(engine)
        return interpreter.engine_matches_torch(engine, [(interpreter.PROMPTS, interpreter.greedy())], tol=1e-2)

    def engine_gemma3():
        return engine(16, ["sliding_attention", "full_attention"], 3)

    def engine_gemma3_head_dim_256():
        return engine(256, ["sliding_attention"], 5)

    def engine_gemma3_fp16():
        # 16-bit at head_dim 256 (Gemma 3's): the attention tiles a bf16 engine launches on the GPU (bf16 itself: this
        # interpreter's bf16 rounding is not the GPU's, tests/unit/test_block_triton.py); greedy tokens equal, the
        # log-probs within fp16's rounding
        return engine(256, ["sliding_attention", "full_attention"], 5, torch.float16)

    return locals()


interpreter_report, test_gemma3_kernel_matches_torch_under_interpreter, test_gemma3_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
