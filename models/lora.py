"""LoRA adapters on a `models.Transformer`: injection, the adapters-off switch, peft I/O, merging.

A targeted projection `y = x Wᵀ + b` becomes `y = x Wᵀ + b + scaling · (x Aᵀ) Bᵀ` with
`A [r, in]`, `B [out, r]`, `scaling = alpha / r` — peft's `LoraLayer` (no dropout, no bias on
the adapters). A is Kaiming-uniform (peft's `a=√5`: uniform in `±1/√in`) and B is zero, so a
fresh adapter leaves the model unchanged and the policy starts at the reference.

The projection stays the same module with the same `weight` / `bias` parameters (its class
becomes `LoRALinear`) and gains two parameters, `lora_A` and `lora_B`: every base name
(`layers.0.self_attn.q_proj.weight`) is unchanged, so checkpoint loading, `tp_shard_dim`,
FSDP's shard placement and the resharder see the base exactly as without LoRA. The base is
frozen; only the adapters (and a value head, which must learn) train.

The reference policy is the same model with the adapters off (`adapters_disabled`): the
forward then runs exactly the base computation, no second copy of the weights.

On a type whose transformers model fuses projections (`FUSED_PROJECTIONS`: Phi3's qkv_proj, gate_up_proj),
targets are peft's names on that model and a fused module gets peft's one adapter: its parts (q / k / v,
gate / up) share one `lora_A` parameter (the same `nn.Parameter`, listed once, under the first part's name:
`shared_a_name`) and each has its rows of B; the peft files hold the fused module's A and stacked B.

Files: `save_peft_adapter` writes what `peft.PeftModel.from_pretrained` reads
(`adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`); `read_peft_adapter` reads
it back, `read_peft_adapter_shapes` only its config and shapes (checked against a model's); `merged_state_dict` folds the adapters into the base
weights (fp32 maths) for a plain Hugging Face export.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.args import FUSED_PROJECTIONS, GRANITE_MOE_TYPES, HF_FAMILY, MOE_TYPES, SHARED_EXPERT_TYPES
from models.checkpoint import meshppo_key_to_hf

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTN_PROJ + MLP_PROJ

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# peft options meshppo's adapters do not have, at their off values (as save_peft_adapter writes them).
_PEFT_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
                     "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
# adapter_config.json keys that leave a loaded adapter's function as r, lora_alpha, target_modules and
# exclude_modules make it: bookkeeping, and options read only while training (dropout) or initialising (the init
# methods' configs: the weights are loaded) or for Megatron layers. Any other key, peft's newer
# ones too (Activated LoRA's alora_invocation_tokens, DoRA, QA-LoRA, ...), must be off (null, false,
# empty or "none"): an adapter that sets one is refused, not approximated.
_PEFT_HARMLESS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                  "inference_mode", "r", "target_modules", "lora_alpha", "lora_dropout", "init_lora_weights",
                  "layers_pattern", "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
                  "lora_ga_config", "runtime_config", "ensure_weight_tying", "exclude_modules",
                  "qalora_group_size"}  # read only with use_qalora, which must be off


@dataclass
class LoRAConfig:
    """verl's `actor_rollout_ref.model.lora_rank` / `lora_alpha` / `target_modules` / `exclude_modules`."""

    rank: int = field(metadata={"help": "adapter rank r (lora_rank); > 0"})
    alpha: float = field(default=16.0, metadata={"help": "lora_alpha: the adapter output is scaled by alpha / rank"})
    target_modules: str | list[str] = field(default="all-linear", metadata={
        "help": "'all-linear' (in any case, as peft reads it), a list of peft's entries (an entry selects the "
                "module of that name or whose name ends with '.' + it: q_proj, self_attn.q_proj), or a regular "
                "expression peft matches (re.fullmatch) against whole module names (model.layers.0.self_attn.q_proj): "
                "it must select only the decoder layers' projections, the same ones in every layer"})
    exclude_modules: str | list[str] | None = field(default=None, metadata={
        "help": "modules target_modules selects that get no adapter, as peft reads them: a regular expression "
                "(re.fullmatch on whole module names) or a list (an entry excludes the module of that name or whose "
                "name ends with '.' + it); null (or empty): none"})

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora_rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora_alpha must be a positive number, got {self.alpha!r}")
        tm = self.target_modules
        if isinstance(tm, str) and tm.lower() == "all-linear":  # peft reads all-linear in any case
            self.target_modules = tm = "all-linear"
        if isinstance(tm, str):
            if tm != "all-linear":
                try:
                    re.compile(tm)
                except re.error as e:
                    raise ValueError(f"target_modules={tm!r} is not a regular expression ({e}): give 'all-linear', "
                                     f"a list such as {list(ALL_LINEAR)} or a regular expression") from None
        elif not isinstance(tm, (list, tuple)) or not tm or not all(isinstance(m, str) for m in tm):
            raise ValueError(f"target_modules must be 'all-linear', a regular expression or a non-empty list of "
                             f"strings, got {tm!r}")
        else:
            self.target_modules = list(tm)
        ex = self.exclude_modules
        if not ex:  # peft: an empty value excludes nothing
            self.exclude_modules = None
        elif isinstance(ex, str):
            try:
                re.compile(ex)
            except re.error as e:
                raise ValueError(f"exclude_modules={ex!r} is not a regular expression ({e}): give null, a list such "
                                 "as ['o_proj'] or a regular expression") from None
        elif not isinstance(ex, (list, tuple)) or not all(isinstance(m, str) for m in ex):
            raise ValueError(f"exclude_modules must be null, a regular expression or a list of strings, got {ex!r}")
        else:
            self.exclude_modules = list(ex)
        self.targets  # what it selects, checked on a two-layer model's names (inject_lora checks the model's own)

    @property
    def targets(self) -> tuple[str, ...]:
        """The module names, in model order, that peft selects on a two-layer model's names: those of a model
        with separate projections (q_proj .. down_proj), else of a type whose transformers model fuses some
        (`FUSED_PROJECTIONS`: Phi3's qkv_proj, o_proj, gate_up_proj, down_proj). `model_targets` gives what a
        given model's type selects."""
        refusals = []  # each family's names in turn (its fused projections, its norms); none selecting: the
        # separate projections' refusal
        for model_type in (None, *FUSED_PROJECTIONS, *_LAYER_NORMS):
            try:
                return peft_targets(self.target_modules, _hf_module_names(2, LM_HEAD + VALUE_HEAD, model_type),
                                    self.exclude_modules, model_type)
            except ValueError as e:
                refusals.append(e)
        raise refusals[0]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# The modules beside the decoder a Hugging Face ...ForCausalLM has (lm_head), and a ...ForTokenClassification,
