"""Gemma 3 in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): its vocab-parallel embedding
scaled after the all-reduce, its replicated norms by 1 + weight (four a block and the per-head q / k norms), its
GeGLU MLP split by columns, o_proj's bias added once, each layer its RoPE and window (one sliding layer with a
window of 4 and its own RoPE base, one full)."""

from tests.multiproc.engine_tp_family import run_family_tp2_equals_tp1
from tests.multiproc.test_olmo2_engine_tp import VARIANTS as OLMO2_VARIANTS

GEMMA3 = dict(model_type="gemma3_text", extra_hf={"sliding_window": 4, "query_pre_attn_scalar": 12,
                                                  "layer_types": ["sliding_attention", "full_attention"],
                                                  "rope_local_base_freq": 100.0})
# OLMo-2's two shapes (KV heads one a rank and copied, tied and untied, with and without attention_bias) as Gemma 3s
VARIANTS = [{**variant, **GEMMA3} for variant in OLMO2_VARIANTS]


def test_gemma3_tp2_equals_tp1():
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5)


def test_gemma3_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (norms by 1 + weight, GeGLU, each layer's RoPE table and window) against the PyTorch
    ops at TP 1."""
    run_family_tp2_equals_tp1(VARIANTS, norm_std=0.5, triton=True)
