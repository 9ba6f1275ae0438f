"""OLMo-2's engine kernels (the post-norm residual add, the q / k norms over the whole projections) against the
PyTorch reference ops, on CPU under Triton's interpreter (`tests/interpreter.py`: the checks run in a child
process, and every launch they made is compiled for sm_90)."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["post_norm_add", "full_qk_norm", "engine_olmo2"]


def _checks() -> dict:
    import torch

    from rollout.ops import TorchOps
    from rollout.triton_kernels import QK_SUMS_BLOCK, TritonOps

    torch.manual_seed(0)
    torch.set_num_threads(1)

    close = interpreter.close

    def post_norm_add():
        # residual + norm(x) written into the residual in place; hidden 96 (not a power of two)
        errs = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x, res = torch.randn(5, 96, dtype=dtype) * 3, torch.randn(5, 96, dtype=dtype)
            w = (1 + 0.3 * torch.randn(96)).to(dtype)
            ref = TorchOps.post_norm_add(x, w, 1e-6, res.clone())
            got = TritonOps.post_norm_add(x, w, 1e-6, res)
            assert got.data_ptr() == res.data_ptr()
            errs.append(close(got, ref, tol))
        return max(errs)

    def full_qk_norm():
        # the sums of squares of q and k over rows wider than q | k | v (a strided view), q wider than the kernels'
        # block (a loop over it), then the norm by sums of a larger whole (another rank's columns counted in);
        # v and the columns past the view untouched
        errs = []
        hq, hkv, d = 6, 2, 200
        qw, kw = hq * d, hkv * d
        assert qw > QK_SUMS_BLOCK
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            wide = torch.randn(5, qw + 2 * kw + 8, dtype=dtype)
            qkv = wide[:, :qw + 2 * kw]
            sums = TritonOps.qk_square_sums(qkv, qw, kw)
            ref_sums = TorchOps.qk_square_sums(qkv, qw, kw)
            errs.append(close(sums, ref_sums, 1e-5 * ref_sums.abs().max().item()))
            sums = sums + torch.rand(5, 2) * 100  # the other ranks' columns
            qn, kn = (1 + 0.3 * torch.randn(qw)).to(dtype), (1 + 0.3 * torch.randn(kw)).to(dtype)
            ref = TorchOps.full_qk_norm(qkv.clone(), qn, kn, sums, (2 * qw, 2 * kw), 1e-6)
            before = wide.clone()
            got = TritonOps.full_qk_norm(qkv, qn, kn, sums, (2 * qw, 2 * kw), 1e-6)
            assert got.data_ptr() == qkv.data_ptr()
            assert torch.equal(wide[:, qw + kw:], before[:, qw + kw:])
            assert not torch.equal(wide[:, :qw + kw], before[:, :qw + kw])
            errs.append(close(got, ref, tol))
        return max(errs)

    def engine_olmo2():
        # an OLMo-2 model (post-norm blocks, whole-projection q/k norms, head_dim 16 against hidden / heads 8): the
        # Triton path's tokens are the PyTorch path's, in prefill and decode steps
        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         model_type="olmo2")
        engine = interpreter.cpu_engine(args, interpreter.random_model(args, norm_std=0.3))
        return interpreter.engine_matches_torch(engine)

    return locals()


interpreter_report, test_olmo2_kernel_matches_torch_under_interpreter, test_olmo2_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