# verl's critic (score, and the dropout before it).
LM_HEAD = ("lm_head",)
VALUE_HEAD = ("score", "dropout")
# The norms of a decoder layer of a type's transformers model whose are not Llama's input_layernorm and
# post_attention_layernorm, as peft sees its modules: OLMo-2's post-norm blocks have no input norm, Gemma 2's and
# Gemma 3's have four.
_SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")
_LAYER_NORMS = {"olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"), "gemma2": _SANDWICH_NORMS,
                "gemma3_text": _SANDWICH_NORMS}
_LAYER_PROJ = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")


def _sparse_block_names(model_type: str | None) -> tuple[str, str]:
    """A sparse layer's block and router module names in transformers' model of `model_type`: Granite-MoE's
    `block_sparse_moe` / `router`, every other mixture of experts' `mlp` / `gate`."""
    return ("block_sparse_moe", "router") if model_type in GRANITE_MOE_TYPES else ("mlp", "gate")


def _hf_module_names(num_layers: int, heads: tuple[str, ...] = LM_HEAD, model_type: str | None = None,
                     sparse_layers=()) -> list[str]:
    """The Hugging Face module names of a meshppo model with `num_layers` blocks (as peft sees them under a
    `...ForCausalLM` with `heads` LM_HEAD, or `...ForTokenClassification` with VALUE_HEAD); with a
    `model_type` whose transformers model fuses projections (`FUSED_PROJECTIONS`: Phi3's qkv_proj,
    gate_up_proj), its fused modules in place of their parts, as peft sees that model. The MLP of a layer in
    `sparse_layers` (`ModelArgs.moe_layers`) is transformers' sparse block (Qwen3-MoE's, Mixtral's, OLMoE's,
    Qwen2-MoE's): its router `mlp.gate` and its stacked experts `mlp.experts`, neither an nn.Linear (all-linear passes
    over them), in place of gate_proj, up_proj and down_proj; a Qwen2-MoE's (`SHARED_EXPERT_TYPES`) also its shared
    expert's projections `mlp.shared_expert.gate_proj` .. and their gate `mlp.shared_expert_gate`, which meshppo's
    LoRA does not target (a list naming gate_proj selects them, and is refused). A Granite-MoE's sparse block is
    `block_sparse_moe` in place of `mlp` (its router `block_sparse_moe.router`, its experts
    `block_sparse_moe.experts`), a Granite-MoE-Shared's shared expert the layer's `shared_mlp` with its fused
    `input_linear` and `output_linear` (nn.Linear modules that meshppo's LoRA does not target: a list naming them is
    refused)."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", *heads]
    fused = FUSED_PROJECTIONS.get(model_type, {})
    parts = {p.rsplit(".", 1)[1] for ps in fused.values() for p in ps}
    for i in range(num_layers):
        b = f"model.layers.{i}"
        norms = _LAYER_NORMS.get(model_type, ("input_layernorm", "post_attention_layernorm"))
        mlp, router = _sparse_block_names(model_type)
        granite = model_type in GRANITE_MOE_TYPES
        names += [b, *(f"{b}.{n}" for n in norms), f"{b}.self_attn", f"{b}.{mlp}", f"{b}.self_attn.q_norm",
                  f"{b}.self_attn.k_norm"]
        # (a sparse layer: its experts' stacked parameters, and the per-expert names peft maps onto them)
        names += ([f"{b}.{mlp}.{router}", f"{b}.{mlp}.experts", f"{b}.{mlp}.experts.act_fn",
                   *(f"{b}.{mlp}.experts.{p}" for p in ("gate_up_proj", *MLP_PROJ))] if i in sparse_layers
                  else [f"{b}.mlp.act_fn"])
        if granite and model_type in SHARED_EXPERT_TYPES:
            names += [f"{b}.shared_mlp", *(f"{b}.shared_mlp.{p}" for p in ("input_linear", "output_linear",
                                                                           "activation"))]
        if i in sparse_layers and model_type in SHARED_EXPERT_TYPES and not granite:
            names += [f"{b}.mlp.shared_expert", *(f"{b}.mlp.shared_expert.{p}" for p in (*MLP_PROJ, "act_fn")),
                      f"{b}.mlp.shared_expert_gate"]
        names += [f"{b}.{'self_attn' if p in ATTN_PROJ else 'mlp'}.{p}" for p in ALL_LINEAR
                  if p not in parts and not (p in MLP_PROJ and i in sparse_layers)]
        names += [f"{b}.{module}" for module in fused]
    return names


# The projections some type's transformers model fuses (`FUSED_PROJECTIONS`: qkv_proj, gate_up_proj), by their
# module names, which `peft_targets` selects as peft does (one adapter each: `fused_parts`).
_FUSED_MODULES = tuple(dict.fromkeys(m.rsplit(".", 1)[1] for fused in FUSED_PROJECTIONS.values() for m in fused))


def peft_selects(spec: str | list[str], name: str) -> bool:
    """Whether peft's `target_modules` (not all-linear) or `exclude_modules` value `spec` selects the module
    `name` (a whole name, model.layers.0.self_attn.q_proj): a string is `re.fullmatch`ed against it, a list
    entry selects the module of that name or whose name ends with "." + the entry."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == e or name.endswith("." + e) for e in spec)


