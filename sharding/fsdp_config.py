"""`fsdp_config` as the trainer's config reads it: the FSDP2 options, their dtypes and checks.

Apart from `sharding.fsdp` (which applies them) so that reading and checking a config loads neither
FSDP2 nor the model (`trainer.config` imports this module; `sharding.fsdp` imports it from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from models.args import HF_FAMILY, torch_dtypes

_FP16 = ("fp16", "float16", "16", "half")
_DTYPES = {k: v for k, v in torch_dtypes().items() if k not in _FP16}
# meshppo's block and the Hugging Face classes a verl config names for the same layer.
# meshppo's block and transformers' decoder-layer class of every family it builds (`models.args.HF_FAMILY`:
# Qwen3MoeDecoderLayer, MixtralDecoderLayer, ...), the names a verl config's transformer_layer_cls_to_wrap gives
_BLOCK_CLASS_NAMES = ("TransformerBlock", *sorted({f"{family}DecoderLayer" for family in HF_FAMILY.values()}))
_WRAP_POLICY_KEYS = ("min_num_params", "transformer_layer_cls_to_wrap")


def torch_dtype(name: str, key: str) -> torch.dtype:
    """`"bf16"` / `"fp32"` (and long spellings) → torch dtype; `key` names the config field in errors."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name in _FP16:
        raise ValueError(f"{key}={name!r} is not supported: fp16 needs loss scaling, which meshppo does not do; use bf16")
    if name not in _DTYPES:
        raise ValueError(f"{key}={name!r} is not a dtype meshppo knows; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[name]


@dataclass
class MixedPrecisionConfig:
    """verl's `fsdp_config.mixed_precision`. verl's default is null, which its engine reads as these
    defaults (bf16 compute, fp32 reduction and buffers): null is the section's defaults here too."""

    NULL_IS_DEFAULT: ClassVar[bool] = True

    param_dtype: str = field(default="bf16", metadata={"help": "dtype parameters are all-gathered and computed in on GPUs (CPU runs compute in model_dtype)"})
    reduce_dtype: str = field(default="fp32", metadata={"help": "dtype gradients are reduce-scattered (averaged) in"})
    buffer_dtype: str = field(default="fp32", metadata={"help": "dtype of module buffers (RoPE frequencies); only fp32"})

    def __post_init__(self):
        torch_dtype(self.param_dtype, "mixed_precision.param_dtype")
        torch_dtype(self.reduce_dtype, "mixed_precision.reduce_dtype")
        if torch_dtype(self.buffer_dtype, "mixed_precision.buffer_dtype") != torch.float32:
            raise ValueError(f"mixed_precision.buffer_dtype={self.buffer_dtype!r} is not supported: the only buffer is "
                             f"the RoPE frequency table, which meshppo keeps in fp32")


@dataclass
class FSDPConfig:
    """verl's `fsdp_config` (actor, ref and critic each have one)."""

    param_offload: bool = field(default=False, metadata={
        "help": "move the sharded parameters to CPU between phases (offload_states / load_states)"})
    optimizer_offload: bool = field(default=False, metadata={
        "help": "move the optimizer states to CPU between phases (offload_states / load_states)"})
    offload_policy: bool = field(default=False, metadata={
        "help": "FSDP2 CPUOffloadPolicy: parameters, gradients and the optimizer step live on CPU permanently"})
    reshard_after_forward: bool = field(default=True, metadata={
        "help": "free gathered parameters after forward and gather again in backward (ZeRO-3); False: ZeRO-2-like "
                "(a frozen reference: keep them gathered between forwards, the whole model per rank)"})
    fsdp_size: int = field(default=-1, metadata={
        "help": "-1: FULL_SHARD over all ranks; N: HYBRID_SHARD, shard over groups of N ranks, replicate across "
                "(the actor's value builds the one training mesh; ref / critic: -1 or the same)"})
    forward_prefetch: bool = field(default=False, metadata={
        "help": "explicit prefetch chains: gather the next unit in forward (previous in backward) while computing "
                "(nothing to gather with shard groups of one rank: one GPU, fsdp_size=1)"})
    model_dtype: str = field(default="fp32", metadata={
        "help": "dtype of the sharded (master) parameters: fp32 to train, bf16 is enough for a frozen reference"})
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig, metadata={
        "help": "compute / reduce dtypes (param_dtype, reduce_dtype, buffer_dtype)"})
    wrap_policy: dict = field(default_factory=lambda: {"min_num_params": 0}, metadata={
        "help": "min_num_params: 0 = one FSDP unit per block, N = consecutive blocks grouped into units of >= N "
                "params; transformer_layer_cls_to_wrap may only name the decoder block (always wrapped); with shard "
                "groups of one rank there are no units (sharding.replicate)"})

    def __post_init__(self):
        if self.mixed_precision is None:
            self.mixed_precision = MixedPrecisionConfig()
        if isinstance(self.mixed_precision, dict):
            known = {f.name for f in fields(MixedPrecisionConfig)}
            unknown = set(self.mixed_precision) - known
            if unknown:
                raise ValueError(f"fsdp_config.mixed_precision has unknown keys {sorted(unknown)}; known: {sorted(known)}")
            self.mixed_precision = MixedPrecisionConfig(**self.mixed_precision)
        for name in ("param_offload", "optimizer_offload", "offload_policy", "reshard_after_forward", "forward_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fsdp_config.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.fsdp_size, int) or self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(f"fsdp_config.fsdp_size must be -1 or a positive integer, got {self.fsdp_size!r}")
        torch_dtype(self.model_dtype, "fsdp_config.model_dtype")
        if self.offload_policy and (self.param_offload or self.optimizer_offload):
            raise ValueError("fsdp_config.offload_policy keeps parameters and optimizer states on CPU permanently; "
                             "param_offload / optimizer_offload (moving them between phases) are then meaningless: "
                             "set them to false")
        if not isinstance(self.wrap_policy, dict):
            raise ValueError(f"fsdp_config.wrap_policy must be a mapping, got {self.wrap_policy!r}")
        unknown = set(self.wrap_policy) - set(_WRAP_POLICY_KEYS)
        if unknown:
            raise ValueError(f"fsdp_config.wrap_policy keys {sorted(unknown)} are not supported; meshppo wraps "
                             f"transformer blocks and supports {list(_WRAP_POLICY_KEYS)}")
        mnp = self.wrap_policy.get("min_num_params", 0)
        if isinstance(mnp, bool) or not isinstance(mnp, int) or mnp < 0:
            raise ValueError(f"fsdp_config.wrap_policy.min_num_params must be a non-negative integer, got {mnp!r}")
        classes = self.wrap_policy.get("transformer_layer_cls_to_wrap")
        if classes is not None:
            classes = [classes] if isinstance(classes, str) else list(classes)
            bad = [c for c in classes if c not in _BLOCK_CLASS_NAMES]
            if bad:
                raise ValueError(f"fsdp_config.wrap_policy.transformer_layer_cls_to_wrap={bad} is not supported: "
                                 f"meshppo wraps its decoder blocks (one of {list(_BLOCK_CLASS_NAMES)})")

    @property
    def param_torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.mixed_precision.param_dtype, "mixed_precision.param_dtype")

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.mixed_precision.reduce_dtype, "mixed_precision.reduce_dtype")

    @property
    def model_torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.model_dtype, "fsdp_config.model_dtype")
