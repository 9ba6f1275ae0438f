"""Gemma 2 in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): Gemma 3's machinery without q /
k norms or a local RoPE, and its soft caps: the attention scores' on each rank's heads, the logits' on each rank's
vocabulary shard before the sampler merges them (caps of 0.5 and 1: small enough to bite on these weights)."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1
from tests.multiproc.test_olmo2_engine_tp import VARIANTS as OLMO2_VARIANTS

GEMMA2 = dict(model_type="gemma2", attn_logit_softcapping=0.5, final_logit_softcapping=1.0,
              extra_hf={"sliding_window": 4, "query_pre_attn_scalar": 12,
                        "layer_types": ["sliding_attention", "full_attention"]})
# OLMo-2's two shapes (KV heads one a rank and copied, tied and untied, with and without attention_bias) as Gemma 2s
VARIANTS = [{**variant, **GEMMA2} for variant in OLMO2_VARIANTS]


def test_gemma2_tp2_equals_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5)


def test_gemma2_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (the capped decode and prefill attention) against the PyTorch ops at TP 1."""
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5, triton=True)
