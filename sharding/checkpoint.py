"""Distributed checkpoints of FSDP models and their optimizers (`torch.distributed.checkpoint`).

Each rank writes only its shards; the checkpoint records global shapes and placements, so it
loads on any world size or mesh (DCP reshards on load). Saving is atomic: everything goes to
`<dir>.tmp`, and rank 0 renames it to `<dir>` after every rank has finished writing, so a
crash mid-save never leaves a half-written checkpoint under the final name.

`gather_full_state_dict` assembles full CPU tensors on rank 0 for a Hugging Face export
(`Transformer.save_pretrained(path, state_dict=...)`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

EXTRA_FILE = "extra.json"


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
    rank = dist.get_rank()
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left over from an interrupted save
    dist.barrier()
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        with open(tmp / EXTRA_FILE, "w") as f:
            json.dump(extra or {}, f)
    dist.barrier()  # every rank's shards are on disk before the rename publishes them
    if rank == 0:
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
    dist.barrier()


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by `save_checkpoint` (any world size) into `model` / `optimizer`.

    The model must already be sharded (`apply_fsdp`) and materialised; the optimizer built on
    its parameters. Returns the `extra` dict that was saved.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a meshppo checkpoint (no .metadata); "
                                f"an interrupted save leaves only {str(_tmp(path))!r}")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    has_optim = _saved_keys(path, "optim")
    if optimizer is not None and not has_optim:
        raise ValueError(f"checkpoint {str(path)!r} has no optimizer state; load it without an optimizer")
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_file = path / EXTRA_FILE
    return json.loads(extra_file.read_text()) if extra_file.is_file() else {}


def _saved_keys(path: Path, prefix: str) -> bool:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return any(k.startswith(prefix + ".") for k in metadata.state_dict_metadata)


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU tensors on rank 0 (`{}` on other ranks); collective.

    Parameters are gathered one at a time and moved to CPU at once, so device memory never
    holds more than one full parameter.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
