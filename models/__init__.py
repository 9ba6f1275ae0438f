"""The decoder-only transformer (Gemma 2 / Gemma 3 text / Granite / Llama / Mistral / Mixtral / OLMo-2 / OLMoE / Phi-3 / Qwen2 /
Qwen2-MoE / Qwen3 / Qwen3-MoE), its HF checkpoint I/O, its TP layout and LoRA adapters."""

import importlib

_EXPORTS = {
    "models.args": ("PEAK_BF16_FLOPS", "ModelArgs", "peak_bf16_flops", "torch_dtypes"),
    "models.checkpoint": ("iter_hf_tensors", "load_model_args"),
    "models.lora": ("LoRAConfig",),
    "models.parallel_plan": ("tp_narrow", "tp_shard_dim", "tp_shard_parts"),
    "models.transformer": ("Transformer", "cu_seqlens_from_lengths", "position_ids_from_lengths"),
}

__all__ = [
    "PEAK_BF16_FLOPS",
    "peak_bf16_flops",
    "torch_dtypes",
    "LoRAConfig",
    "ModelArgs",
    "Transformer",
    "cu_seqlens_from_lengths",
    "iter_hf_tensors",
    "load_model_args",
    "position_ids_from_lengths",
    "tp_narrow",
    "tp_shard_dim",
    "tp_shard_parts",
]


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `models` (or `models` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
