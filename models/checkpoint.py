"""Hugging Face checkpoint directories: `config.json` + single or sharded `*.safetensors`.

Loading builds the model on the meta device and copies one tensor at a time out of the
memory-mapped safetensors files, so a large model never exists whole in CPU RAM.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from models.args import FUSED_PROJECTIONS, HF_FAMILY, ModelArgs, check_hf_model_type, check_overrides

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

# HF keys carry a `model.` prefix on the backbone; heads sit at the top level.
_TOP_LEVEL = ("lm_head.", "score.")


# Buffers older transformers wrote into checkpoints (RoPE's frequencies, recomputed from config.json;
# transformers ignores them when it loads).
_UNSAVED_BUFFERS = (".rotary_emb.inv_freq",)


def hf_key_to_meshppo(key: str) -> str | None:
    """The meshppo name of an HF checkpoint's tensor; None for one meshppo does not load (not the model's
    backbone or head, or a buffer transformers does not load either)."""
    if key.endswith(_UNSAVED_BUFFERS):
        return None
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith(_TOP_LEVEL):
        return key
    return None


def meshppo_key_to_hf(key: str) -> str:
    return key if key.startswith(_TOP_LEVEL) else "model." + key


# The types whose transformers family has no ...ForTokenClassification: a value model of one has no transformers
# class that reads it back (OLMo-2's Olmo2ForSequenceClassification and Gemma 3's Gemma3TextForSequenceClassification
# score each sequence's last token only; Granite, Granite-MoE and OLMoE have no classifier at all).
NO_TOKEN_CLASSIFIER = ("gemma3_text", "granite", "granitemoe", "granitemoeshared", "olmo2", "olmoe")


def hf_architecture(model_type: str, head: str = "lm") -> str:
    """The transformers class a directory of `model_type` is written as: a causal LM (`head="lm"`) or, for a
    value model, a token classifier; ValueError for a value model of a type whose family has none
    (`NO_TOKEN_CLASSIFIER`)."""
    family = HF_FAMILY[model_type]
    if head == "lm":
        return f"{family}ForCausalLM"
    if model_type in NO_TOKEN_CLASSIFIER:
        raise ValueError(value_export_refusal(model_type))
    return f"{family}ForTokenClassification"


def value_export_refusal(model_type: str) -> str:
    """Why a value model (critic) of `model_type` (`NO_TOKEN_CLASSIFIER`) is not written as a Hugging Face
    directory."""
    family = HF_FAMILY[model_type]
    import transformers

    sequence = f"{family}ForSequenceClassification"
    why = (f" (its {sequence} scores the last token of a sequence, not every token)" if hasattr(transformers, sequence)
           else "")
    article = "an" if model_type[0] in "aeiou" else "a"
    return (f"{article} {model_type} value model cannot be written as a Hugging Face directory: transformers has no "
            f"{family}ForTokenClassification{why}, so no transformers class would read its per-token values back; "
            "meshppo's own checkpoint (save_contents 'model') keeps it")


# The projections a type's checkpoints fuse that its transformers model holds fused too but peft does not see as
# meshppo's modules' (`FUSED_PROJECTIONS` is also LoRA's): Granite-MoE-Shared's shared expert's `input_linear`
# `[2 S, H]` (gate rows, then up rows: its `chunk(2)`), named here as `moe_name_from_checkpoint` renames it.
CHECKPOINT_FUSED = {"granitemoeshared": {"mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj",
                                                                             "mlp.shared_expert.up_proj")}}


def _fused_parts(args: ModelArgs) -> dict[str, tuple[tuple[str, int], ...]]:
    """The projections `args`' transformers checkpoints fuse (`FUSED_PROJECTIONS`, `CHECKPOINT_FUSED`): fused module
    -> meshppo's modules with their output rows, in the fused tensor's order (a shared expert's of its width)."""
    shapes = args._projection_shapes()
    fused = FUSED_PROJECTIONS.get(args.model_type, {}) | CHECKPOINT_FUSED.get(args.model_type, {})
    return {module: tuple((part, args.shared_expert_intermediate_size if part.startswith("mlp.shared_expert.")
                           else shapes[part.rsplit(".", 1)[1]][1]) for part in parts)
            for module, parts in fused.items()}


def _fused_match(name: str, modules) -> tuple[str, str, str] | None:
    """`(layer prefix, module, tensor suffix)` of `name` (`layers.3.self_attn.qkv_proj.weight`) where its
    module is one of `modules`; else None."""
    if not name.startswith("layers."):
        return None
    for module in modules:
        head, sep, tail = name.partition(f".{module}.")
        if sep and head.count(".") == 1:
            return head, module, tail
    return None


def split_fused(name: str, tensor: torch.Tensor, args: ModelArgs, path=None):
    """Yield the meshppo `(name, tensor)` pairs of one checkpoint tensor (meshppo-named): a fused projection of
    `args`' type (Phi3's qkv_proj, gate_up_proj) as its parts' row blocks, in transformers' order; any other as
    it is. A fused tensor whose rows are not its parts' raises `CheckpointFileError` naming `path`."""
    parts = _fused_parts(args)
    match = _fused_match(name, parts)
    if match is None:
        yield name, tensor
        return
    head, module, tail = match
    rows = [n for _, n in parts[module]]
    if tensor.dim() == 0 or tensor.shape[0] != sum(rows):
        raise CheckpointFileError(f"{name!r} in {str(path)!r} has shape {tuple(tensor.shape)}, expected {sum(rows)} "
                                  f"rows ({' + '.join(f'{p} {n}' for p, n in parts[module])}){_MISMATCH}")
    for (part, _), piece in zip(parts[module], tensor.split(rows)):
        yield f"{head}.{part}.{tail}", piece


def fuse_parts(state_dict: dict, args: ModelArgs) -> dict:
    """`state_dict` (meshppo names) with the projections `args`' transformers checkpoints fuse concatenated
    under the fused module's name (rows in transformers' order): `split_fused`'s inverse, for the export."""
    parts = _fused_parts(args)
    if not parts:
        return state_dict
    firsts = {ps[0][0]: fused for fused, ps in parts.items()}
    out = {}
    for name, tensor in state_dict.items():
        match = _fused_match(name, firsts)
        if match is None:
            if _fused_match(name, [p for ps in parts.values() for p, _ in ps[1:]]) is None:
                out[name] = tensor
            continue
        head, first, tail = match
        fused = firsts[first]
        out[f"{head}.{fused}.{tail}"] = torch.cat([state_dict[f"{head}.{p}.{tail}"] for p, _ in parts[fused]])
    return out


# A mixture-of-experts layer's tensor of one expert as transformers' checkpoints store it (the hub's Qwen3-MoE
# files, and what transformers 5's save_pretrained writes): `layers.3.mlp.experts.17.gate_proj.weight`.
_EXPERT_TENSOR = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# meshppo's stacked tensors (transformers 5's in-memory names) -> the per-expert projections they stack, each
# expert's rows in this order (gate_up_proj: gate, then up, as transformers' `chunk(2)` splits them)
_EXPERT_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# The types whose checkpoints name a mixture-of-experts layer's modules otherwise than transformers 5 (and meshppo) in
# memory: its module in place of `mlp`, and each expert projection's name (transformers' conversion_mapping renames
# them as it loads and back as save_pretrained writes). Mixtral's: `layers.3.block_sparse_moe.gate.weight`,
# `layers.3.block_sparse_moe.experts.5.w1.weight` (gate_proj; w3 up_proj, w2 down_proj).
CHECKPOINT_MOE_NAMES = {"mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
# The types whose checkpoints name a layer's mixture-of-experts tensors otherwise, tensor by tensor (under the layer:
# meshppo's name -> the checkpoint's): Granite-MoE's stacked experts (`block_sparse_moe.input_linear.weight [E, 2I,
# H]`, gate rows first, and `output_linear.weight [E, H, I]`, as transformers' ParallelExperts stores them) and router
# (`block_sparse_moe.router.layer.weight [E, H]`), as the hub's files and transformers' save_pretrained write them
# (its conversion_mapping renames them to its in-memory names, `block_sparse_moe.experts.gate_up_proj` ..., which
# load too); Granite-MoE-Shared's also its shared expert, `shared_mlp.input_linear.weight [2 S, H]` (fused:
# `CHECKPOINT_FUSED`) and `shared_mlp.output_linear.weight [H, S]`.
_GRANITE_MOE_TENSORS = {"mlp.gate.weight": "block_sparse_moe.router.layer.weight",
                        "mlp.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
                        "mlp.experts.down_proj": "block_sparse_moe.output_linear.weight",
                        "mlp.shared_expert.gate_up_proj.weight": "shared_mlp.input_linear.weight",
                        "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight"}
_GRANITE_MOE_IN_MEMORY = {"mlp.gate.weight": "block_sparse_moe.router.weight",
                          "mlp.experts.gate_up_proj": "block_sparse_moe.experts.gate_up_proj",
                          "mlp.experts.down_proj": "block_sparse_moe.experts.down_proj"}
CHECKPOINT_MOE_TENSORS = {"granitemoe": _GRANITE_MOE_TENSORS, "granitemoeshared": _GRANITE_MOE_TENSORS}
_LAYER_TENSOR = re.compile(r"^(layers\.\d+)\.(.+)$")


def moe_name_from_checkpoint(name: str, model_type: str) -> str:
    """meshppo's name of a checkpoint tensor (`model.`-less) of a `CHECKPOINT_MOE_NAMES` type: a Mixtral's
    `layers.3.block_sparse_moe.experts.5.w1.weight` is `layers.3.mlp.experts.5.gate_proj.weight`; of a
    `CHECKPOINT_MOE_TENSORS` type: a Granite-MoE's `layers.3.block_sparse_moe.input_linear.weight` (or transformers'
    in-memory `block_sparse_moe.experts.gate_up_proj`) is `layers.3.mlp.experts.gate_up_proj`; any other name as it
    is."""
    if model_type in CHECKPOINT_MOE_TENSORS:
        layer = _LAYER_TENSOR.match(name)
        if layer is None:
            return name
        mine = {v: k for names in (CHECKPOINT_MOE_TENSORS[model_type], _GRANITE_MOE_IN_MEMORY)
                for k, v in names.items()}
        return f"{layer.group(1)}.{mine[layer.group(2)]}" if layer.group(2) in mine else name
    if model_type not in CHECKPOINT_MOE_NAMES:
        return name
    module, projs = CHECKPOINT_MOE_NAMES[model_type]
    head, sep, tail = name.partition(f".{module}.")
    if not (sep and head.startswith("layers.") and head.count(".") == 1):
        return name
    expert = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", tail)
    mine = {v: k for k, v in projs.items()}
    if expert and expert.group(2) in mine:
        tail = f"experts.{expert.group(1)}.{mine[expert.group(2)]}.weight"
    return f"{head}.mlp.{tail}"


def moe_name_to_checkpoint(name: str, model_type: str) -> str:
    """`moe_name_from_checkpoint`'s inverse, for the export (a sparse layer's `mlp.` names only: a type of
    `CHECKPOINT_MOE_NAMES` or `CHECKPOINT_MOE_TENSORS` has no dense layers); the checkpoint's names, not transformers'
    in-memory ones."""
    if model_type in CHECKPOINT_MOE_TENSORS:
        layer = _LAYER_TENSOR.match(name)
        theirs = CHECKPOINT_MOE_TENSORS[model_type]
        return f"{layer.group(1)}.{theirs[layer.group(2)]}" if layer and layer.group(2) in theirs else name
    if model_type not in CHECKPOINT_MOE_NAMES:
        return name
    module, projs = CHECKPOINT_MOE_NAMES[model_type]
    head, sep, tail = name.partition(".mlp.")
    if not (sep and head.startswith("layers.") and head.count(".") == 1):
        return name
    expert = _EXPERT_TENSOR.match(name)
    if expert:
        tail = f"experts.{expert.group(2)}.{projs[expert.group(3)]}.weight"
    return f"{head}.{module}.{tail}"


class ExpertStacker:
    """Stacks a checkpoint's per-expert tensors (`_EXPERT_TENSOR`) into meshppo's `[E, ...]` parameters as they are
    read: `add` returns each stacked tensor once all its experts' pieces have come (one layer's experts held at a
    time where the files keep a layer together), `finish` raises for what never completed. A piece of another
    shape than `args` gives, or of an expert index >= num_experts, raises `CheckpointFileError` naming `path`."""

    def __init__(self, args: ModelArgs, path=None):
        self.args, self.path, self.pending = args, path, {}
        i, h = args.moe_intermediate_size, args.hidden_size
        self.shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        prefix, expert, proj = _EXPERT_TENSOR.match(name).groups()
        expert, n = int(expert), self.args.num_experts
        if expert >= n or tuple(tensor.shape) != self.shapes[proj]:
            why = (f"an expert index beyond num_experts={n}" if expert >= n
                   else f"shape {tuple(tensor.shape)}, expected {self.shapes[proj]}")
            raise CheckpointFileError(f"{name!r} in {str(self.path)!r} has {why}{_MISMATCH}")
        stack = next(s for s, projs in _EXPERT_STACKS.items() if proj in projs)
        pieces = self.pending.setdefault(f"{prefix}.{stack}", {})
        pieces[(expert, proj)] = tensor
        if len(pieces) < n * len(_EXPERT_STACKS[stack]):
            return []
        del self.pending[f"{prefix}.{stack}"]
        return [(f"{prefix}.{stack}", torch.stack([torch.cat([pieces[(e, p)] for p in _EXPERT_STACKS[stack]])
                                                   for e in range(n)]))]

    def finish(self) -> None:
        if self.pending:
            name, pieces = next(iter(self.pending.items()))
            raise CheckpointFileError(f"checkpoint {str(self.path)!r} has {len(pieces)} of the {self.args.num_experts} "
                                      f"experts' tensors of {name!r}{_MISMATCH}")


def unstack_experts(state_dict: dict, model_type: str) -> dict:
    """`state_dict` (meshppo names) with each stacked expert tensor (`_EXPERT_STACKS`) written as transformers'
    checkpoints of `model_type` store it, one tensor per expert and projection: `ExpertStacker`'s inverse, for the
    export; as it is for a type whose checkpoints keep them stacked (`CHECKPOINT_MOE_TENSORS`: Granite-MoE's)."""
    if model_type in CHECKPOINT_MOE_TENSORS:
        return state_dict
    out = {}
    for name, tensor in state_dict.items():
        prefix, _, stack = name.rpartition(".")
        if not (prefix.endswith(".mlp.experts") and stack in _EXPERT_STACKS):
            out[name] = tensor
            continue
        projs = _EXPERT_STACKS[stack]
        for e, rows in enumerate(tensor):
            # (copies: safetensors refuses to write tensors that share memory)
            out.update({f"{prefix}.{e}.{p}.weight": piece.clone() for p, piece in zip(projs, rows.chunk(len(projs)))})
    return out


class CheckpointFileError(ValueError):
    """A file of a model or checkpoint directory that cannot be used (malformed, truncated, unsupported):
    the message names the file."""


def _file_errors() -> tuple[type[BaseException], ...]:
    """What reading or parsing a file raises when the file is bad (unreadable, not JSON, a key or value
    the reader needs missing or of the wrong type, a truncated or foreign safetensors file, a config
    that transformers' or meshppo's model arguments refuse)."""
    from safetensors import SafetensorError

    errors: list[type[BaseException]] = [OSError, ValueError, KeyError, TypeError, ArithmeticError, SafetensorError]
    with suppress(ImportError):  # transformers v5's config validation (absent from older huggingface_hub)
        from huggingface_hub.errors import StrictDataclassError
        errors.append(StrictDataclassError)
    return tuple(errors)


def one_line(e: BaseException, limit: int = 400) -> str:
    """`e` as one line: its type and its message's lines joined, cut at `limit` characters."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextmanager
def reading(file, key: str | None = None, what: str | None = None):
    """Turn what reading or parsing `file` raises for a bad file (`_file_errors`) into one
    `CheckpointFileError` naming it, and `key` (the config key it came from) when given: `'FILE' (KEY):
    ERROR`, or `'FILE' (KEY) WHAT (ERROR)` with `what`. A `CheckpointFileError` raised inside passes as it is."""
    try:
        yield
    except CheckpointFileError:
        raise
    except _file_errors() as e:
        where = f"{str(file)!r}" + (f" ({key})" if key else "")
        raise CheckpointFileError(f"{where} {what} ({one_line(e)})" if what else f"{where}: {one_line(e)}") from None


# What an unknown, misshapen or missing tensor most often means.
_MISMATCH = " (the model that its config.json, with any override_config, describes is not the one its weights hold)"


def load_model_args(path, overrides: dict | None = None) -> ModelArgs:
    """The `ModelArgs` of checkpoint directory `path`'s config.json, with verl's
    `model.override_config` `overrides` (`models.args.check_overrides`) set on it before it is
    checked, as verl sets them on the Hugging Face config: `rope_scaling` replaces config.json's
    (null drops it, as in verl; a mapping replaces it whole, which verl 0.9.1 cannot do: it sets a
    mapping's keys one by one on the config's dict and fails), also a type meshppo refuses."""
    from transformers import AutoConfig

    acting = check_overrides(overrides or {})[0]  # a bad override is the option's error, not the file's
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    config_file = path / "config.json"
    with reading(config_file):
        hf_config = AutoConfig.from_pretrained(str(path))
        try:  # before its sizes (another type's may be elsewhere); whole (a way to a type meshppo reads)
            check_hf_model_type(getattr(hf_config, "model_type", None))
        except ValueError as e:
            raise CheckpointFileError(f"{str(config_file)!r}: {e}") from None
        _check_sizes(hf_config, config_file)
        args = ModelArgs.from_hf_config(hf_config, acting)
        if args.model_type == "llama" and args.attention_bias and "layers.0.self_attn.o_proj.bias" in \
                checkpoint_tensor_names(path):
            raise ValueError("config.json's llama with attention_bias=true, whose weights bias o_proj as "
                             "transformers' Llama then does, is not supported: meshppo's attention biases only q, "
                             "k and v (a Qwen2)")
        return args


# config.json's sizes that must be positive integers (None allowed for the optional ones)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")


def _check_sizes(hf_config, config_file: Path) -> None:
    """A size of config.json that is not a positive integer (an edited file: 0 heads, a string), named."""
    for key in _SIZES + _OPTIONAL_SIZES:
        value = getattr(hf_config, key, None)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if key == "num_key_value_heads" and value == 0:  # transformers' configs: 0 or null is num_attention_heads
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointFileError(f"{str(config_file)!r}: {key}={value!r} is not a positive integer")


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    index = path / SAFE_INDEX
    if index.is_file():
        with reading(index):
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointFileError(f"{str(index)!r} has no \"weight_map\" of tensor names to file names")
        files = sorted({path / name for name in weight_map.values()})
    elif (path / SAFE_SINGLE).is_file():
        files = [path / SAFE_SINGLE]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{SAFE_INDEX} in {str(path)!r} names missing files: {missing}")
    return files


_NOT_SAFETENSORS = "is not a readable safetensors file"


def iter_hf_tensors(path, args: ModelArgs | None = None):
    """Yield `(meshppo_name, tensor)` from a checkpoint directory of the model `args` describes (default: its
    config.json's), one tensor at a time; a projection its checkpoints fuse as its parts (`split_fused`), a
    mixture-of-experts layer's per-expert tensors stacked (`ExpertStacker`) once the layer's experts are read (its
    stacked tensors, as transformers 5 names them in memory, as they are), under meshppo's names where its type's
    checkpoints name them otherwise (`moe_name_from_checkpoint`: Mixtral's)."""
    from safetensors import safe_open

    args = args if args is not None else load_model_args(path)
    experts = ExpertStacker(args, path)

    for file in safetensors_files(path):
        with reading(file, what=_NOT_SAFETENSORS):
            f = safe_open(str(file), framework="pt")
        with f:
            for key in f.keys():
                name = hf_key_to_meshppo(key)
                if name is not None:
                    name = moe_name_from_checkpoint(name, args.model_type)
                    with reading(file, what=_NOT_SAFETENSORS):
                        tensor = f.get_tensor(key)
                    if _EXPERT_TENSOR.match(name):
                        yield from experts.add(name, tensor)
                    else:
                        yield from split_fused(name, tensor, args, path)
    experts.finish()


def checkpoint_tensor_names(path) -> set[str]:
    """The meshppo names of the tensors in a checkpoint directory (read from the safetensors
    headers: no tensor is loaded); a projection the checkpoint fuses (Phi3's qkv_proj) under its
    fused name, an expert's tensor under its own (`layers.0.mlp.experts.5.up_proj.weight`)."""
    from safetensors import safe_open

    names = set()
    for file in safetensors_files(path):
        with reading(file, what=_NOT_SAFETENSORS):
            f = safe_open(str(file), framework="pt")
        with f:
            names.update(n for n in map(hf_key_to_meshppo, f.keys()) if n is not None)
    return names


def load_pretrained(cls, path, dtype=torch.float32, device="cpu", head: str = "lm"):
    """Load a checkpoint into `cls(args, head)`.

    For `head="value"` the `score` weight comes from a `*ForTokenClassification` /
    `*ForSequenceClassification` checkpoint (a missing `score.bias` is zero); a causal-LM
    checkpoint has no head, which then starts at zero (the critic first predicts 0).
    """
    args = load_model_args(path)
    with torch.device("meta"):
        model = cls(args, head=head)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(model, path):
            params[name].copy_(tensor.to(dtype))
    model.reset_buffers()
    return model


def checkpoint_tensors(model, path):
    """Yield `(name, full tensor)` of checkpoint `path` for `model` (any `Transformer`, also a
    meta or sharded one), one at a time, with the loading rules: a tied or value model drops
    `lm_head.weight`; a value head the checkpoint lacks (a causal-LM checkpoint, or a
    SequenceClassification head without bias) starts at zero. Unknown, misshapen or missing
    tensors raise `CheckpointFileError` naming the checkpoint (an input error: its config.json
    does not describe its weights, or the model is another one). LoRA adapters (`models.lora`) are not part of
    a base checkpoint and are skipped."""
    from models.lora import is_lora_name

    params = {n: p for n, p in model.named_parameters() if not is_lora_name(n)}
    args = model.args
    seen = set()
    for name, tensor in iter_hf_tensors(path, args):
        if name not in params:
            if name == "lm_head.weight" and (model.head == "value" or args.tie_word_embeddings):
                continue
            raise CheckpointFileError(f"checkpoint {str(path)!r} has tensor {name!r} that the model does not "
                                      f"have{_MISMATCH}")
        if name == "score.weight" and tensor.shape[0] != 1:
            raise CheckpointFileError(f"score.weight in {str(path)!r} has {tensor.shape[0]} labels; a value head "
                                      "needs 1")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise CheckpointFileError(f"{name!r} in {str(path)!r} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(params[name].shape)}{_MISMATCH}")
        seen.add(name)
        yield name, tensor
    if model.head == "value":
        for name in ("score.weight", "score.bias"):
            if name not in seen:
                seen.add(name)
                yield name, torch.zeros(params[name].shape)
    missing = set(params) - seen
    if missing:
        raise CheckpointFileError(f"checkpoint {str(path)!r} lacks tensors: {sorted(missing)[:8]}{_MISMATCH}")


def save_pretrained(model, path, state_dict=None, max_shard_size: int = 5 * 2**30, dtype: torch.dtype | None = None):
    """Write `config.json` and safetensors (sharded with an index above `max_shard_size` bytes).

    `state_dict` defaults to the model's own; pass a gathered full state dict for a sharded
    model. Its floating-point tensors are written in `dtype`, by default the dtype of the
    checkpoint the model was read from (`ModelArgs.hf_dtype`: a bf16 base is saved bf16, as
    verl's model_merger saves it), else as they are; config.json names the dtype written. A projection
    transformers' checkpoints fuse is written fused (`fuse_parts`), a mixture-of-experts layer's experts one
    tensor per expert and projection (`unstack_experts`; Mixtral's under its checkpoints' names, Granite-MoE's stacked
    under its own, `moe_name_to_checkpoint`), as transformers 5's save_pretrained writes them. Files
    are written under a temporary name and renamed, so an interrupted save never leaves a
    half-written weight file under the final name.
    """
    from safetensors.torch import save_file

    args: ModelArgs = model.args
    architecture = hf_architecture(args.model_type, model.head)  # (a value model some type cannot be: refused first)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if dtype is None and args.hf_dtype is not None:
        dtype = getattr(torch, args.hf_dtype)
    sd = unstack_experts(fuse_parts(state_dict if state_dict is not None else model.state_dict(), args),
                         args.model_type)
    tensors = {meshppo_key_to_hf(moe_name_to_checkpoint(k, args.model_type)): (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
               .detach().contiguous().cpu() for k, v in sd.items()}
    written = {v.dtype for v in tensors.values() if v.is_floating_point()}
    hf_config = args.to_hf_config(architecture=architecture,
                                  dtype=str(written.pop()).removeprefix("torch.") if len(written) == 1 else None)
    if model.head == "value":
        hf_config.num_labels = 1

    shards, current, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = {}, 0
        current[k] = v
        size += nbytes
    shards.append(current)

    for old in list(path.glob("*.safetensors")) + [path / SAFE_INDEX]:
        if old.exists():
            old.unlink()
    if len(shards) == 1:
        names = [SAFE_SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        tmp = path / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / name)
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        with open(path / SAFE_INDEX, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config.save_pretrained(str(path))
