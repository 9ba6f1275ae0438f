"""Mixtral, OLMoE, Qwen2-MoE and Granite-MoE(-Shared) in the engine at TP 2 over two gloo processes equal TP 1
(float32, CPU): every layer
sparse (the router replicated, each rank's rows of every expert's gate and up projections and its columns of every down
projection, one all-reduce), Mixtral's top-2 weights renormalised in float32 over GQA, OLMoE's q / k norms over the
whole projections (their sums of squares all-reduced across the ranks) with attention biases; a Qwen2-MoE's sparse
layer beside a dense one, its shared expert sharded as a dense MLP (its gate replicated) and summed with the routed
experts in the layer's one all-reduce; a Granite-MoE's router (the softmax over the top-2 logits) with Granite's
scalars, and a Granite-MoE-Shared's ungated shared expert sharded the same way."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)  # (the helper's intermediate_size)
VARIANTS = [dict(MOE, model_type="mixtral", num_key_value_heads=2, norm_topk_prob=True),
            dict(MOE, model_type="olmoe", num_key_value_heads=2, attention_bias=True, norm_topk_prob=False),
            dict(MOE, model_type="qwen2_moe", num_key_value_heads=2, attention_bias=True, norm_topk_prob=False,
                 moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=(1,)),
            dict(MOE, model_type="granitemoe", num_key_value_heads=2, attention_bias=True, norm_topk_prob=True,
                 embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0),
            dict(MOE, model_type="granitemoeshared", num_key_value_heads=2, norm_topk_prob=True,
                 shared_expert_intermediate_size=64, residual_multiplier=0.5)]


def test_mixtral_olmoe_qwen2_moe_and_granite_moe_tp2_equal_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.1)
