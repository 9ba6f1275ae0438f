"""A Qwen3-MoE engine's Triton path against its PyTorch path (the attention, norm and sampling kernels around the
experts, which both paths run through models.moe), on CPU under Triton's interpreter (`tests/interpreter.py`: the
checks run in a child process, and every launch they made is compiled for sm_90): a sparse and a dense layer with a
sliding window, and a model whose every layer is sparse."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["engine_qwen3_moe_mixed", "engine_qwen3_moe_all_sparse"]


def _checks() -> dict:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def engine(**kw):
        # the Triton path's tokens are the PyTorch path's, in prefill and decode steps, with several samples a prompt
        from models import ModelArgs, Transformer
        from rollout import EngineConfig, LLMEngine, SamplingParams

        args = ModelArgs(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, model_type="qwen3_moe", num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16), **kw})
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
        engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=16,
                                              max_num_batched_tokens=8), device="cpu")
        engine.load_weights(model.named_parameters())
        assert engine.model.args.moe_layers
        prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
        sp = SamplingParams(temperature=0.9, n=2, max_tokens=4, seed=1)
        ref = engine.generate(prompts, sp)
        engine.runner.use_triton = True
        got = engine.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        err = max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x.logprobs, y.logprobs))
        assert err <= 1e-4, err
        return err

    def engine_qwen3_moe_mixed():
        return engine(mlp_only_layers=(1,), norm_topk_prob=False, extra_hf={"use_sliding_window": True,
                                                                           "sliding_window": 5})

    def engine_qwen3_moe_all_sparse():
        return engine(norm_topk_prob=True)

    scope = locals()
    return {name: scope[name] for name in CHECKS}


interpreter_report, test_qwen3_moe_engine_matches_torch_under_interpreter, test_qwen3_moe_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks())
