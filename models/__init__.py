"""The decoder-only transformer (Gemma 2 / Gemma 3 text / Granite / Llama / Mistral / Mixtral / OLMo-2 / OLMoE / Phi-3 / Qwen2 /
Qwen2-MoE / Qwen3 / Qwen3-MoE), its HF checkpoint I/O, its TP layout and LoRA adapters."""

from models.lazy import lazy_exports

_EXPORTS = {
    "models.args": ("PEAK_BF16_FLOPS", "ModelArgs", "peak_bf16_flops", "torch_dtypes"),
    "models.checkpoint": ("iter_hf_tensors", "load_model_args"),
    "models.lora": ("LoRAConfig",),
    "models.parallel_plan": ("tp_narrow", "tp_shard_dim", "tp_shard_parts"),
    "models.transformer": ("Transformer", "cu_seqlens_from_lengths", "position_ids_from_lengths"),
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
