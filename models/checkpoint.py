"""Hugging Face checkpoint directories: `config.json` + single or sharded `*.safetensors`.

Loading builds the model on the meta device and copies one tensor at a time out of the
memory-mapped safetensors files, so a large model never exists whole in CPU RAM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from models.args import ModelArgs, apply_overrides

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

# HF keys carry a `model.` prefix on the backbone; heads sit at the top level.
_TOP_LEVEL = ("lm_head.", "score.")


def hf_key_to_meshppo(key: str) -> str | None:
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith(_TOP_LEVEL):
        return key
    return None


def meshppo_key_to_hf(key: str) -> str:
    return key if key.startswith(_TOP_LEVEL) else "model." + key


def hf_architecture(model_type: str, head: str = "lm") -> str:
    """The transformers class a directory of `model_type` is written as: a causal LM (`head="lm"`) or, for a
    value model, a token classifier."""
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    return f"{family}ForCausalLM" if head == "lm" else f"{family}ForTokenClassification"


class CheckpointFileError(ValueError):
    """A file of a model or checkpoint directory that cannot be used (malformed, truncated, unsupported):
    the message names the file."""


# What an unknown, misshapen or missing tensor most often means.
_MISMATCH = " (the model that its config.json, with any override_config, describes is not the one its weights hold)"


def load_model_args(path, overrides: dict | None = None) -> ModelArgs:
    """The `ModelArgs` of checkpoint directory `path`'s config.json, with verl's
    `model.override_config` `overrides` applied (`models.args.apply_overrides`)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    try:
        args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError) as e:
        raise CheckpointFileError(f"{str(path / 'config.json')!r}: {str(e).splitlines()[0]}") from None
    return apply_overrides(args, overrides)


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    if (path / SAFE_INDEX).is_file():
        with open(path / SAFE_INDEX) as f:
            weight_map = json.load(f)["weight_map"]
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


def iter_hf_tensors(path):
    """Yield `(meshppo_name, tensor)` from a checkpoint directory, one tensor at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        try:
            f = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors' own error type: a truncated or foreign file
            raise CheckpointFileError(f"{str(file)!r} is not a readable safetensors file ({e})") from None
        with f:
            for key in f.keys():
                name = hf_key_to_meshppo(key)
                if name is not None:
                    yield name, f.get_tensor(key)


def checkpoint_tensor_names(path) -> set[str]:
    """The meshppo names of the tensors in a checkpoint directory (read from the safetensors
    headers: no tensor is loaded)."""
    from safetensors import safe_open

    names = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
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
    for name, tensor in iter_hf_tensors(path):
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


def save_pretrained(model, path, state_dict=None, max_shard_size: int = 5 * 2**30):
    """Write `config.json` and safetensors (sharded with an index above `max_shard_size` bytes).

    `state_dict` defaults to the model's own; pass a gathered full state dict for a sharded
    model. Files are written under a temporary name and renamed, so an interrupted save
    never leaves a half-written weight file under the final name.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args: ModelArgs = model.args
    hf_config = args.to_hf_config(architecture=hf_architecture(args.model_type, model.head))
    if model.head == "value":
        hf_config.num_labels = 1
    sd = state_dict if state_dict is not None else model.state_dict()
    tensors = {meshppo_key_to_hf(k): v.detach().contiguous().cpu() for k, v in sd.items()}

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