def _how(spec: str | list[str]) -> str:
    if isinstance(spec, str):
        return "peft matches a string with re.fullmatch against whole module names"
    return "peft selects a module whose whole name is a list entry or ends with '.' + one"


def peft_targets(target_modules: str | list[str], names: list[str],
                 exclude_modules: str | list[str] | None = None, model_type: str | None = None) -> tuple[str, ...]:
    """The projections peft adapts under `target_modules` and `exclude_modules` among the module names
    `names` (`_hf_module_names`), in model order: those target_modules selects (all-linear: every
    projection; peft's also takes a value head, VERL.md) less those exclude_modules selects. ValueError
    naming the keys when that selects a module other than a decoder layer's projection, none at all, or
    not the same projections in every layer, or when a list entry (or exclude_modules' string) names no
    module (peft would pass over it: a typo). `model_type`, whose model the names are, words the errors."""
    linear = target_modules == "all-linear"
    shown = f"target_modules={target_modules!r}" + (f" with exclude_modules={exclude_modules!r}"
                                                     if exclude_modules else "")
    per_layer: dict[int, set[str]] = {}
    layers, excluded = set(), False
    for name in names:
        m = _LAYER_PROJ.fullmatch(name)
        proj = bool(m and m.group(2) in ALL_LINEAR + _FUSED_MODULES)
        if proj:
            layers.add(int(m.group(1)))
        if not (proj if linear else peft_selects(target_modules, name)):
            continue
        if exclude_modules and peft_selects(exclude_modules, name):
            excluded = True
            continue
        if not proj:
            raise ValueError(f"{shown} matches the module {name} ({_how(target_modules)}): meshppo's LoRA targets "
                             f"only the decoder layers' projections {_projections(model_type)}")
        per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    for key, spec in (("target_modules", None if linear else target_modules), ("exclude_modules", exclude_modules)):
        if isinstance(spec, list):
            unused = [e for e in spec if not any(peft_selects([e], n) for n in names)]
            if unused:
                raise ValueError(f"{key} has {unused}, which names no module ({_how(spec)}): meshppo's LoRA targets "
                                 f"the projections {_projections(model_type)}{_fused_note(unused, model_type)}")
        elif key == "exclude_modules" and spec and not any(peft_selects(spec, n) for n in names):
            raise ValueError(f"exclude_modules={spec!r} matches no module: {_how(spec)}")
    if not per_layer:
        if excluded:
            raise ValueError(f"{shown} leaves no module: exclude_modules takes out every module target_modules "
                             "selects (peft refuses it too)")
        raise ValueError(f"target_modules={target_modules!r} matches no module: {_how(target_modules)} "
                         f"(give a list for names such as {_projections(model_type)[0]})"
                         f"{_fused_note([], model_type)}")
    sets = {i: per_layer.get(i, set()) for i in sorted(layers)}
    first = sets[min(sets)]
    for i, got in sets.items():
        if got != first:
            raise ValueError(f"{shown} selects {sorted(first)} in layer {min(sets)} but {sorted(got)} in layer {i}: "
                             "meshppo's adapters cover the same projections in every layer")
    return tuple(p for p in ALL_LINEAR + _FUSED_MODULES if p in first)


