"""Qwen3-MoE in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): the router replicated, each
rank's rows of every expert's gate and up projections and its columns of every down projection, the layer's output
all-reduced once; a sparse and a dense layer (mlp_only_layers) with the top-2 weights as they are, and two sparse
layers renormalised over one KV head (copied on both ranks) with tied embeddings."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
VARIANTS = [dict(MOE, num_key_value_heads=2, head_dim=16, mlp_only_layers=(1,), norm_topk_prob=False),
            dict(MOE, num_key_value_heads=1, norm_topk_prob=True, tie_word_embeddings=True)]


def test_qwen3_moe_tp2_equals_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.1)


def test_qwen3_moe_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (the attention's, the norms'; the experts run through models.moe) against the
    PyTorch ops at TP 1."""
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.1, triton=True)
