"""Distributed checkpoints of FSDP models and their optimizers (`torch.distributed.checkpoint`).

Each rank writes only its shards; the checkpoint records global shapes and placements, so it
loads on any world size or mesh (DCP reshards on load). Saving is atomic: everything goes to
`<dir>.tmp`, and rank 0 renames it to `<dir>` after every rank has finished writing, so a
crash mid-save never leaves a half-written checkpoint under the final name.

Loading runs no code from the checkpoint. DCP itself unpickles the `.metadata` file and the
non-tensor items (the optimizer's `param_groups` values) with plain `pickle`, which runs whatever
a crafted file names; `load_checkpoint` reads `.metadata` with an unpickler that rebuilds only
DCP's metadata classes, shapes, dtypes and paths, and the non-tensor items with
`torch.load(weights_only=True)`, as DCP already reads the tensors. A file that names anything
else is refused with `UnsafeCheckpointError` before it runs.

`gather_full_state_dict` assembles full CPU tensors on rank 0 for a Hugging Face export
(`Transformer.save_pretrained(path, state_dict=...)`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from models.checkpoint import CheckpointFileError
from sharding import comm
from sharding.fsdp import offloaded_states_resident

EXTRA_FILE = "extra.json"

# What the `.metadata` pickle of a DCP checkpoint names (torch 2.6 to 2.13), besides torch's dtypes
# and `pathlib.PosixPath` (the checkpoint path DCP records): the metadata dataclasses, the reader's
# per-item file offsets, `torch.Size`, and torch's lookup of a layout by name. Each only builds data.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds a pickle that does more than rebuild checkpoint data: loading it
    could run any code, so it was refused before anything in it ran."""


