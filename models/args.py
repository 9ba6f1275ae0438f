"""Model hyper-parameters for the Gemma 2 / Gemma 3 (text) / Granite / Granite-MoE (and its shared-expert variant) / Llama /
Mistral / Mixtral / OLMo-2 / OLMoE / Phi-3 / Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE decoder family.

`ModelArgs` is the one description of a model shape that the training model, the engine and
the benchmarks share. It converts from and to a Hugging Face config, so a checkpoint written
by meshppo loads in `transformers` and the other way round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("gemma2", "gemma3_text", "granite", "granitemoe", "granitemoeshared", "llama", "mistral",
                         "mixtral", "olmo2", "olmoe", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# The family name of each type's transformers classes (`Phi3ForCausalLM`), for exports and messages.
HF_FAMILY = {"gemma2": "Gemma2", "gemma3_text": "Gemma3", "granite": "Granite", "granitemoe": "GraniteMoe",
             "granitemoeshared": "GraniteMoeShared", "llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral",
             "olmo2": "Olmo2", "olmoe": "Olmoe", "phi3": "Phi3", "qwen2": "Qwen2", "qwen2_moe": "Qwen2Moe",
             "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
# The config keys beyond the shared ones (sizes, norm, RoPE, token ids) that each type's transformers config
# takes and `ModelArgs.to_hf_config` writes: Mistral is Llama without the bias flags (transformers' Mistral
# has no biases). A type without head_dim here (Qwen2, Phi3, OLMo-2: their configs have no such field, their
# attention reads the attribute where it is set) gets it written only where it is not hidden / heads. Granite is
# Llama's without head_dim (its config has none) and with its four scalars (`GRANITE_SCALARS`). Qwen3-MoE is
# Qwen3's with its mixture-of-experts keys (`MOE_KEYS`); Mixtral is Mistral's with its experts (MixtralConfig takes
# num_experts as its attribute_map's name of num_local_experts, the key it writes), OLMoE OLMo-2's. Qwen2-MoE is
# Qwen2's (no head_dim key; its q/k/v biases under `qkv_bias`, `ATTENTION_BIAS_KEY`) with Qwen3-MoE's expert keys and
# its shared expert's width (`SHARED_EXPERT_TYPES`). Granite-MoE is Granite's without mlp_bias (its MLPs have none)
# and with Mixtral's expert keys; Granite-MoE-Shared adds its shared expert's width (`shared_intermediate_size`).
_GRANITE_MOE_KEYS = ("attention_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling", "num_local_experts", "num_experts_per_tok")
HF_CONFIG_KEYS = {"gemma2": ("head_dim", "attention_bias"), "gemma3_text": ("head_dim", "attention_bias"),
                  "granite": ("attention_bias", "mlp_bias", "embedding_multiplier", "residual_multiplier",
                              "attention_multiplier", "logits_scaling"),
                  "granitemoe": _GRANITE_MOE_KEYS, "granitemoeshared": (*_GRANITE_MOE_KEYS, "shared_intermediate_size"),
                  "llama": ("head_dim", "attention_bias", "mlp_bias"), "mistral": ("head_dim",),
                  "mixtral": ("head_dim", "num_experts", "num_experts_per_tok"),
                  "olmo2": ("attention_bias",), "olmoe": ("attention_bias", "num_experts", "num_experts_per_tok",
                                                          "norm_topk_prob"),
                  "phi3": (), "qwen2": (), "qwen3": ("head_dim", "attention_bias"),
                  "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"),
                  "qwen3_moe": ("head_dim", "attention_bias", "num_experts", "num_experts_per_tok",
                                "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
# The mixture-of-experts types (transformers' MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM,
# Qwen3MoeForCausalLM) and their `ModelArgs` fields, config.json's keys of the same names (num_experts under either of
# its names: transformers' Qwen3MoeConfig and MixtralConfig write `num_local_experts`; OlmoeConfig, Qwen2MoeConfig and
# the hub's Qwen3-MoE `num_experts`; GraniteMoeConfig `num_local_experts`).
# Layer i is a sparse block (`ModelArgs.moe_layers`: a router and `num_experts` SwiGLU experts of
# `moe_intermediate_size`, each token through its top `num_experts_per_tok`) where i is not in `mlp_only_layers` and
# (i + 1) % `decoder_sparse_step` == 0; the others are dense MLPs of `intermediate_size`. Every other type holds them
# at their defaults (no experts). Mixtral and OLMoE (`EVERY_LAYER_SPARSE`) have no dense layers and no
# moe_intermediate_size: their experts are `intermediate_size` wide, read into moe_intermediate_size (equal to it),
# and their configs have no decoder_sparse_step or mlp_only_layers (1 and none); Mixtral's router always renormalises
# its top-k weights (norm_topk_prob true) and keeps them in float32 (`ModelArgs.router_weights_float32`). Granite-MoE
# (and Granite-MoE-Shared) is every layer sparse too, its router's softmax taken over the top-k logits
# (`ModelArgs.router_softmax_topk`: renormalised, norm_topk_prob true).
MOE_TYPES = ("granitemoe", "granitemoeshared", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
EVERY_LAYER_SPARSE = ("granitemoe", "granitemoeshared", "mixtral", "olmoe")
# Granite's mixture-of-experts types (transformers' GraniteMoe, GraniteMoeShared): their router's softmax over the top-k
# logits (`ModelArgs.router_softmax_topk`), their checkpoints' own names (`block_sparse_moe`, `shared_mlp`)
GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared")
# The types that read Granite's scalars (`GRANITE_SCALARS`): transformers' Granite, GraniteMoe and GraniteMoeShared.
GRANITE_TYPES = ("granite", *GRANITE_MOE_TYPES)
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers")
# The types whose sparse block adds a shared expert to the routed ones (transformers' Qwen2MoeSparseMoeBlock: DeepSeek-
# MoE's shared expert, as Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B have it): every token through one more SwiGLU MLP,
# `mlp.shared_expert` of `shared_expert_intermediate_size` (its `SHARED_EXPERT_KEYS`, a `ModelArgs` field of the same
# name, 0 on every other type), its output times `sigmoid(mlp.shared_expert_gate(x))` (a `[1, H]` projection, no
# bias) and added to the routed experts' sum. Not routed: routing replay records and replays the routed experts alone.
# Granite-MoE-Shared's (transformers' GraniteMoeSharedMLP, at `shared_mlp` beside the sparse block: its fused
# `input_linear [2 S, H]`, gate rows first, and `output_linear [H, S]`) has no gate: its output is added as it is
# (`ModelArgs.shared_expert_gated`), and its config's `shared_intermediate_size` may be 0 (no shared expert).
SHARED_EXPERT_TYPES = ("granitemoeshared", "qwen2_moe")
SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size",)
# config.json's name of the shared expert's width where it is not the `ModelArgs` field's (`SHARED_EXPERT_KEYS`).
SHARED_EXPERT_CONFIG_KEY = {"granitemoeshared": "shared_intermediate_size"}
# The `ModelArgs` field of each `HF_CONFIG_KEYS` key named otherwise (GraniteMoeConfig has no attribute_map: it takes
# the experts' count as num_local_experts only, its shared expert's width as shared_intermediate_size).
_HF_KEY_FIELD = {"num_local_experts": "num_experts", "shared_intermediate_size": "shared_expert_intermediate_size"}
# The config key of a type's q/k/v biases where it is not `attention_bias`, and its default there: Qwen2MoeConfig's
# `qkv_bias` (true by default; its o_proj has no bias).
ATTENTION_BIAS_KEY = {"qwen2_moe": ("qkv_bias", True)}
# config.json's keys of a type that meshppo's outputs do not read, kept as read in `ModelArgs.extra_hf` and
# written back on export (the class's default would replace them): Phi3's original_max_position_embeddings
# (read by transformers' longrope only, which meshppo refuses, and by its generation's cache reset at that
# length, which changes no logit under plain RoPE); Qwen3-MoE's output_router_logits and router_aux_loss_coef
# (transformers' load-balancing loss, which it adds to its own language-model loss only: verl's actor and
# meshppo's read the logits, never that loss), Mixtral's and OLMoE's too; Mixtral's router_jitter_noise (0 only) and
# OLMoE's clip_qkv (null only: `_TYPE_REFUSED`).
_ROUTER_LOSS_KEYS = ("output_router_logits", "router_aux_loss_coef")
KEPT_KEYS = {"phi3": ("original_max_position_embeddings",), "qwen3_moe": _ROUTER_LOSS_KEYS, "qwen2_moe": _ROUTER_LOSS_KEYS,
             "granitemoe": _ROUTER_LOSS_KEYS, "granitemoeshared": _ROUTER_LOSS_KEYS,
             "mixtral": (*_ROUTER_LOSS_KEYS, "router_jitter_noise"), "olmoe": (*_ROUTER_LOSS_KEYS, "clip_qkv")}
# transformers' checkpoints of a type that fuse meshppo's projections into one tensor: its module (under each
# layer) -> meshppo's modules, whose output rows it stacks in this order (Phi3's qkv_proj [q; k; v], as its
# attention slices them, and gate_up_proj [gate; up], as its MLP's `chunk(2)` splits them). Loading splits
# them (`models.checkpoint.iter_hf_tensors`), the export fuses them (`models.checkpoint.save_pretrained`).
FUSED_PROJECTIONS = {"phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}}
# The keys of each type's sliding-window attention, kept as read in `ModelArgs.extra_hf` (never in a checkpoint's
# fingerprint: the window changes no weight) and written back on export; each windowed layer attends to the last
# `sliding_window` positions (`ModelArgs.layer_windows`, `models.attention`, `rollout.attention`). transformers' Mistral
# windows every layer by `sliding_window` (null: none); its Qwen2 / Qwen3 the layers `layer_types` names
# sliding_attention (without it: those from `max_window_layers` on), and only with `use_sliding_window`;
# its Phi3 every layer by `sliding_window`, as Mistral (Phi-3-mini-4k's 2047 of 4096); its Gemma3 the layers
# `layer_types` names sliding_attention (by default five of every six: `GEMMA_PATTERN`; its Gemma2 every other
# one from the first); its Qwen3Moe every layer
# by `sliding_window`, only with `use_sliding_window` (its config reads neither max_window_layers nor layer_types);
# its Mixtral every layer by `sliding_window`, as Mistral; its Qwen2Moe as its Qwen2, but without layer_types every
# other layer from the first (0, 2, ...) below `max_window_layers` (Qwen2MoeConfig's default layer_types), and its
# config writes sliding_window 0 where use_sliding_window is false (read as null). A type whose only key is
# sliding_window windows every layer.
WINDOW_KEYS = {"gemma2": ("sliding_window", "layer_types"), "gemma3_text": ("sliding_window", "layer_types"),
               "granite": (), "granitemoe": (), "granitemoeshared": (), "llama": (),
               "mistral": ("sliding_window",), "mixtral": ("sliding_window",), "olmo2": (), "olmoe": (),
               "phi3": ("sliding_window",),
               "qwen2": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
               "qwen2_moe": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
               "qwen3": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
               "qwen3_moe": ("use_sliding_window", "sliding_window")}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Why a type whose transformers class has no such biases refuses attention_bias / mlp_bias.
_NO_BIAS_WHY = {"qwen3": "transformers' Qwen3 then has an o_proj bias too, which meshppo's attention lacks",
                "qwen3_moe": "transformers' Qwen3Moe then has an o_proj bias too and its MLPs have none",
                "mistral": "transformers' Mistral has no biases: it would load the exported model without them",
                "mixtral": "transformers' Mixtral has no biases: it would load the exported model without them",
                "phi3": "transformers' Phi3 has no biases: it would load the exported model without them"}
# The types whose transformers attention biases o_proj too where attention_bias is set (`ModelArgs.o_proj_bias`):
# OLMo-2's, OLMoE's, Gemma 3's and Granite's (Granite-MoE's too). OLMo-2's, OLMoE's, Qwen2-MoE's, Granite-MoE's and
# Gemma 3's MLPs have no biases (`NO_MLP_BIAS_TYPES`): mlp_bias is refused, as transformers would load the export
# without them; Granite's MLP has Llama's mlp_bias.
O_PROJ_BIAS_TYPES = ("gemma2", "gemma3_text", "granite", "granitemoe", "granitemoeshared", "olmo2", "olmoe")
NO_MLP_BIAS_TYPES = ("gemma2", "gemma3_text", "granitemoe", "granitemoeshared", "olmo2", "olmoe", "qwen2_moe")
# Granite's scalars (transformers' GraniteConfig keys, each 1 by default there): the embeddings times
# embedding_multiplier, each block branch's output times residual_multiplier before its residual add, the
# attention's softmax scale attention_multiplier (in place of head_dim ** -0.5), the logits divided by
# logits_scaling; Granite-MoE's (`GRANITE_TYPES`) alike. Every other type has them at their neutral values
# (`ModelArgs.embedding_scale`, `attention_scale`, which serve Gemma 3's embedding and attention scales too; the
# trainer's LM head and the engine's sampler take logits_scaling into the temperature).
GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# Gemma 2 (`gemma2`, transformers' Gemma2ForCausalLM) and Gemma 3 (`gemma3_text`, Gemma3ForCausalLM) share one
# architecture (`GEMMA_TYPES`): every norm by 1 + weight, four a block, a GeGLU MLP, the embeddings times sqrt(hidden)
# rounded to their dtype, the attention scale query_pre_attn_scalar^-0.5 and `layer_types`' sliding_attention layers
# windowed by sliding_window (4096 where config.json has none: `GEMMA_WINDOW`). Gemma 3 adds per-head q / k norms and
# its sliding layers' own RoPE base; Gemma 2 has neither (one RoPE for every layer) and soft-caps its attention scores
# and logits (`SOFTCAP_KEYS`). The keys of their configs that meshppo reads beyond the shared ones, kept in
# `ModelArgs.extra_hf` and written back on export (`GEMMA_KEYS`): query_pre_attn_scalar (the attention scales by its
# inverse square root, not head_dim's) and Gemma 3's rope_local_base_freq (the RoPE base of its sliding_attention
# layers, transformers' rope_parameters["sliding_attention"]; rope_theta and rope_scaling are its full_attention
# layers'). Their configs' layer_types default: every `GEMMA_PATTERN`th layer full_attention (Gemma 2's odd ones,
# Gemma 3's every sixth), the others sliding_attention.
GEMMA_TYPES = ("gemma2", "gemma3_text")
GEMMA_KEYS = {"gemma2": ("query_pre_attn_scalar",), "gemma3_text": ("query_pre_attn_scalar", "rope_local_base_freq")}
GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
GEMMA_WINDOW = 4096  # their configs' sliding_window where config.json has none (Gemma2Config's, Gemma3TextConfig's)
# The logit soft caps, `ModelArgs` fields of config.json's key names (transformers' Gemma2Config / Gemma3TextConfig
# keys; null: none): the attention scores become cap·tanh(scores / cap) after the scale, before the mask and softmax
# (`models.attention`, `rollout.attention`, the engine's Triton kernels), the logits cap·tanh(logits / cap) before
# any temperature (`models.lm_head`, the engine's logits). Where config.json has no such key, its config class's
# default (`_SOFTCAP_DEFAULTS`: Gemma2Config's 50 and 30, Gemma3TextConfig's none). Every other type has none, and a
# Gemma 3 no attention cap (`_SOFTCAP_REFUSED`).
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
_SOFTCAP_DEFAULTS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}
_SOFTCAP_REFUSED = {("gemma3_text", "attn_logit_softcapping"): (
    "transformers' Gemma3Attention keeps it but never passes it to its attention, which caps nothing: verl's actor "
    "would compute other log-probs than meshppo's capped scores")}
# Gemma config keys meshppo refuses at any value but these (key -> accepted values, why).
_GEMMA_REFUSED = {
    "use_bidirectional_attention": ((None, False), "meshppo's models are causal language models"),
}
# Config keys of a type that meshppo accepts at one value only (key -> accepted, why), kept in `extra_hf`
# (`KEPT_KEYS`) and refused naming the key otherwise (`_check_type_refused`). Mixtral's router_jitter_noise, which an
# override sets to 0 (`check_overrides`, the message says how).
_JITTER_WHY = ("transformers' Mixtral multiplies each sparse layer's input by uniform noise in [1 - r, 1 + r] in "
               "training mode, which verl's actor computes its log-probs in, so they would be random; meshppo's "
               "router reads its input as it is")
_TYPE_REFUSED = {
    "mixtral": {"router_jitter_noise": (0, _JITTER_WHY)},
    "olmoe": {"clip_qkv": (None, "transformers' Olmoe then clamps the query, key and value projections to "
                                 "[-clip_qkv, clip_qkv], which meshppo's attention and its engine do not")},
}
# How an override replaces a refused value (`_TYPE_REFUSED`'s keys that `check_overrides` applies).
_REFUSED_FIX = {"router_jitter_noise": "set actor_rollout_ref.model.override_config.router_jitter_noise=0 in the "
                                       "trainer (another model: its model.override_config.router_jitter_noise=0); "
                                       "elsewhere edit config.json"}
# The `rope_scaling` keys each supported type reads (`models.transformer.rope_inv_freq`): required, optional.
# YaRN's original_max_position_embeddings defaults to max_position_embeddings, as in transformers.
ROPE_SCALING_KEYS = {"default": ((), ()), "linear": (("factor",), ()),
                     "llama3": (("factor", "original_max_position_embeddings"),
                                ("low_freq_factor", "high_freq_factor")),
                     "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast",
                                            "beta_slow", "mscale", "mscale_all_dim", "truncate"))}
SUPPORTED_ROPE_TYPES = tuple(ROPE_SCALING_KEYS)
# The types whose transformers config reads fewer rope types than meshppo implements, with why: Phi3's
# validates default and longrope only (its config turns yarn into longrope), which meshppo lacks.
_TYPE_ROPE_TYPES = {"phi3": (("default",), "transformers' Phi3 reads only default and longrope, and meshppo implements "
                                           "no longrope")}
# Why a rope type transformers has is refused (where there is more to say than that meshppo lacks it).
_ROPE_REFUSED_WHY = {"dynamic": "its frequencies change with each forward's sequence length, so a token's log-prob "
                                "would depend on its batch"}
_ROPE_TYPES_NOTE = f"meshppo's models implement {SUPPORTED_ROPE_TYPES}"


def tiled_moe_refusal(model_type: str) -> str:
    """Why the tiled MLP (`models.tiled_mlp`) is refused on a mixture-of-experts model (its check and the
    trainer's pre-flight)."""
    return (f"the tiled MLP is not supported for model_type {model_type} (a mixture of experts): each token runs "
            "through its own few experts, whose [tokens, intermediate] tensors are already one expert's share of "
            "the tokens")


def rope_type_refusal(kind) -> str:
    """`type KIND is not supported (why)`: the words every refusal of a rope type starts with."""
    why = f" ({_ROPE_REFUSED_WHY[kind]})" if isinstance(kind, str) and kind in _ROPE_REFUSED_WHY else ""
    return f"type {kind!r} is not supported{why}"


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"yarn", "factor": ..., ...}
    attention_bias: bool = False  # q/k/v bias (Qwen2 always has it)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Granite's scalars (`GRANITE_SCALARS`); attention_multiplier None: head_dim ** -0.5 (`attention_scale`)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # mixture of experts (`MOE_KEYS`; Qwen3-MoE's): 0 experts on every other type
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the shared expert's width (`SHARED_EXPERT_TYPES`: Qwen2-MoE's, Granite-MoE-Shared's); 0 on every other type
    shared_expert_intermediate_size: int = 0
    # the logit soft caps (`SOFTCAP_KEYS`: Gemma 2's, a Gemma 3's); None: none
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # config.json's keys kept as read for a faithful save: its dtype (no output depends on it), the sliding
    # window's keys (`WINDOW_KEYS`: each layer's window, `layer_windows`)
    extra_hf: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; meshppo supports {SUPPORTED_MODEL_TYPES}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type in _NO_BIAS_WHY and (self.attention_bias or self.mlp_bias):
            raise ValueError(f"{self.model_type} with attention_bias or mlp_bias is not supported "
                             f"({_NO_BIAS_WHY[self.model_type]})")
        if self.model_type in NO_MLP_BIAS_TYPES and self.mlp_bias:
            raise ValueError(f"{self.model_type} with mlp_bias is not supported (transformers' "
                             f"{HF_FAMILY[self.model_type]} has no MLP biases: it would load the exported model "
                             "without them)")
        _check_window_keys(self)
        _check_granite_scalars(self)
        _check_moe(self)
        _check_type_refused(self)
        _check_softcaps(self)
        if self.model_type in GEMMA_TYPES:
            _check_gemma(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling {rope_type_refusal(self.rope_type)}; {_ROPE_TYPES_NOTE}")
        kinds, why = _TYPE_ROPE_TYPES.get(self.model_type, (SUPPORTED_ROPE_TYPES, ""))
        if self.rope_type not in kinds:
            raise ValueError(f"rope_scaling of type {self.rope_type!r} is not supported for model_type "
                             f"{self.model_type}: {why} (rope_scaling null is plain RoPE)")
        missing = [k for k in ROPE_SCALING_KEYS[self.rope_type][0] if k not in self.rope_scaling]
        if missing:
            raise ValueError(f"rope_scaling of type {self.rope_type!r} lacks {missing}")
        if self.rope_scaling:
            check_rope_parameters({**self.rope_scaling, "rope_type": self.rope_type}, "rope_scaling")

    @property
    def qk_norm(self) -> bool:
        """Whether each head's query and key are RMS-normalised (weights `[head_dim]`) before RoPE: Qwen3's (and
        Qwen3-MoE's) and Gemma 3's."""
        return self.model_type in ("qwen3", "qwen3_moe", "gemma3_text")

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts (`models.transformer.MoE`), by transformers' rule: not in
        `mlp_only_layers`, and `(i + 1) % decoder_sparse_step == 0` where there are experts; none of a dense
        type's."""
        if self.num_experts <= 0:
            return []
        return [i for i in range(self.num_hidden_layers)
                if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]

    @property
    def unit_offset_norm(self) -> bool:
        """Whether every RMSNorm scales by `1 + weight` (computed in float32 and rounded once, as transformers'
        Gemma2RMSNorm / Gemma3RMSNorm), its checkpoint storing the 0-centred `weight`: Gemma 2's and Gemma 3's."""
        return self.model_type in GEMMA_TYPES

    @property
    def sandwich_norm(self) -> bool:
        """Whether the block norms each branch's input and output (Gemma 2's and Gemma 3's four norms): `x +
        post_attention_layernorm(attn(input_layernorm(x)))`, then `h +
        post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`."""
        return self.model_type in GEMMA_TYPES

    @property
    def mlp_activation(self) -> str:
        """The gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh-approximated GELU,
        Gemma 2's and Gemma 3's `gelu_pytorch_tanh`)."""
        return "gelu_tanh" if self.model_type in GEMMA_TYPES else "silu"

    @property
    def layer_types(self) -> list[str] | None:
        """config.json's layer_types (a Gemma's default when it has none: every `GEMMA_PATTERN`th layer
        full_attention); None for a type that reads none."""
        kinds = self.extra_hf.get("layer_types")
        if kinds is None and self.model_type in GEMMA_TYPES:
            return ["full_attention" if (i + 1) % GEMMA_PATTERN[self.model_type] == 0 else "sliding_attention"
                    for i in range(self.num_hidden_layers)]
        return kinds

    @property
    def local_rope_layers(self) -> list[int]:
        """The layers that rotate by the local RoPE (`local_rope_args`): Gemma 3's sliding_attention layers (by
        `layer_types`, whether or not a window is set); none of another type's (Gemma 2's layers share one RoPE)."""
        if self.model_type != "gemma3_text":
            return []
        return [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]

    def local_rope_args(self) -> "ModelArgs":
        """These arguments with the RoPE of the `local_rope_layers`: Gemma 3's rope_local_base_freq, unscaled
        (transformers' rope_parameters["sliding_attention"])."""
        return dataclasses.replace(self, rope_theta=float(self.extra_hf.get("rope_local_base_freq", 10_000.0)),
                                   rope_scaling=None)

    @property
    def embedding_scale(self) -> float:
        """What the embeddings are multiplied by before the first block: Granite's embedding_multiplier, a Gemma's
        sqrt(hidden_size); 1 elsewhere (`models.transformer.scale_embeddings` applies it)."""
        return self.hidden_size ** 0.5 if self.model_type in GEMMA_TYPES else self.embedding_multiplier

    @property
    def embedding_scale_rounded(self) -> bool:
        """Whether `embedding_scale` is rounded to the embeddings' dtype before it multiplies them: a Gemma's,
        which transformers keeps as a buffer in the model dtype (sqrt(1152) is 34.0 in bf16); Granite's
        embedding_multiplier is a Python float there, which the product takes unrounded."""
        return self.model_type in GEMMA_TYPES

    @property
    def attention_scale(self) -> float:
        """The attention's softmax scale: Granite's attention_multiplier, a Gemma's query_pre_attn_scalar^-0.5,
        else `head_dim ** -0.5`."""
        if self.model_type in GEMMA_TYPES:
            return float(self.extra_hf.get("query_pre_attn_scalar", 256)) ** -0.5
        return self.head_dim ** -0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: with attention_bias, on a type whose transformers attention biases it too
        (`O_PROJ_BIAS_TYPES`: OLMo-2, Gemma 3, Granite; Qwen2's and Llama's meshppo biases q, k and v only)."""
        return self.attention_bias and self.model_type in O_PROJ_BIAS_TYPES

    @property
    def post_norm(self) -> bool:
        """Whether the block norms each branch's output before the residual add and has no input norm: OLMo-2's
        `x + post_attention_layernorm(attn(x))`, then `h + post_feedforward_layernorm(mlp(h))`."""
        return self.model_type == "olmo2"

    @property
    def full_qk_norm(self) -> bool:
        """Whether the query and key projections are RMS-normalised over their whole width (weights
        `[heads * head_dim]` and `[kv_heads * head_dim]`) before the head split and RoPE: OLMo-2's and OLMoE's (its
        blocks pre-norm: `post_norm` is OLMo-2's only)."""
        return self.model_type in ("olmo2", "olmoe")

    @property
    def router_weights_float32(self) -> bool:
        """Whether a sparse layer's top-k routing weights stay in float32 (`models.moe.route`), each expert's output
        times its weight taken in float32 and the sum rounded once to the model's dtype: Mixtral's
        (MixtralTopKRouter does not cast them back); Qwen3-MoE's and OLMoE's routers cast them to the logits'
        dtype. The same numbers in float32 and float64."""
        return self.model_type == "mixtral"

    @property
    def router_softmax_topk(self) -> bool:
        """Whether a sparse layer's router takes its softmax over the top-k logits (in float32) rather than the top-k
        of the softmax over every expert (`models.moe.route`): Granite-MoE's (GraniteMoeTopKRouter). The two are the
        same renormalised weights in exact arithmetic, rounded otherwise."""
        return self.model_type in GRANITE_MOE_TYPES

    @property
    def shared_expert_gated(self) -> bool:
        """Whether a shared expert's output is scaled by `sigmoid(mlp.shared_expert_gate(x))` before it joins the
        routed sum: Qwen2-MoE's; Granite-MoE-Shared's is added as it is (`SHARED_EXPERT_TYPES`)."""
        return self.model_type == "qwen2_moe"

    @property
    def sliding_window(self) -> int | None:
        """config.json's `sliding_window` as read (None where it has none; Qwen's is null unless
        `use_sliding_window`, as transformers reads it). Whether a layer attends through it:
        `attention_window`."""
        if self.model_type in GEMMA_TYPES:
            return self.extra_hf.get("sliding_window", GEMMA_WINDOW)
        return self.extra_hf.get("sliding_window")

    @property
    def windowed_layers(self) -> list[int]:
        """The layers transformers' model of this config attends through `sliding_window`: every
        one of a Mistral or Phi3 with a window, and of a Qwen3-MoE with `use_sliding_window`; a Qwen2's, Qwen2-MoE's or
        Qwen3's `layer_types` sliding_attention ones (without layer_types, config.json before transformers v5, those
        from `max_window_layers` on; a Qwen2-MoE's every other one from the first below it, as Qwen2MoeConfig's
        default layer_types), none without `use_sliding_window` (transformers then reads the window as null)."""
        if self.sliding_window is None or not WINDOW_KEYS[self.model_type]:
            return []
        if WINDOW_KEYS[self.model_type] == ("sliding_window",):  # Mistral's, Phi3's: every layer
            return list(range(self.num_hidden_layers))
        if self.model_type in GEMMA_TYPES:  # its layer_types' sliding_attention layers, always
            return [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]
        if not self.extra_hf.get("use_sliding_window"):
            return []
        if "layer_types" not in WINDOW_KEYS[self.model_type]:  # Qwen3-MoE's: every layer
            return list(range(self.num_hidden_layers))
        kinds = self.extra_hf.get("layer_types")
        if kinds is None:
            start = self.extra_hf.get("max_window_layers", 28)  # (transformers' default)
            if self.model_type == "qwen2_moe":
                return list(range(0, min(start, self.num_hidden_layers), 2))
            return list(range(start, self.num_hidden_layers))
        return [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window: `sliding_window` for the `windowed_layers` (each query attends to the
        last that many positions, itself included, as transformers masks it), None (the whole context)
        for the others."""
        windowed = set(self.windowed_layers)
        return [self.sliding_window if i in windowed else None for i in range(self.num_hidden_layers)]

    @property
    def attention_window(self) -> int | None:
        """The smallest window any layer attends through; None: every layer reads the whole context. A
        sequence of at most that many tokens gets the same logits as without the window."""
        return self.sliding_window if self.windowed_layers else None

    @property
    def fingerprint(self) -> dict:
        """What a training checkpoint records of the model (`trainer.checkpointing.CheckpointManager`; resuming
        compares it): every field but `extra_hf` (the window and the dtype change no weight), and Granite's scalars
        only on a Granite (elsewhere they hold their neutral values, and checkpoints written before they existed
        record none: those resume); likewise the mixture-of-experts fields (`MOE_KEYS`) only on a mixture-of-experts
        type (`mlp_only_layers` as a list, as the checkpoint's JSON reads it back), the shared expert's width
        (`SHARED_EXPERT_KEYS`) only on a type with one; the logit soft caps (`SOFTCAP_KEYS`) only where set
        (checkpoints written before they existed, all uncapped, record none: those resume). A Gemma's attention
        scale and Gemma 3's local RoPE base (`GEMMA_KEYS`, kept in `extra_hf`) are recorded too: they change its
        logits as rope_theta does."""
        recorded = {k: v for k, v in dataclasses.asdict(self).items()
                    if (self.model_type in GRANITE_TYPES or k not in GRANITE_SCALARS)
                    and (self.model_type in MOE_TYPES or k not in MOE_KEYS)
                    and (self.model_type in SHARED_EXPERT_TYPES or k not in SHARED_EXPERT_KEYS)
                    and (k not in SOFTCAP_KEYS or v is not None)} | {"extra_hf": None}
        if self.model_type in MOE_TYPES:
            recorded["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.model_type in GEMMA_TYPES:
            recorded |= {key: self.extra_hf.get(key) for key in GEMMA_KEYS[self.model_type]}
        return recorded

    @property
    def rope_type(self) -> str:
        rs = self.rope_scaling or {}
        return rs.get("rope_type", rs.get("type", "default"))

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count. `include_embedding` adds the input embedding and the LM head: one
        `[vocab, hidden]` matrix when tied, two when untied. `active`: the parameters one token's forward
        multiplies by, a mixture-of-experts layer's router, `num_experts_per_tok` of its experts (not all
        `num_experts`: `flops` counts the work that runs) and its shared expert and that expert's gate (Qwen2-MoE's,
        which every token runs); the same as the total on a dense model."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0) + \
            (h if self.o_proj_bias else 0)
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size  # router, experts
        if self.shared_expert_intermediate_size:  # the shared expert, its gate (Qwen2-MoE's)
            sparse += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gated else 0)
        rest = attn + (4 if self.sandwich_norm else 2) * h + (2 * d if self.qk_norm else 0) + \
            (q + kv if self.full_qk_norm else 0)
        n_sparse = len(self.moe_layers)
        n = (self.num_hidden_layers - n_sparse) * (rest + mlp) + n_sparse * (rest + sparse) + h
        if include_embedding:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    def flops(self, tokens: float, head_positions: float, attention_pairs: float, backward: bool = False,
              lora=None) -> float:
        """The floating-point operations that run, for MFU (the one formula the trainer and the
        benchmarks use): `2·N_body` per token for the blocks' matmuls (forward; `6·N_body` with
        the backward; a mixture-of-experts layer's N counts its router and the `num_experts_per_tok`
        experts a token runs through, not the others: `num_params(active=True)`), `2·hidden·vocab` (`6·`) per position the LM head is evaluated on — the
        trainer evaluates it on response positions only, the input embedding is a lookup and
        costs none — and `4·layers·heads·head_dim` (`12·`) per (query, key) pair attended:
        `attention_pairs` is `Σ L²/2` for causal sequences of lengths `L`, `Σ context` in decode.

        `lora` (a `LoRAConfig`: frozen base, trained adapters) changes the backward: the base's and
        the head's weight gradients do not run (`4·` instead of `6·`), each adapter `in -> out` adds
        `6·r·(in + out)` per token (one on a fused projection, a Phi3's qkv_proj, as peft computes it:
        `_lora_shapes`), and layer 0 computes no input gradient upstream of its first adapter
        (`_lora_layer0_skipped`)."""
        k = 6 if backward else 2
        body = self.num_params(include_embedding=False, active=True)
        attn = 2 * k * self.num_hidden_layers * self.num_attention_heads * self.head_dim
        if not (backward and lora is not None):
            return k * body * tokens + k * self.hidden_size * self.vocab_size * head_positions + attn * attention_pairs
        adapters = self.num_hidden_layers * sum(6 * lora.rank * (i + o) for i, o in self._lora_shapes(lora).values())
        skipped_per_token, skipped_per_pair = self._lora_layer0_skipped(lora)
        head = 4 * self.hidden_size * self.vocab_size
        return ((4 * body + adapters - skipped_per_token) * tokens + head * head_positions
                + (attn - skipped_per_pair) * attention_pairs)

    def _projection_shapes(self, layer: int | None = None) -> dict[str, tuple[int, int]]:
        """Each block projection's `(in, out)` features; where `layer` is one of `moe_layers`, its MLP's as one
        token runs them: the router (`gate`, hidden -> experts) and gate / up / down over the
        `num_experts_per_tok` experts it goes through and the shared expert (Qwen2-MoE's, with its gate,
        `shared_expert_gate`: hidden -> 1)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if layer in self.moe_layers:
            i = self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size
            shapes["gate"] = (h, self.num_experts)
            if self.shared_expert_intermediate_size and self.shared_expert_gated:
                shapes["shared_expert_gate"] = (h, 1)
        return shapes | {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def _lora_shapes(self, lora) -> dict[str, tuple[int, int]]:
        """Each adapter's `(in, out)` features by the module peft adapts on this type's transformers model
        (`models.lora.model_targets`): a fused one (a Phi3's qkv_proj, its parts sharing one A) outputs its
        parts' rows."""
        from models.lora import LM_HEAD, VALUE_HEAD, fused_parts, model_targets

        shapes, fused = self._projection_shapes(), fused_parts(self.model_type)
        return {t: (shapes[fused.get(t, (t,))[0]][0], sum(shapes[p][1] for p in fused.get(t, (t,))))
                for t in model_targets(lora, self, heads=LM_HEAD + VALUE_HEAD)}

    def _lora_layer0_skipped(self, lora) -> tuple[int, int]:
        """The backward FLOPs (per token, per attended pair) that layer 0 of a LoRA model does not
        run. Its input, the frozen embedding's output, needs no gradient, so autograd computes a
        tensor's gradient only downstream of the first adapter: q / k / v never compute their input
        gradient; without a q / k / v adapter, neither do attention (its `8·heads·head_dim` a pair)
        and o_proj; without an attention adapter, neither do gate / up; and with none of those,
        neither does down_proj (a sparse layer 0: its router, the experts a token runs and a shared expert with its
        gate, `_projection_shapes`).
        An input gradient costs `2·in·out` for the base, `2·r·in` for an adapter (once for a fused projection's
        shared A)."""
        from models.lora import fused_parts

        shapes, adapters, r = self._projection_shapes(layer=0), self._lora_shapes(lora), lora.rank
        parts = {t: fused_parts(self.model_type).get(t, (t,)) for t in adapters}
        targets = {p for ps in parts.values() for p in ps}

        def input_grads(*names):
            return (sum(2 * shapes[m][0] * shapes[m][1] for m in names)
                    + sum(2 * r * adapters[t][0] for t, ps in parts.items() if set(ps) <= set(names)))

        qkv = ("q_proj", "k_proj", "v_proj")
        per_token, per_pair = input_grads(*qkv), 0
        if targets.isdisjoint(qkv):
            per_token += input_grads("o_proj")
            per_pair = 8 * self.num_attention_heads * self.head_dim
        if targets.isdisjoint((*qkv, "o_proj")):  # (a sparse layer's router and shared expert gate read it too)
            per_token += input_grads("gate_proj", "up_proj",
                                     *(g for g in ("gate", "shared_expert_gate") if g in shapes))
            if targets.isdisjoint(("gate_proj", "up_proj")):
                per_token += input_grads("down_proj")
        return per_token, per_pair

    # ---------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf_config(cls, hf_config, overrides: dict | None = None) -> "ModelArgs":
        """Build from a `transformers.PretrainedConfig` (v4 `rope_theta` or v5 `rope_parameters`).
        `overrides` (fields and values, as `check_overrides` returns those that act) replace the
        config's before anything is checked, as verl sets them on the Hugging Face config before it
        builds the model: an override's `rope_scaling` replaces a type of config.json meshppo refuses
        (a mapping whole: `models.checkpoint.load_model_args`); its `sliding_window` goes to `extra_hf`."""
        overrides = overrides or {}
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        model_type = cfg.get("model_type")
        check_hf_model_type(model_type)
        gemma = {}
        if model_type in GEMMA_TYPES:  # Gemma 3's RoPE by layer type; the full_attention layers' is ModelArgs' own
            cfg, gemma = _gemma_config(cfg)
        if model_type == "qwen2_moe" and cfg.get("sliding_window") == 0 and not cfg.get("use_sliding_window"):
            cfg = cfg | {"sliding_window": None}  # (Qwen2MoeConfig writes 0 for no window: WINDOW_KEYS)
        bias_key, bias_default = ATTENTION_BIAS_KEY.get(model_type, ("attention_bias", False))
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        rope_scaling = overrides["rope_scaling"] if "rope_scaling" in overrides else _hf_rope_scaling(cfg)
        if model_type == "phi3" or rope_scaling is not None:
            _refuse_partial_rotary(cfg)
        if model_type in GEMMA_TYPES:  # (its hidden_act, which some Gemma 2 config.json files hold too, is not read)
            if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                raise ValueError(f"config.json's hidden_activation={cfg.get('hidden_activation')!r} is not supported "
                                 f"for {model_type} (only gelu_pytorch_tanh, {HF_FAMILY[model_type]}'s)")
        elif cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        known = {f.name for f in dataclasses.fields(cls)}
        fields_overridden, extra_overridden = _split_overrides(overrides)
        for key, value in extra_overridden.items():
            if key not in WINDOW_KEYS[model_type] + KEPT_KEYS.get(model_type, ()):
                raise ValueError(f"override_config.{key}={json.dumps(value)}: model_type {model_type} has no "
                                 f"{key.replace('_', ' ')} (transformers' {model_type} reads none)")
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            attention_bias=True if model_type == "qwen2" else bool(cfg.get(bias_key, bias_default)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
            initializer_range=cfg.get("initializer_range", 0.02),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            **({k: cfg.get(k, 1.0) for k in GRANITE_SCALARS} if model_type in GRANITE_TYPES else {}),
            **(_hf_moe_fields(cfg) if model_type in MOE_TYPES else {}),
            **({key: cfg.get(key, default) for key, default in zip(SOFTCAP_KEYS, _SOFTCAP_DEFAULTS[model_type])}
               if model_type in _SOFTCAP_DEFAULTS else {}),
            extra_hf={k: v for k, v in cfg.items() if k not in known and k in ("torch_dtype", "dtype")
                      or k in WINDOW_KEYS[model_type] + KEPT_KEYS.get(model_type, ())} | gemma | extra_overridden,
        )
        return cls(**(fields | fields_overridden))

    @property
    def hf_dtype(self) -> str | None:
        """The dtype the Hugging Face checkpoint these arguments came from stores its weights in
        (config.json's `dtype`, transformers v5's key, or v4's `torch_dtype`): `"bfloat16"`,
        `"float16"` or `"float32"`; None where it names none (or another)."""
        for key in ("dtype", "torch_dtype"):
            name = str(self.extra_hf.get(key) or "").removeprefix("torch.")
            if name in ("bfloat16", "float16", "float32"):
                return name
        return None

    def to_hf_config(self, architecture: str | None = None, dtype: str | None = None):
        """A `transformers` config object equivalent to these arguments; `dtype` (default: the
        checkpoint's, `hf_dtype`) is written as the weights' dtype, under the key the installed
        transformers reads and writes (`dtype` in v5, `torch_dtype` before)."""
        from transformers import AutoConfig

        gemma = self.model_type in GEMMA_TYPES
        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        kwargs.update({"hidden_activation": "gelu_pytorch_tanh"} if gemma else {"hidden_act": "silu"})
        kwargs.update({key: getattr(self, _HF_KEY_FIELD.get(key, key)) for key in HF_CONFIG_KEYS[self.model_type]})
        if self.model_type in ATTENTION_BIAS_KEY:
            kwargs[ATTENTION_BIAS_KEY[self.model_type][0]] = self.attention_bias
        if "mlp_only_layers" in HF_CONFIG_KEYS[self.model_type]:  # (a JSON list, as Qwen3MoeConfig declares it)
            kwargs.update(mlp_only_layers=list(self.mlp_only_layers))
        kwargs.update({key: self.extra_hf[key] for key in WINDOW_KEYS[self.model_type] + KEPT_KEYS.get(
            self.model_type, ()) if key in self.extra_hf})
        if gemma:  # (Gemma 3's rope_local_base_freq goes into rope_parameters below)
            kwargs.update({k: v for k, v in self.extra_hf.items() if k in ("query_pre_attn_scalar", *_GEMMA_REFUSED)},
                          layer_types=self.layer_types, **{key: getattr(self, key) for key in SOFTCAP_KEYS})
        if WINDOW_KEYS[self.model_type][:1] == ("sliding_window",):  # null too (MistralConfig's default: 4096)
            kwargs.update(sliding_window=self.sliding_window)
        if "head_dim" not in HF_CONFIG_KEYS[self.model_type] and \
                self.head_dim != self.hidden_size // self.num_attention_heads:
            kwargs.update(head_dim=self.head_dim)  # their attention reads it (`getattr(config, "head_dim", ...)`)
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        cfg = AutoConfig.for_model(self.model_type, **kwargs)
        # transformers (>= 5, requirements.txt) reads rope_parameters; its rope_scaling is a deprecated alias of
        # it, whose setter warns.
        if "partial_rotary_factor" in (cfg.rope_parameters or {}):  # (Phi3Config's, which its validation reads)
            rope["partial_rotary_factor"] = 1.0  # the whole head: the only share meshppo's RoPE rotates
        if self.model_type == "gemma3_text":  # by layer type (the local layers' unscaled: `local_rope_args`)
            cfg.rope_parameters = {"full_attention": rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": self.local_rope_args().rope_theta}}
        else:
            cfg.rope_parameters = rope
            cfg.rope_theta = self.rope_theta
        if architecture:
            cfg.architectures = [architecture]
        dtype = dtype or self.hf_dtype
        if dtype is not None:
            # v5 keeps `dtype` (its `torch_dtype` a deprecated alias of it); v4's attribute is `torch_dtype`
            setattr(cfg, "dtype" if isinstance(getattr(type(cfg), "torch_dtype", None), property) else "torch_dtype",
                    dtype)
        return cfg


# The Hugging Face model types meshppo refuses with a way to a type it reads: Gemma 3's image-text checkpoints
# (Gemma3ForConditionalGeneration: gemma-3-4b and up), whose language model is a gemma3_text one.
_TYPE_INSTEAD = {"gemma3": (
    "a Gemma3ForConditionalGeneration (image-text: gemma-3-4b and up) checkpoint, which meshppo does not read; its "
    "language model is a Gemma3ForCausalLM (model_type gemma3_text), which it does: write that out with transformers "
    "(m = Gemma3ForConditionalGeneration.from_pretrained(path); lm = Gemma3ForCausalLM(m.config.text_config); "
    "lm.model.load_state_dict(m.model.language_model.state_dict()); lm.save_pretrained(out), and the tokenizer with "
    "it) and give that directory (its logits are the checkpoint's on text)")}


def check_hf_model_type(model_type) -> None:
    """ValueError for a config.json's `model_type` meshppo does not build, saying what to do where there is a way
    (`_TYPE_INSTEAD`)."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    instead = f": {_TYPE_INSTEAD[model_type]}" if model_type in _TYPE_INSTEAD else ""
    raise ValueError(f"config.json has model_type {model_type!r}; meshppo supports {SUPPORTED_MODEL_TYPES}{instead}")


def _gemma_config(cfg: dict) -> tuple[dict, dict]:
    """A Gemma config.json (`cfg`) as (`cfg` with the full_attention layers' RoPE as every other type's, the
    `extra_hf` keys of `GEMMA_KEYS` and `_GEMMA_REFUSED` that it sets). Gemma 2's RoPE is every other type's (one for
    every layer); Gemma 3's is by layer type, as transformers' Gemma3TextConfig writes it (rope_parameters by layer
    type; or an older one's rope_theta, rope_scaling and rope_local_base_freq). ValueError for a Gemma 3
    sliding_attention RoPE other than plain RoPE (Gemma 3's is)."""
    extra = {"query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256)}
    refused = {k: cfg[k] for k in _GEMMA_REFUSED if k in cfg}
    if cfg.get("model_type") == "gemma2":
        return cfg, extra | refused
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:  # an older config.json: its top-level keys
        full = dict(cfg.get("rope_scaling") or {}) | {"rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {"rope_type", "type",
                                                                                         "rope_theta"}:
        raise ValueError(f"config.json's rope_parameters.sliding_attention={local!r} is not supported: meshppo "
                         "rotates gemma3_text's sliding_attention layers by plain RoPE (rope_type default)")
    full.setdefault("rope_theta", 1_000_000.0)
    cfg = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")} | {"rope_parameters": full}
    return cfg, extra | {"rope_local_base_freq": float(local.get("rope_theta", 10_000.0))} | refused


def _check_gemma(args: ModelArgs) -> None:
    """ValueError naming the key for a Gemma config that meshppo's models would compute otherwise than
    transformers' Gemma2ForCausalLM / Gemma3ForCausalLM (`_GEMMA_REFUSED`), or a query_pre_attn_scalar /
    rope_local_base_freq that is not a positive number."""
    for key, (accepted, why) in _GEMMA_REFUSED.items():
        if args.extra_hf.get(key) not in accepted:
            raise ValueError(f"config.json's {key}={args.extra_hf[key]!r} is not supported for {args.model_type} "
                             f"({why}); only {' or '.join(json.dumps(a) for a in accepted)} is")
    for key in GEMMA_KEYS[args.model_type]:
        if key in args.extra_hf:
            _number(args.extra_hf[key], f"config.json's {key}")
    if args.sliding_window is None and "sliding_attention" in args.layer_types:
        raise ValueError(f"sliding_window=null (config.json's, or a model.override_config's) is not supported for "
                         f"{args.model_type} with sliding_attention layers (transformers' {HF_FAMILY[args.model_type]} "
                         "windows them by it and cannot run them without one): give a window (its default: "
                         f"{GEMMA_WINDOW}), or layer_types of full_attention only")


def _check_softcaps(args: ModelArgs) -> None:
    """ValueError naming the key for a logit soft cap (`SOFTCAP_KEYS`) that is not null or a positive number, or set
    on a type whose transformers model computes none; a cap given as an int or a numeric string is read as a
    float."""
    for key in SOFTCAP_KEYS:
        value = getattr(args, key)
        if value is None:
            continue
        if args.model_type not in _SOFTCAP_DEFAULTS:
            raise ValueError(f"{key}={value!r} (config.json's, or a model.override_config's) is not supported for "
                             f"{args.model_type} (transformers' {HF_FAMILY[args.model_type]} soft-caps nothing; only "
                             "Gemma 2 and Gemma 3 read it)")
        if (args.model_type, key) in _SOFTCAP_REFUSED:
            raise ValueError(f"{key}={value!r} (config.json's, or a model.override_config's) is not supported for "
                             f"{args.model_type} ({_SOFTCAP_REFUSED[args.model_type, key]}); only null is")
        setattr(args, key, float(_number(value, f"config.json's {key} (null: none)")))


def _hf_rope_scaling(cfg: dict) -> dict | None:
    """config.json's rope scaling (v4 `rope_scaling`, v5 `rope_parameters`); None for the default type.
    A type meshppo refuses is named with the override that replaces it."""
    rope_params = cfg.get("rope_parameters") or {}
    rope_scaling = cfg.get("rope_scaling") or {}
    if not rope_scaling and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        # verl sets the override on the Hugging Face config before it is read: it replaces a refused type
        scaled = [k for k in _TYPE_ROPE_TYPES.get(cfg.get("model_type"), (SUPPORTED_ROPE_TYPES,))[0] if k != "default"]
        raise ValueError(f"config.json's rope_scaling {rope_type_refusal(kind)}: in the trainer replace it with "
                         "actor_rollout_ref.model.override_config.rope_scaling (another model: its "
                         "model.override_config.rope_scaling), null for plain RoPE"
                         f"{f' or one of {tuple(scaled)}' if scaled else ''} (a replacement is not the checkpoint's "
                         "scaling: its log-probs differ from transformers' wherever the two rotate otherwise, for "
                         "longrope at every length); elsewhere (rollout.generate, from_pretrained) edit config.json")
    return None if kind == "default" else rope_scaling


def _refuse_partial_rotary(cfg: dict) -> None:
    """ValueError for config.json's `partial_rotary_factor` other than 1 (Phi-4-mini's 0.75; in rope_parameters,
    or at the top level of an older config.json), for a model whose transformers RoPE reads it (Phi3's always,
    every type's scaled ones; Llama's, Mistral's and Qwen's plain RoPE does not): its RoPE then rotates only
    that share of each head's dimensions, and meshppo's RoPE rotates the whole head."""
    for where, params in (("rope_parameters.", cfg.get("rope_parameters") or {}), ("", cfg)):
        factor = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
        if factor != 1.0:
            raise ValueError(f"config.json's {where}partial_rotary_factor={factor!r} is not supported: "
                             f"transformers' RoPE then rotates only that share of each head's dimensions, and "
                             f"meshppo's rotates the whole head (only 1.0 is supported)")


def _check_granite_scalars(args: ModelArgs) -> None:
    """ValueError for Granite's scalars (`GRANITE_SCALARS`) that are not finite numbers > 0 (naming config.json's
    key), or set away from their neutral values on another type, whose transformers class reads none of them. A
    Granite without attention_multiplier gets GraniteConfig's default, 1."""
    if args.model_type not in GRANITE_TYPES:
        set_ = [k for k in GRANITE_SCALARS if getattr(args, k) != (None if k == "attention_multiplier" else 1.0)]
        if set_:
            raise ValueError(f"{set_[0]} is read for model_type {' / '.join(GRANITE_TYPES)} only (transformers' "
                             f"{args.model_type} "
                             "has no such scalar)")
        return
    if args.attention_multiplier is None:
        args.attention_multiplier = 1.0
    for key in GRANITE_SCALARS:
        setattr(args, key, _number(getattr(args, key), f"config.json's {key}"))


# Each mixture-of-experts type's config defaults for the `MOE_KEYS` (and `SHARED_EXPERT_KEYS`) its config.json may
# lack (its transformers config class's); Mixtral's and OLMoE's configs have only the first two (and OLMoE's
# norm_topk_prob): their others are fixed (`EVERY_LAYER_SPARSE`, Mixtral's renormalisation).
_MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": None},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": None, "shared_expert_intermediate_size": 5632},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "granitemoeshared": {"num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 0},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
}


# The types whose router always renormalises its top-k weights (their configs have no norm_topk_prob): Mixtral's, and
# Granite-MoE's (a softmax over the top-k logits: `ModelArgs.router_softmax_topk`).
_ALWAYS_RENORMALISED = ("granitemoe", "granitemoeshared", "mixtral")


def _hf_moe_fields(cfg: dict) -> dict:
    """A mixture-of-experts config.json's `MOE_KEYS` (and a Qwen2-MoE's `SHARED_EXPERT_KEYS`) as `ModelArgs` fields,
    with its type's config defaults for those it lacks (`_MOE_DEFAULTS`); num_experts under either of its names (`num_local_experts`, which transformers'
    Qwen3MoeConfig and MixtralConfig write). Mixtral's and OLMoE's experts are `intermediate_size` wide, every layer
    sparse; Mixtral's and Granite-MoE's top-k weights always renormalised; Granite-MoE-Shared's shared expert's width
    under its config's name (`SHARED_EXPERT_CONFIG_KEY`). A key that is no number or list is left to `_check_moe`,
    which names it."""
    model_type = cfg["model_type"]
    fields = {k: cfg.get(k, default) for k, default in _MOE_DEFAULTS[model_type].items()}
    if model_type in SHARED_EXPERT_CONFIG_KEY:
        fields["shared_expert_intermediate_size"] = cfg.get(SHARED_EXPERT_CONFIG_KEY[model_type],
                                                            fields["shared_expert_intermediate_size"])
    if model_type in EVERY_LAYER_SPARSE:
        fields["moe_intermediate_size"] = cfg["intermediate_size"]
    if model_type in _ALWAYS_RENORMALISED:
        fields["norm_topk_prob"] = True
    if cfg.get("num_local_experts") is not None:
        fields["num_experts"] = cfg["num_local_experts"]
    layers = fields.get("mlp_only_layers")
    fields["mlp_only_layers"] = () if layers is None else tuple(layers) if isinstance(layers, list) else layers
    return fields


def _check_moe(args: ModelArgs) -> None:
    """ValueError naming the key for mixture-of-experts fields (`MOE_KEYS`) set on a dense type, or on a
    mixture-of-experts type: experts, top-k and expert size not positive integers, a top-k above the experts, a
    decoder_sparse_step below 1, mlp_only_layers not distinct layer indices in range; on Mixtral and OLMoE
    (`EVERY_LAYER_SPARSE`) experts of another width than intermediate_size, a dense layer, and Mixtral's top-k
    weights not renormalised (their transformers classes have none of these); OLMoE's head_dim other than hidden /
    heads (its q_norm is hidden_size wide). The shared expert's width (`SHARED_EXPERT_KEYS`) set on a type without one,
    or not a positive integer on a type with one. hidden_act other than silu is refused by
    `ModelArgs.from_hf_config`."""
    for key in SHARED_EXPERT_KEYS:
        if args.model_type in SHARED_EXPERT_TYPES:  # (Granite-MoE-Shared's may be 0: no shared expert)
            where = f"config.json's {SHARED_EXPERT_CONFIG_KEY.get(args.model_type, key)}"
            setattr(args, key, _number(getattr(args, key), where, integer=True,
                                       nonnegative=args.model_type in SHARED_EXPERT_CONFIG_KEY))
        elif getattr(args, key):
            raise ValueError(f"{key} is read for model_type {' / '.join(SHARED_EXPERT_TYPES)} only (transformers' "
                             f"{args.model_type} has no shared expert)")
    if args.model_type not in MOE_TYPES:
        set_ = [f.name for f in dataclasses.fields(args) if f.name in MOE_KEYS and getattr(args, f.name) != f.default]
        if set_:
            raise ValueError(f"{set_[0]} is read for model_type {' / '.join(MOE_TYPES)} only (transformers' "
                             f"{args.model_type} has no experts)")
        return
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        setattr(args, key, _number(getattr(args, key), f"config.json's {key}", integer=True))
    if args.num_experts_per_tok > args.num_experts:
        raise ValueError(f"config.json's num_experts_per_tok={args.num_experts_per_tok} exceeds num_experts="
                         f"{args.num_experts}: each token goes through that many distinct experts")
    if not isinstance(args.norm_topk_prob, bool):
        raise ValueError(f"config.json's norm_topk_prob={args.norm_topk_prob!r} is not true or false")
    layers = args.mlp_only_layers
    if isinstance(layers, list):
        layers = args.mlp_only_layers = tuple(layers)
    if not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or not
                                            0 <= i < args.num_hidden_layers for i in layers) \
            or len(set(layers)) != len(layers):
        raise ValueError(f"config.json's mlp_only_layers={list(layers) if isinstance(layers, tuple) else layers!r}: "
                         f"expected distinct layer indices in [0, {args.num_hidden_layers})")
    if args.model_type in EVERY_LAYER_SPARSE:
        family = HF_FAMILY[args.model_type]
        fixed = {"moe_intermediate_size": args.intermediate_size, "decoder_sparse_step": 1, "mlp_only_layers": (),
                 **({"norm_topk_prob": True} if args.model_type in _ALWAYS_RENORMALISED else {})}
        for key, value in fixed.items():
            if getattr(args, key) != value:
                raise ValueError(f"{args.model_type} with {key}={getattr(args, key)!r} is not supported: transformers' "
                                 f"{family} has {key} {json.dumps(list(value) if key == 'mlp_only_layers' else value)} "
                                 "(every layer sparse, its experts intermediate_size wide"
                                 f"{', their top-k weights renormalised' if fixed.get('norm_topk_prob') else ''})")
    if args.model_type == "olmoe" and args.head_dim * args.num_attention_heads != args.hidden_size:
        raise ValueError(f"olmoe with head_dim={args.head_dim} is not supported: transformers' Olmoe norms the query "
                         f"over hidden_size ({args.hidden_size}), so its heads must fill it (head_dim "
                         f"{args.hidden_size} / {args.num_attention_heads})")


def _check_type_refused(args: ModelArgs) -> None:
    """ValueError naming the key for a config key of `args`' type set away from the one value meshppo accepts
    (`_TYPE_REFUSED`), with the override that replaces it where one does (`_REFUSED_FIX`)."""
    for key, (accepted, why) in _TYPE_REFUSED.get(args.model_type, {}).items():
        value = args.extra_hf.get(key, accepted)
        if value != accepted or isinstance(value, bool):
            fix = f": {_REFUSED_FIX[key]}" if key in _REFUSED_FIX else ""
            raise ValueError(f"config.json's {key}={value!r} is not supported for {args.model_type} ({why}); only "
                             f"{json.dumps(accepted)} is{fix}")


def _check_window_keys(args: ModelArgs) -> None:
    """ValueError for sliding-window keys (`WINDOW_KEYS`) that transformers' class of the type has not, or
    reads otherwise: a window that is not a positive integer or null, layer types other than full_attention
    and sliding_attention or not one per layer."""
    extra = args.extra_hf
    foreign = [k for k in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
               if k in extra and k not in WINDOW_KEYS[args.model_type]]
    if foreign:
        raise ValueError(f"{foreign[0]} is not read for model_type {args.model_type!r} (transformers' "
                         f"{args.model_type} has no sliding window): only "
                         f"{', '.join(t for t in SUPPORTED_MODEL_TYPES if WINDOW_KEYS[t])} have one")
    window = extra.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window={window!r} is not a positive integer or null")
    kinds = extra.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != args.num_hidden_layers
                              or any(kind not in _LAYER_TYPES for kind in kinds)):
        raise ValueError(f"config.json's layer_types={kinds!r}: meshppo supports {list(_LAYER_TYPES)}, one per "
                         f"layer ({args.num_hidden_layers})")
    start = extra.get("max_window_layers")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise ValueError(f"config.json's max_window_layers={start!r} is not an integer >= 0")


# ---------------------------------------------------------------- verl's model.override_config
# Hugging Face config attributes that verl sets on the checkpoint's config before it builds the
# model. Those meshppo's models read and the checkpoint's tensors do not depend on act (they are
# `ModelArgs` fields, or `extra_hf` keys, so they also reach the exported config.json); and Mixtral's
# router_jitter_noise, accepted at 0 only (what meshppo computes: `_TYPE_REFUSED`), which replaces a config.json's
# noise that transformers would apply:
OVERRIDE_KEYS = ("max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps", "initializer_range",
                 "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "router_jitter_noise",
                 *SOFTCAP_KEYS)
# Of those, the model's outputs read these; the others reach its exported config.json only (and
# initializer_range its weights drawn at random: load_format=dummy). sliding_window (null or a window) sets
# the window of the layers transformers windows (`ModelArgs.windowed_layers`; null: none is windowed). A logit soft
# cap (`SOFTCAP_KEYS`: null, none, or a positive cap) replaces config.json's, on the types that read one
# (`_check_softcaps`); a reward model's score reads the attention's, not the LM head's.
OUTPUT_KEYS = ("rope_theta", "rope_scaling", "rms_norm_eps", "sliding_window", "router_jitter_noise",
               "attn_logit_softcapping")
# The overrides kept in `ModelArgs.extra_hf` (they are not fields: `WINDOW_KEYS`, `KEPT_KEYS`).
_EXTRA_OVERRIDES = ("sliding_window", "router_jitter_noise")
# Those the tensors' shapes or the architecture hang on cannot change: the checkpoint is built for its own.
ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias", "tie_word_embeddings",
                     "model_type", "architectures", "hidden_act", "num_labels", *MOE_KEYS, "num_local_experts",
                     *SHARED_EXPERT_KEYS, *SHARED_EXPERT_CONFIG_KEY.values(), "qkv_bias")
# Those of the Hugging Face model classes that meshppo's own models do not have change nothing:
_ATTN_WHY = ("meshppo's attention is its own (variable-length FlashAttention or SDPA kernels), not a Hugging Face "
             "implementation")
_ROUTER_LOSS_WHY = ("transformers adds the router's load-balancing loss only to the loss it computes from labels, "
                    "which verl's actor does not ask for: verl and meshppo train a mixture of experts on the PPO loss "
                    "alone")
OVERRIDE_NO_EFFECT = {"attn_implementation": _ATTN_WHY, "_attn_implementation": _ATTN_WHY,
                      "use_cache": "meshppo's training forwards keep no KV cache (its engine has its own)",
                      "output_router_logits": _ROUTER_LOSS_WHY, "router_aux_loss_coef": _ROUTER_LOSS_WHY}
# meshppo's models have no dropout: these are accepted at 0 only (verl's critic sets them to 0 itself).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop")
_NO_DROPOUT_WHY = "meshppo's models have no dropout"


def _number(value, where: str, integer: bool = False, nonnegative: bool = False):
    """`value` as an int (`integer`: an integral float too) or a float, > 0 (>= 0 when
    `nonnegative`); YAML's `1e-6`, a string to YAML 1.1, is a number. ValueError naming `where`
    otherwise."""
    if isinstance(value, str) and not integer:
        with contextlib.suppress(ValueError):  # text that is no number: the check below names it
            value = float(value)
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or \
            not (value >= 0 if nonnegative else value > 0):
        raise ValueError(f"{where}: expected {'an integer' if integer else 'a number'} {'>=' if nonnegative else '>'} "
                         f"0, got {value!r}")
    return value if integer else float(value)


def _rope_scaling(value, where: str) -> dict | None:
    """An override's `rope_scaling`: null, or a mapping with its type (`rope_type` or `type`) and
    the keys that type reads, nothing else; None for the default type."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping (rope_type and its parameters) or null, got {value!r}")
    kinds = [value[k] for k in ("rope_type", "type") if k in value]
    if not kinds or kinds[0] != kinds[-1]:
        raise ValueError(f"{where}: give its type once, as rope_type (or type): one of {SUPPORTED_ROPE_TYPES}; got "
                         f"{value!r}")
    kind = kinds[0]
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"{where}: {rope_type_refusal(kind)}; {_ROPE_TYPES_NOTE}")
    required, optional = ROPE_SCALING_KEYS[kind]
    params = {k: v for k, v in value.items() if k not in ("rope_type", "type")}
    missing = [k for k in required if k not in params]
    unread = [k for k in params if k not in required + optional]
    if missing or unread:
        raise ValueError(f"{where}: type {kind!r} reads {list(required + optional)} ({list(required)} required); "
                         + (f"missing {missing}" if missing else f"{unread} would be ignored"))
    if kind == "default":
        return None
    out = {"rope_type": kind}
    for k, v in params.items():
        out[k] = _rope_parameter(k, v, f"{where}.{k}")
    check_rope_parameters(out, where)
    return out


def check_rope_parameters(rope_scaling: dict, where: str) -> None:
    """The relations between a `rope_scaling`'s parameters that its frequencies need (an override's
    or config.json's alike): llama3's smoothing band and YaRN's correction range must not be empty
    or reversed."""
    kind = rope_scaling.get("rope_type")
    if kind == "llama3" and rope_scaling.get("low_freq_factor", 1.0) >= rope_scaling.get("high_freq_factor", 4.0):
        raise ValueError(f"{where}: low_freq_factor must be below high_freq_factor (their defaults: 1 and 4)")
    if kind == "yarn" and rope_scaling.get("beta_fast", 32.0) < rope_scaling.get("beta_slow", 1.0):
        raise ValueError(f"{where}: beta_fast must not be below beta_slow (their defaults: 32 and 1)")


def _rope_parameter(name: str, value, where: str):
    """One parameter of an override's `rope_scaling`: YaRN's `truncate` a boolean, its `mscale` and
    `mscale_all_dim` numbers >= 0 (0: unset, as transformers reads them), the others numbers > 0."""
    if name == "truncate":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    return _number(value, where, integer=name == "original_max_position_embeddings",
                   nonnegative=name in ("mscale", "mscale_all_dim"))


def _token_ids(value, where: str, many: bool):
    if value is None:
        return None
    if many and isinstance(value, list) and value:
        return [_number(v, f"{where}[{i}]", integer=True, nonnegative=True) for i, v in enumerate(value)]
    return _number(value, where, integer=True, nonnegative=True)


def flat_overrides(overrides: dict, key: str = "override_config") -> dict:
    """verl 0.9.1's two forms of `model.override_config` as one mapping of the config's attributes: its
    model config (`HFModelConfig`, every engine's) sets the attributes under `model_config` when there is
    one (the nested form), else the top-level ones; it reads `attn_implementation` at the top level in
    both. Raises ValueError naming the key for a `model_config` that is not a mapping, or one beside
    other top-level keys, which verl would leave unread."""
    if "model_config" not in overrides:
        return overrides
    nested, where = overrides["model_config"], f"{key}.model_config"
    if not isinstance(nested, dict):
        raise ValueError(f"{where}: expected a mapping of the model config's attributes, got {nested!r}")
    unread = [name for name in overrides if name not in ("model_config", "attn_implementation")]
    if unread:
        raise ValueError(f"{key}.{unread[0]} beside {where}: verl reads only {where}'s keys then (and "
                         f"attn_implementation beside it), so {unread} would be ignored; move them into {where}")
    return {**{k: v for k, v in overrides.items() if k == "attn_implementation"}, **nested}


def check_overrides(overrides: dict, key: str = "override_config") -> tuple[dict, dict]:
    """verl's `model.override_config` (`key`: the option, for messages), either form (`flat_overrides`):
    `(the overrides that act, as ModelArgs fields and values; the accepted ones that change nothing:
    name -> why)`. Raises ValueError naming `key.<name>` for any other: a shape or architecture
    attribute, a dropout other than 0, an unknown name or a bad value."""
    acting, inert = {}, {}
    nested = overrides.get("model_config") or {}
    for name, value in flat_overrides(overrides, key).items():
        where = f"{key}.model_config.{name}" if name in nested else f"{key}.{name}"
        if name in ARCHITECTURE_KEYS:
            raise ValueError(f"{where} cannot be overridden: it sets the architecture or the shapes of the "
                             "model's tensors, and the checkpoint's tensors are those of its own config.json")
        if name in OVERRIDE_NO_EFFECT:
            inert[name] = OVERRIDE_NO_EFFECT[name]
        elif name in DROPOUT_KEYS:
            if _number(value, where, nonnegative=True) != 0:
                raise ValueError(f"{where}={value!r} is not supported by meshppo: {_NO_DROPOUT_WHY} (0 is accepted)")
            inert[name] = _NO_DROPOUT_WHY
        elif name == "rope_scaling":
            acting[name] = _rope_scaling(value, where)
        elif name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            acting[name] = _token_ids(value, where, many=name == "eos_token_id")
        elif name == "sliding_window":
            acting[name] = None if value is None else _number(value, where, integer=True)
        elif name in SOFTCAP_KEYS:
            acting[name] = None if value is None else _number(value, f"{where} (null: none)")
        elif name == "router_jitter_noise":
            if _number(value, where, nonnegative=True) != 0:
                raise ValueError(f"{where}={value!r} is not supported by meshppo ({_JITTER_WHY}): only 0 is")
            acting[name] = 0.0
        elif name == "max_position_embeddings":
            acting[name] = _number(value, where, integer=True)
        elif name in OVERRIDE_KEYS:
            acting[name] = _number(value, where)
        else:
            raise ValueError(f"{where} is not supported by meshppo: the keys it applies are "
                             f"{', '.join(OVERRIDE_KEYS)}; {', '.join(OVERRIDE_NO_EFFECT)} and the dropouts "
                             f"({', '.join(DROPOUT_KEYS)}) at 0 are accepted and change nothing")
    return acting, inert


def apply_overrides(args: ModelArgs, overrides: dict | None, key: str = "override_config") -> ModelArgs:
    """`args` with verl's `model.override_config` applied (`check_overrides`): the one way every
    model (actor, reference, critic, reward model) and the engine get theirs. A `rope_scaling`
    replaces the checkpoint's whole; `rope_theta` alone keeps its scaling."""
    acting, _ = check_overrides(overrides or {}, key)
    if not acting:
        return args
    fields, extra = _split_overrides(acting)
    return dataclasses.replace(args, **fields, extra_hf=args.extra_hf | extra)


def _split_overrides(acting: dict) -> tuple[dict, dict]:
    """Acting overrides (`check_overrides`) as (`ModelArgs` fields, `extra_hf` keys)."""
    return ({k: v for k, v in acting.items() if k not in _EXTRA_OVERRIDES},
            {k: v for k, v in acting.items() if k in _EXTRA_OVERRIDES})


# Dense bf16 peak per GPU (datasheets: half the "with sparsity" figure), the denominator of MFU. Matched
# against the device name in this order, so that the PCIe and NVL boards (fewer SMs or lower clocks than the
# SXM parts of the same name) are found before the family name.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H800 PCIe": 756e12,
                   "H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


def peak_bf16_flops(device_name: str) -> float | None:
    """The MFU denominator of a GPU named `device_name` (`torch.cuda.get_device_name`), or None (no MFU is
    reported for a GPU not in `PEAK_BF16_FLOPS`)."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def torch_dtypes() -> dict:
    """Dtype names a config or command line may use -> torch dtypes (one map for the project); verl's
    numeric spellings too ("16", "32": its `PrecisionType`, a YAML 32 read as the text)."""
    import torch

    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "16": torch.float16, "float32": torch.float32, "fp32": torch.float32, "32": torch.float32}
