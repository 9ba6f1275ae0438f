"""Granite in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): its embedding_multiplier after
the vocab-parallel embedding's all-reduce, its residual_multiplier on each all-reduced branch output (o_proj's bias,
with attention_bias, added once before it), its attention_multiplier and its logits_scaling over the vocab-parallel
sampler."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1


# 2 KV heads (one a rank) with tied embeddings and attention_bias / mlp_bias; 1 KV head (each rank a copy), untied.
# A scalar applied per rank before an all-reduce that sums it, or a bias scaled twice, moves the log-probs by > 1e-2
VARIANTS = [dict(num_key_value_heads=kv, model_type="granite", tie_word_embeddings=tied, attention_bias=tied,
                 mlp_bias=tied, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09,
                 logits_scaling=2.5) for kv, tied in ((2, True), (1, False))]


def test_granite_tp2_equals_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.3)


def test_granite_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (the residual add scaled by residual_multiplier, the sampler with logits_scaling)
    against the PyTorch ops at TP 1."""
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.3, triton=True)