def _projections(model_type: str | None) -> list[str]:
    """The projections peft can target on `model_type`'s transformers model (Phi3: qkv_proj, o_proj, gate_up_proj,
    down_proj), in model order."""
    fused = fused_parts(model_type)
    parts = {p for ps in fused.values() for p in ps}
    out = []
    for p in ALL_LINEAR:
        out += [f for f, ps in fused.items() if ps[0] == p] if p in parts else [p]
    return out


def fused_parts(model_type: str | None) -> dict[str, tuple[str, ...]]:
    """`{fused module: its parts}` of `model_type`'s transformers model (`FUSED_PROJECTIONS`, by projection name:
    Phi3's qkv_proj: (q_proj, k_proj, v_proj), gate_up_proj: (gate_proj, up_proj)); {} for a type without."""
    return {m.rsplit(".", 1)[1]: tuple(p.rsplit(".", 1)[1] for p in parts)
            for m, parts in FUSED_PROJECTIONS.get(model_type, {}).items()}


def _fused_note(entries: list[str], model_type: str | None) -> str:
    """Where target_modules / exclude_modules name what `model_type`'s transformers model lacks: a fused module on
    a model without it, or (on a model that fuses them, Phi3) a part of a fused module, which peft cannot adapt
    alone. Empty when neither applies."""
    here = fused_parts(model_type)
    if here:
        hit = {e: f for e in entries for f, ps in here.items() if e in ps}
        if not hit and entries:
            return ""
        said = ", ".join(f + " = " + " / ".join(ps) for f, ps in here.items())
        return (f" (transformers' {HF_FAMILY[model_type]} fuses {said}: peft adapts a fused module whole, one adapter "
                "of rank lora_rank, and cannot select a part of it)")
    elsewhere = {module.rsplit(".", 1)[1]: model_type for model_type, modules in FUSED_PROJECTIONS.items()
                 for module in modules}
    hit = [e for e in entries if e in elsewhere]
    if not hit:
        return ""
    return " (" + "; ".join(f"{e} is transformers' {HF_FAMILY[elsewhere[e]]} "
                            f"{' / '.join(fused_parts(elsewhere[e])[e])} fused, a module of {elsewhere[e]} models only"
                            for e in hit) + ")"


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update (peft's `lora.Linear`, without dropout)."""

    lora_A: nn.Parameter  # [r, in]
    lora_B: nn.Parameter  # [out, r]
    scaling: float
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return y
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def inject_lora(model: nn.Module, cfg: LoRAConfig, generator: torch.Generator | None = None) -> nn.Module:
    """Turn the targeted projections of every block of `model` (a `models.Transformer`) into
    `LoRALinear`, in place, and freeze everything but the adapters (and a value head).

    Works on the meta device (then `lora_init_tensors` gives the initial values after
    `to_empty`, e.g. through `sharding.build_fsdp_model(..., lora=cfg)`); on a materialised
    model the adapters are initialised here from `generator`. Must precede `apply_fsdp`.
    """
    if getattr(model, "lora_config", None) is not None:
        raise RuntimeError("inject_lora was already applied to this model")
    if any(type(p) is not nn.Parameter for p in model.parameters()):
        raise RuntimeError("inject_lora must run before the model is sharded (apply_fsdp)")
    heads = VALUE_HEAD if hasattr(model, "score") else LM_HEAD
    targets = model_targets(cfg, getattr(model, "args", None), len(model.layers), heads)  # on every layer
    fused = fused_parts(getattr(getattr(model, "args", None), "model_type", None))
    for i, block in enumerate(model.layers):
        for target in targets:
            shared = None  # the parts of a fused module share its one A (peft's A of the fused projection)
            for proj in fused.get(target, (target,)):
                name = f"layers.{i}.{'self_attn' if proj in ATTN_PROJ else 'mlp'}.{proj}"
                module = getattr(block.self_attn if proj in ATTN_PROJ else block.mlp, proj)
                if type(module) is not nn.Linear:
                    raise TypeError(f"{name} is a {type(module).__name__}, LoRA needs an nn.Linear")
                w = module.weight
                module.__class__ = LoRALinear
                if shared is None:
                    shared = nn.Parameter(torch.empty(cfg.rank, w.shape[1], device=w.device, dtype=w.dtype))
                module.lora_A = shared
                module.lora_B = nn.Parameter(torch.empty(w.shape[0], cfg.rank, device=w.device, dtype=w.dtype))
                module.scaling = cfg.scaling
                module.lora_enabled = True
    model.lora_config = cfg
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name) or name.startswith("score."))
    if not any(p.is_meta for p in model.parameters()):
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, t in lora_init_tensors(model, generator):
                params[name].copy_(t)
    return model