def unpickling_reason(err: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused (its other lines
    explain how to load the file unsafely, which is not advice meshppo repeats)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = [line for line in lines
              if not line.startswith(("Weights only load failed", "Please file an issue", "Check the documentation"))]
    return (detail or lines or [type(err).__name__])[0]


def _refusal(checkpoint, where: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint {str(checkpoint)!r} holds a pickle ({where}) that {what}: "
                                 "refusing to load it, as loading it could run any code")


def _weights_only_refusal(checkpoint, where: str, err: Exception) -> UnsafeCheckpointError:
    """The refusal of a pickle in `where` that torch's weights-only loader rejected with `err`."""
    blocked = re.search(r"GLOBAL ([\w.]+)", str(err))
    what = f"would call {blocked.group(1).rstrip('.')}" if blocked else f"is not plain data ({unpickling_reason(err)})"
    return _refusal(checkpoint, where, what)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, checkpoint):
        super().__init__(file)
        self.checkpoint = checkpoint

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        if module in ("pathlib", "pathlib._local") and name == "PosixPath":  # pathlib._local: Python >= 3.13
            return PosixPath
        raise _refusal(self.checkpoint, ".metadata", f"would call {module}.{name}")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by `_MetadataUnpickler`.

    `read_metadata` takes no `rank`: DCP then never falls back to per-rank metadata files, which
    `save_checkpoint` does not write.
    """

    def read_metadata(self) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, self.path).load()
            except (EOFError, pickle.UnpicklingError) as e:
                if isinstance(e, UnsafeCheckpointError):
                    raise
                raise CheckpointFileError(f"{str(path)!r} is truncated or corrupt ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{str(path)!r} is not the metadata of a torch.distributed.checkpoint "
                             f"(it holds a {type(metadata).__name__})")
        # as in FileSystemReader.read_metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner with the non-tensor items read by `torch.load(weights_only=True)`."""

    def __init__(self, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _weights_only_refusal(self.checkpoint, f"item {fqn!r}", e) from None
        # where DefaultLoadPlanner.load_bytes puts the item (torch 2.6 to 2.13)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
    """Save the sharded model (and optimizer) state to directory `path` (collective, atomic).

    `extra`: JSON-serialisable trainer state (step, KL coefficient, data position...) written
    by rank 0 next to the shards and returned by `load_checkpoint`.
    """
    path = Path(path)
    tmp = _tmp(path)
    main = comm.rank() == 0
    # Rank 0 alone clears, writes `extra` and renames: each step is agreed by every rank
    # (`comm.on_every_rank`), so a write error there (a full disk) is `comm.RankFailed` on every
    # rank rather than rank 0's error and the others' wait in the next collective.

    def clear():
        if tmp.exists():
            shutil.rmtree(tmp)  # left over from an interrupted save
    comm.on_every_rank(clear if main else None)
    with offloaded_states_resident(model, optimizer):
        state = _states(model, optimizer)
        dcp.save(state, checkpoint_id=str(tmp))
        del state

    def write_extra():
        with open(tmp / EXTRA_FILE, "w") as f:
            json.dump(extra or {}, f)
    comm.on_every_rank(write_extra if main else None)  # every rank's shards are on disk before the rename

    def publish():
        old = path.with_name(path.name + ".old")
        if path.exists():
            # A directory cannot be replaced in one rename: move the previous checkpoint aside
            # first and delete it only once the new one is in place.
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    comm.on_every_rank(publish if main else None)


def check_checkpoint(path: str | os.PathLike, with_optimizer: bool = False) -> dict:
    """Check the files of a checkpoint written by `save_checkpoint` before anything loads from it:
    its metadata (and, `with_optimizer`, that it holds optimizer state) and its `extra` file.
    Returns the `extra` dict. A missing checkpoint raises FileNotFoundError, an unreadable or
    unusable one `CheckpointFileError` (a refused pickle `UnsafeCheckpointError`), each naming
    the file; every rank reads the files itself, so each stops with its own error rather than
    inside DCP's collective failure."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a meshppo checkpoint (no .metadata); "
                                f"an interrupted save leaves only {str(_tmp(path))!r}")
    saved = _SafeReader(path).read_metadata().state_dict_metadata
    if with_optimizer and not any(k.startswith("optim.") for k in saved):
        raise CheckpointFileError(f"checkpoint {str(path)!r} has no optimizer state; load it without an optimizer")
    extra_file = path / EXTRA_FILE
    if not extra_file.is_file():
        return {}
    try:
        extra = json.loads(extra_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointFileError(f"checkpoint file {str(extra_file)!r} is not readable JSON ({e}); a truncated or "
                                  "corrupt file") from None
    if not isinstance(extra, dict):
        raise CheckpointFileError(f"checkpoint file {str(extra_file)!r} holds a {type(extra).__name__}, not the "
                                  "JSON object meshppo writes")
    return extra


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by `save_checkpoint` (any world size) into `model` / `optimizer`.

    The model must already be sharded (`apply_fsdp`) and materialised; the optimizer built on
    its parameters. Returns the `extra` dict that was saved. The files are checked first
    (`check_checkpoint`), before any state changes; a checkpoint whose pickles would run code
    raises `UnsafeCheckpointError` on every rank.
    """
    path = Path(path)
    extra = check_checkpoint(path, with_optimizer=optimizer is not None)
    reader = _SafeReader(path)
    with offloaded_states_resident(model, optimizer):
        _load_into(path, reader, model, optimizer)
    return extra


def _load_into(path: Path, reader, model, optimizer) -> None:
    """`load_checkpoint`'s reading, into states on their device."""
    state = _states(model, optimizer)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(path))
    except dcp.CheckpointException as e:
        # DCP gathers the failures of all ranks and raises them on every rank; report a refusal
        # (the tensor items' own weights-only refusal included) as one line.
        errors = [err for err, _ in e.failures.values()]
        refusal = next((err for err in errors if isinstance(err, UnsafeCheckpointError)), None)
        if refusal is None:
            unpickling = next((err for err in errors if isinstance(err, pickle.UnpicklingError)), None)
            if unpickling is None:
                first = errors[0] if errors else e
                detail = str(first).strip().splitlines()[0] if str(first).strip() else ""
                raise CheckpointFileError(f"checkpoint {str(path)!r} could not be read ({type(first).__name__}: "
                                          f"{detail}); a truncated or corrupt file, or a model it was not saved "
                                          "from") from None
            refusal = _weights_only_refusal(path, "a tensor item", unpickling)
        raise refusal from None
    # Not strict: the frozen parameters (a LoRA actor's base) are not in the checkpoint by design;
    # DCP has already failed on any trainable one the checkpoint lacks.
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)


def _states(model, optimizer) -> dict:
    """What a checkpoint holds: the trainable parameters and their optimizer state. Frozen
    parameters (the base of a LoRA actor) come from the model path again, not from here.

    An optimizer that has not stepped yet (a critic warm-up's actor, a resume's new optimizer)
    has no state, and DCP's `get_state_dict` lays one out by stepping it once with zero gradients
    at lr 0: AdamW's moments stay zero, but its step counter reads 1, so the first real update
    would come out smaller (its bias correction) than in a run that never saved. The counters are
    taken back to 0 in what is saved, which with zero moments is exactly a fresh state, and the
    optimizer is left without state again, as it was."""
    opts = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if fresh:
        for param_state in optim_sd["state"].values():
            if "step" in param_state:
                param_state["step"] = torch.zeros_like(param_state["step"])
        optimizer.state.clear()
    return {"model": model_sd, "optim": optim_sd}


def gather_full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU tensors on rank 0 (`{}` on other ranks); collective.

    Parameters are gathered one at a time and moved to CPU at once, so device memory never
    holds more than one full parameter. `trainable_only`: only the parameters that train (a
    LoRA actor's adapters, for `models.lora.save_peft_adapter`).
    """
    with offloaded_states_resident(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=trainable_only))
