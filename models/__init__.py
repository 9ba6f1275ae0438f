"""The decoder-only transformer (Gemma 2 / Gemma 3 text / Granite / Llama / Mistral / Mixtral / OLMo-2 / OLMoE / Phi-3 / Qwen2 /
Qwen2-MoE / Qwen3 / Qwen3-MoE), its HF checkpoint I/O, its TP layout and LoRA adapters."""

from models.args import PEAK_BF16_FLOPS, ModelArgs, peak_bf16_flops, torch_dtypes
from models.checkpoint import iter_hf_tensors, load_model_args
from models.lora import LoRAConfig
from models.parallel_plan import tp_narrow, tp_shard_dim, tp_shard_parts
from models.transformer import Transformer, cu_seqlens_from_lengths, position_ids_from_lengths

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