def model_targets(cfg: LoRAConfig, args, num_layers: int | None = None,
                  heads: tuple[str, ...] = LM_HEAD) -> tuple[str, ...]:
    """The modules `cfg`'s target_modules and exclude_modules select on the model `args` describes (of
    `num_layers` blocks, default its own; a value model: `heads` VALUE_HEAD), as peft selects them on its
    transformers model, by its names: a Phi3's fused qkv_proj / gate_up_proj (`fused_parts`: one adapter
    each, its parts sharing one A), where a part alone (q_proj) names no module and is refused; a mixture of
    experts' sparse layers without MLP projections (their experts are no nn.Linear: all-linear adapts the attention's
    projections there, and a selection that differs between its sparse and dense layers is refused)."""
    model_type = getattr(args, "model_type", None)
    if model_type in MOE_TYPES and cfg.target_modules == "all-linear":
        block, router = _sparse_block_names(model_type)
        raise ValueError(f"target_modules='all-linear' on a {model_type} model is not supported (lora_rank > 0): peft "
                         f"with transformers 5 then adapts each layer's router ({block}.{router}) and stacked experts "
                         f"({block}.experts' gate_up_proj and down_proj, its target_parameters) beside the attention, and "
                         "meshppo's LoRA adapts linear projections only; give target_modules the attention's "
                         "projections, [q_proj, k_proj, v_proj, o_proj] or some of them")
    layers = num_layers if num_layers is not None else args.num_hidden_layers
    names = _hf_module_names(layers, heads, model_type, getattr(args, "moe_layers", ()))
    return peft_targets(cfg.target_modules, names, cfg.exclude_modules, model_type)


def shared_a_name(name: str) -> str:
    """The name under which the `lora_A` of the adapter `name` (layers.0.self_attn.k_proj.lora_A) is a model's
    parameter (`named_parameters`, state dicts, peft files): the first part's, q_proj / gate_proj, for a
    part that a model type fuses (`FUSED_PROJECTIONS`) and shares its A, else `name` itself; a model whose
    k_proj has its own A (llama) lists it under its own name."""
    mod, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
    for modules in FUSED_PROJECTIONS.values():
        for parts in modules.values():
            leaves = [p.rsplit(".", 1)[1] for p in parts]
            if leaf in leaves:
                return f"{mod}.{leaves[0]}.lora_A"
    return name


