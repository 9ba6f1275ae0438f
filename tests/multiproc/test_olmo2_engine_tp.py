"""OLMo-2 in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): its q / k norms span the
whole q and k projections, whose columns TP splits over the ranks, so each rank norms its heads by the sums of
squares of every rank's (an all-reduce), its KV heads' copy too where the ranks replicate one KV head."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1


# 2 KV heads (one a rank) with tied embeddings and attention_bias (o_proj's bias added once, after the all-reduce);
# 1 KV head (each rank a copy) with an explicit head_dim, untied. Norm weights far from 1 and apart per column (a
# wrong slice shows): a norm by this rank's columns alone, or by the wrong part of its weight, moves the log-probs
# by > 1e-2
VARIANTS = [dict(num_key_value_heads=kv, head_dim=head_dim, model_type="olmo2", tie_word_embeddings=tied,
                 attention_bias=tied) for kv, head_dim, tied in ((2, None, True), (1, 24, False))]


def test_olmo2_tp2_equals_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5)


def test_olmo2_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (the sums of squares, the norm by them, the post-norm residual add) against the
    PyTorch ops at TP 1."""
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5, triton=True)
