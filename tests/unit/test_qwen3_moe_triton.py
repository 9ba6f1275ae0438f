"""A Qwen3-MoE engine's Triton path against its PyTorch path (the attention, norm and sampling kernels around the
experts, which both paths run through models.moe), on CPU under Triton's interpreter (`tests/interpreter.py`: the
checks run in a child process, and every launch they made is compiled for sm_90): a sparse and a dense layer with a
sliding window, and a model whose every layer is sparse; a Qwen2-MoE's sparse layer, whose shared expert runs through
the Triton path's gated and plain projections, beside a dense one; a Granite-MoE-Shared's (every layer sparse, its
router's softmax over the top-k logits, its ungated shared expert, Granite's scalars)."""

from __future__ import annotations

from tests import interpreter

CHECKS = ["engine_qwen3_moe_mixed", "engine_qwen3_moe_all_sparse", "engine_qwen2_moe_shared_expert",
          "engine_granite_moe_shared_expert"]


def _checks() -> dict:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def engine(**kw):
        # the Triton path's tokens are the PyTorch path's, in prefill and decode steps, with several samples a prompt
        from models import ModelArgs

        args = ModelArgs(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, model_type="qwen3_moe", num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16), **kw})
        engine = interpreter.cpu_engine(args, interpreter.random_model(args, norm_std=0.1))
        assert engine.model.args.moe_layers
        return interpreter.engine_matches_torch(engine)

    def engine_qwen3_moe_mixed():
        return engine(mlp_only_layers=(1,), norm_topk_prob=False, extra_hf={"use_sliding_window": True,
                                                                           "sliding_window": 5})

    def engine_qwen3_moe_all_sparse():
        return engine(norm_topk_prob=True)

    def engine_qwen2_moe_shared_expert():
        return engine(model_type="qwen2_moe", head_dim=None, attention_bias=True, shared_expert_intermediate_size=32,
                      mlp_only_layers=(1,))

    def engine_granite_moe_shared_expert():
        return engine(model_type="granitemoeshared", head_dim=None, intermediate_size=16, norm_topk_prob=True,
                      shared_expert_intermediate_size=32, embedding_multiplier=2.0, residual_multiplier=0.5,
                      attention_multiplier=0.25, logits_scaling=2.0)

    return locals()


interpreter_report, test_qwen3_moe_engine_matches_torch_under_interpreter, test_qwen3_moe_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