def is_lora_name(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """`{module name: LoRALinear}` (empty for a model without adapters)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_init_tensors(model: nn.Module, generator: torch.Generator | None = None):
    """Yield `(name, full initial tensor)` on CPU for every adapter parameter: A Kaiming-uniform as peft
    (`a=√5`), B zero. Drawn from its own generator, so the base weights of a seeded build are
    those of the same build without LoRA."""
    for name, p in model.named_parameters():  # a fused module's shared A once, as peft initialises it
        if name.endswith(".lora_A"):
            a = torch.empty(p.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            yield name, a
        elif name.endswith(".lora_B"):
            yield name, torch.zeros(p.shape)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer gets: the adapters (and a value head) of a LoRA model, all parameters otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    for m in lora_modules(model).values():
        m.lora_enabled = enabled


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block: the reference policy of a LoRA actor.

    Use it around forward-only passes (`torch.no_grad()`): a backward recomputing checkpointed
    blocks after the block has exited would see the adapters on again.
    """
    mods = lora_modules(model)
    if not mods:
        raise ValueError("adapters_disabled: the model has no LoRA adapters")
    before = {n: m.lora_enabled for n, m in mods.items()}
    set_adapters_enabled(model, False)
    try:
        yield model
    finally:
        for n, m in mods.items():
            m.lora_enabled = before[n]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter parameters of `model` by meshppo name (`layers.0.self_attn.q_proj.lora_A`).
    On a sharded model these are the local shards; `sharding.gather_full_state_dict(model,
    trainable_only=True)` gathers the full ones."""
    return {n: p for n, p in model.named_parameters() if is_lora_name(n)}


def merge_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """`weight + scaling · B @ A` in float32, cast once to `dtype` (default: the weight's).

    The one definition of the merge: the merged export and the resharder (on TP slices:
    rows of B for a row slice of the weight, columns of A for a column slice) both call it."""
    merged = weight.float() + (lora_B.float() @ lora_A.float()) * scaling
    return merged.to(dtype or weight.dtype)


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters → the plain model's state dict with the adapters merged
    into their weights (`merge_weight`), for `Transformer.save_pretrained`."""
    out = {k: v for k, v in state_dict.items() if not is_lora_name(k)}
    for k in state_dict:
        if k.endswith(".lora_B"):
            mod = k[:-len(".lora_B")]
            a = state_dict.get(mod + ".lora_A")
            a = state_dict[shared_a_name(mod + ".lora_A")] if a is None else a
            out[mod + ".weight"] = merge_weight(state_dict[mod + ".weight"], a, state_dict[k], scaling)
    return out


# ------------------------------------------------------------------ peft files
def _peft_key(name: str) -> str:
    mod, which = name.rsplit(".", 1)  # "layers.0.self_attn.q_proj", "lora_A"
    return f"{_PEFT_PREFIX}{meshppo_key_to_hf(mod)}.{which}.weight"


def _meshppo_key(key: str) -> str | None:
    if not (key.startswith(_PEFT_PREFIX + "model.") and key.endswith((".lora_A.weight", ".lora_B.weight"))):
        return None
    return key[len(_PEFT_PREFIX + "model."):-len(".weight")]


def save_peft_adapter(path: str | os.PathLike, adapters: dict[str, torch.Tensor], cfg: LoRAConfig,
                      base_model_name_or_path: str | None = None, *, model_type: str) -> None:
    """Write `adapters` (full tensors by meshppo name, e.g. `adapter_state_dict(model)`) of a `model_type`
    model as a peft adapter directory. On a type whose checkpoints fuse projections (a Phi3's q / k / v,
    gate / up, whose adapters share one A: `inject_lora`) each fused module's parts are written as peft's
    one adapter on it (`_fuse_adapters`), and target_modules names the fused modules. The weights go under
    a temporary name first, so an interrupted save never leaves a half-written file under the final name."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {_peft_key(k): v.detach().contiguous().cpu() for k, v in _fuse_adapters(adapters, model_type).items()}
    if not tensors:
        raise ValueError("save_peft_adapter: no adapter tensors given")
    tmp = path / (ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / ADAPTER_WEIGHTS)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "target_modules": _written_targets(cfg.targets, model_type), "lora_dropout": 0.0, "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path, "inference_mode": True, **_PEFT_UNSUPPORTED,
    }
    with open(path / ADAPTER_CONFIG, "w") as f:
        json.dump(config, f, indent=2)


def _fuse_adapters(adapters: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """meshppo's adapter tensors (by name) of a `model_type` model with the parts of each projection its
    checkpoints fuse (`fused_parts`: a Phi3's qkv_proj, gate_up_proj) as peft's one adapter on the fused
    module: the parts' shared A (under the first part's name, `shared_a_name`; a full state dict may list
    it under every part's) and their B stacked by rows in transformers' order."""
    out = {k: v for k, v in adapters.items() if is_lora_name(k)}
    for fused, parts in fused_parts(model_type).items():
        for key in [k for k in out if k.endswith(f".{parts[0]}.lora_B")]:
            head = key[:-len(f"{parts[0]}.lora_B")]  # "layers.0.self_attn."
            missing = [f"{head}{p}.lora_B" for p in parts if f"{head}{p}.lora_B" not in out]
            if missing:
                raise ValueError(f"save_peft_adapter: {missing} missing: peft's adapter on {head}{fused} needs "
                                 f"every part's ({', '.join(parts)})")
            out[f"{head}{fused}.lora_B"] = torch.cat([out.pop(f"{head}{p}.lora_B") for p in parts])
            out[f"{head}{fused}.lora_A"] = out.pop(f"{head}{parts[0]}.lora_A")
            for p in parts[1:]:
                out.pop(f"{head}{p}.lora_A", None)
    return out


def _written_targets(targets: tuple[str, ...], model_type: str) -> list[str]:
    """adapter_config.json's target_modules: `targets` (`LoRAConfig.targets`) with each part of a module a
    `model_type` checkpoint fuses replaced by the fused module, as peft names the modules of that model."""
    fused_of = {p: fused for fused, parts in fused_parts(model_type).items() for p in parts}
    return list(dict.fromkeys(fused_of.get(t, t) for t in targets))


def _split_adapter(tensors: dict, args, source) -> dict:
    """A peft adapter's tensors (meshppo names, as the file has them) on the model `args` describes: an
    adapter on a projection its type fuses (a Phi3's qkv_proj) becomes its parts' adapters, A under the first
    part's name (the parts share it: `shared_a_name`), B split by rows (`models.checkpoint.split_fused`)."""
    from models.checkpoint import _fused_match, _fused_parts, split_fused

    firsts = {m: ps[0][0] for m, ps in _fused_parts(args).items()}
    out = {}
    for name, t in tensors.items():
        match = _fused_match(name, firsts)
        if match is not None and match[2] == "lora_A":
            out[f"{match[0]}.{firsts[match[1]]}.lora_A"] = t
        else:
            out.update(split_fused(name, t, args, source))
    return out


def read_peft_adapter_config(path: str | os.PathLike) -> tuple[LoRAConfig, dict]:
    """A peft LoRA adapter directory's `LoRAConfig` (its r, lora_alpha, target_modules and exclude_modules), and its
    adapter_config.json as read. Options meshppo's adapters lack (DoRA, rsLoRA, per-layer ranks,
    Activated LoRA, ...) are refused: ValueError naming the file and the key."""
    cfg_file = Path(path) / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(f"lora_adapter_path {str(path)!r} has no {cfg_file.name}")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_file}: not readable JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        found = raw.get("peft_type") if isinstance(raw, dict) else raw
        raise ValueError(f"{cfg_file}: peft_type is {found!r}, meshppo loads LORA adapters")
    for key, value in raw.items():
        if key not in _PEFT_HARMLESS and value not in (_PEFT_UNSUPPORTED.get(key), None, False, {}, [], "none"):
            raise ValueError(f"{cfg_file}: {key}={value!r} is not supported by meshppo's LoRA")
    try:
        cfg = LoRAConfig(rank=raw.get("r"), alpha=raw.get("lora_alpha"), target_modules=raw.get("target_modules"),
                         exclude_modules=raw.get("exclude_modules"))
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    return cfg, raw


def _open_adapter_weights(path: str | os.PathLike):
    """(its `LoRAConfig`, the weights file, the file opened with `safetensors.safe_open`, `{meshppo name:
    key in the file}`): the adapter's config and its weights' header, no tensor data. The one reading of
    an adapter directory, for `read_peft_adapter_shapes` and `read_peft_adapter`."""
    from safetensors import safe_open

    from models.checkpoint import _NOT_SAFETENSORS, reading

    cfg, _ = read_peft_adapter_config(path)
    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"lora_adapter_path {str(path)!r} has no {weights.name}")
    with reading(weights, what=_NOT_SAFETENSORS):
        f = safe_open(str(weights), framework="pt")
    keys = {}
    for key in f.keys():
        name = _meshppo_key(key)
        if name is None:
            f.__exit__(None, None, None)
            raise ValueError(f"{weights}: tensor {key!r} is not a LoRA A/B weight of the decoder layers")
        keys[name] = key
    return cfg, weights, f, keys


def read_peft_adapter_shapes(path: str | os.PathLike,
                             model_args=None) -> tuple[LoRAConfig, dict[str, tuple[int, ...]]]:
    """A peft LoRA adapter directory's `LoRAConfig` and its tensors' shapes by meshppo name, from
    its config and its weights' safetensors header alone: no tensor is read (a 70B model's adapter is
    gigabytes). Its config as `read_peft_adapter_config` reads it; a weights file that is not
    safetensors (truncated, foreign) raises `models.checkpoint.CheckpointFileError` (a ValueError)
    naming it. Given the base model's `ModelArgs` `model_args`, the shapes are checked
    (`check_adapter`) against that model's adapters, built on the meta device: a ValueError names
    the file and the tensor."""
    from models.checkpoint import _NOT_SAFETENSORS, reading

    cfg, weights, f, keys = _open_adapter_weights(path)
    with f, reading(weights, what=_NOT_SAFETENSORS):
        shapes = {name: tuple(f.get_slice(key).get_shape()) for name, key in keys.items()}
    if model_args is not None:
        from models.transformer import Transformer

        with torch.device("meta"):
            model = inject_lora(Transformer(model_args), cfg)
            split = _split_adapter({n: torch.empty(s) for n, s in shapes.items()}, model_args, weights)
        check_adapter(model, cfg, {n: tuple(t.shape) for n, t in split.items()}, str(weights))
    return cfg, shapes


def read_peft_adapter(path: str | os.PathLike, model_args=None) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """Read a peft LoRA adapter directory → (its `LoRAConfig`, full tensors by meshppo name): where
    the model is built (`sharding.build_fsdp_model`, `load_peft_adapter`). Given the model's `ModelArgs`
    `model_args`, an adapter on a projection its type fuses (a Phi3's qkv_proj) comes as its parts'
    (`_split_adapter`: one shared A, B split by rows); without, as the file names it. The config, the file and
    the tensors' names are read and refused as by `read_peft_adapter_shapes`, which checks an
    adapter before the run without reading its tensors."""
    from models.checkpoint import _NOT_SAFETENSORS, reading

    cfg, weights, f, keys = _open_adapter_weights(path)
    with f, reading(weights, what=_NOT_SAFETENSORS):
        tensors = {name: f.get_tensor(key) for name, key in keys.items()}
    if model_args is not None:
        tensors = _split_adapter(tensors, model_args, weights)
    return cfg, tensors


def check_adapter_config(mine: LoRAConfig, cfg: LoRAConfig, source: str, args=None) -> None:
    """Raise ValueError naming `source` unless the adapter's `cfg` has the rank, alpha and targets of `mine` (on
    the model `args` describes: `model_targets`, a Phi3's fused modules; without, `LoRAConfig.targets`)."""
    try:
        targets = (cfg.targets, mine.targets) if args is None else (model_targets(cfg, args), model_targets(mine, args))
    except ValueError as e:
        raise ValueError(f"adapter {source!r}: {e}") from None
    for what, theirs, ours in (("r (lora_rank)", cfg.rank, mine.rank), ("lora_alpha", cfg.alpha, mine.alpha),
                               ("target_modules", *targets)):
        if theirs != ours:
            raise ValueError(f"adapter {source!r} has {what}={theirs!r}, the configuration says {ours!r}")


def check_adapter(model: nn.Module, cfg: LoRAConfig, tensors: dict[str, torch.Tensor | tuple[int, ...]],
                  source: str) -> None:
    """Raise ValueError naming `source` unless `tensors` (by meshppo name: the tensors of
    `read_peft_adapter`, or their shapes, `read_peft_adapter_shapes`) are exactly the adapters of
    `model` with the same rank, alpha and targets."""
    mine: LoRAConfig | None = getattr(model, "lora_config", None)
    if mine is None:
        raise ValueError(f"adapter {source!r}: the model has no LoRA adapters (inject_lora first)")
    check_adapter_config(mine, cfg, source, getattr(model, "args", None))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if is_lora_name(n)}
    if set(tensors) != set(shapes):
        extra, missing = sorted(set(tensors) - set(shapes)), sorted(set(shapes) - set(tensors))
        raise ValueError(f"adapter {source!r} does not match the model: extra {extra[:4]}, missing {missing[:4]}")
    for n, t in tensors.items():
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
        if shape != shapes[n]:
            raise ValueError(f"adapter {source!r}: {n} has shape {shape}, the model needs {shapes[n]}")


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy a peft adapter into an (unsharded) LoRA model; `sharding.build_fsdp_model(...,
    lora=cfg, lora_adapter_path=path)` does it for a sharded one."""
    cfg, tensors = read_peft_adapter(path, model.args)
    check_adapter(model, cfg, tensors, str(path))
    params = dict(model.named_parameters())
    for n, t in tensors.items():
        params[n].copy_(t)
