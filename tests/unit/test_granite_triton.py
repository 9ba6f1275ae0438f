"""Granite's scalars on the Triton paths, on CPU under Triton's interpreter (`tests/interpreter.py`: the checks run
in a child process, and every launch they made is compiled for sm_90): the engine's residual add scaled by
residual_multiplier (`rms_norm`'s `scale`) against the PyTorch op, a Granite engine's Triton path against its
PyTorch path, and the trainer's fused LM head with logits_scaling against float64."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["rms_norm_scale", "engine_granite", "lm_head_granite"]


def _checks() -> dict:
    import torch

    from rollout.ops import TorchOps
    from rollout.triton_kernels import TritonOps

    torch.manual_seed(0)
    torch.set_num_threads(1)

    close = interpreter.close

    def granite(attention_bias):
        from models import ModelArgs

        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, model_type="granite",
                         attention_bias=attention_bias, mlp_bias=attention_bias, embedding_multiplier=3.0,
                         residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5)
        return args, interpreter.random_model(args, norm_std=0.3)

    def rms_norm_scale():
        # a branch output times 0.4 before the residual add: plain rows, split-K products (float32, summed first),
        # an fp8 projection's scaled rows; hidden 96 (not a power of two)
        errs = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            res = torch.randn(5, 96, dtype=dtype)
            w = (1 + 0.3 * torch.randn(96)).to(dtype)
            for x, x_scale in ((3 * torch.randn(5, 96, dtype=dtype), None), (torch.randn(2, 5, 96), None),
                               (3 * torch.randn(5, 96, dtype=dtype), torch.rand(5) + 0.5)):
                ref_out, ref_res = TorchOps.rms_norm(x, w, 1e-6, res.clone(), x_scale, scale=0.4)
                unscaled = TorchOps.rms_norm(x, w, 1e-6, res.clone(), x_scale)[1]
                assert (unscaled - ref_res).abs().max() > 0.1  # the scale acts
                got_res = res.clone()
                out, back = TritonOps.rms_norm(x, w, 1e-6, got_res, x_scale, scale=0.4)
                assert back.data_ptr() == got_res.data_ptr()
                errs += [close(out, ref_out, tol), close(got_res, ref_res, tol)]
        return max(errs)

    def engine_granite():
        # a Granite model (the four scalars; with attention_bias and mlp_bias, o_proj's bias): the Triton path's
        # tokens and log-probs are the PyTorch path's, in prefill and decode steps, sampled and greedy
        runs = [(interpreter.PROMPTS, interpreter.sampled()), (interpreter.PROMPTS, interpreter.greedy())]
        return max(interpreter.engine_matches_torch(interpreter.cpu_engine(*granite(bias)), runs)
                   for bias in (False, True))

    def lm_head_granite():
        # the trainer's log-probs and entropy through the Triton LM head (forced, float32) at a temperature and at
        # 0 (greedy's, scored at 1): float64 softmax of the model's logits, which are divided by logits_scaling
        import os

        from models import lm_head_triton

        _, model = granite(False)
        calls, stats = [], lm_head_triton.logit_stats

        def counted(*args, **kwargs):
            calls.append(1)
            return stats(*args, **kwargs)

        lm_head_triton.logit_stats = counted
        os.environ["MESHPPO_LM_HEAD"] = "triton"
        try:
            ids = torch.randint(0, 64, (2, 12))
            labels = torch.roll(ids, -1, 1)
            errs = []
            for temperature in (0.7, 0.0):
                with torch.no_grad():
                    logits = model.double()(ids).double()
                    model.float()
                    logp, ent = model(ids, labels=labels, temperature=temperature, with_entropy=True, chunk_size=5)
                log_p = torch.log_softmax(logits / (temperature or 1.0), -1)
                errs += [close(logp, log_p.gather(-1, labels[..., None])[..., 0], 1e-5),
                         close(ent, -(log_p.exp() * log_p).sum(-1), 1e-5)]
            assert calls, "the Triton LM head did not run"
        finally:
            lm_head_triton.logit_stats = stats
            del os.environ["MESHPPO_LM_HEAD"]
        return max(errs)

    return locals()


interpreter_report, test_granite_kernel_matches_torch_under_interpreter, test_granite_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
