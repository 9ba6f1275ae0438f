"""A trainer checkpoint's actor or critic as a Hugging Face directory (verl's `model_merger`).

    python -m tools.export_hf CHECKPOINT OUTPUT [--role actor|critic] [--overwrite]

CHECKPOINT is a checkpoint step (`RUN/checkpoints/global_step_K`), one model's part of it
(`.../global_step_K/actor`: the role is its name) or a run's `checkpoints/` directory (its
latest step). OUTPUT receives what the trainer's own exports hold: the weights as
`model.safetensors` in the base checkpoint's dtype (a bf16 base's bf16, as verl's model_merger
writes it; float32 where its config.json names none), `config.json` saying which, the actor's tokenizer (with the run's
`custom_chat_template`) and the base checkpoint's `generation_config.json`. A LoRA actor is
written with its adapters merged, and its adapters alone as a peft directory in
`OUTPUT/lora_adapter`.

The model is rebuilt from the run's config stored in the checkpoint (its model path, overrides,
LoRA; a model or tokenizer path the run gave relative to its working directory is read where the
run read it, from any working directory) in this one process on CPU and the sharded weights are loaded into it; a checkpoint of
any world size converts. The memory it needs is the model twice over in its parameters' dtype
(the trained ones float32 by default: about 2 x 28 GB for a 7B model), a LoRA model's merged
copy a third time. Nothing is written before every check has passed; OUTPUT is replaced only
when it is empty, missing, or (with --overwrite) a model directory, and never when it holds the
checkpoint or a model the run reads. A model whose config.json, generation_config.json or tokenizer at
its path is not what the run read (the checkpoint records their fingerprint), or a LoRA model whose base
weights there are not, is refused: the export would be another model.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROLES = ("actor", "critic")


class ExportError(RuntimeError):
    """A checkpoint or an output path that cannot be exported from or to."""


def _step_and_role(path: str, role: str | None) -> tuple[str, str]:
    """The checkpoint step directory and the role that CHECKPOINT and --role name."""
    from trainer.checkpointing import LATEST, STATE_FILE, CheckpointManager

    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise ExportError(f"checkpoint {path!r} does not exist")
    name = os.path.basename(path)
    if name in ROLES and os.path.isfile(os.path.join(os.path.dirname(path), STATE_FILE)):
        if role is not None and role != name:
            raise ExportError(f"checkpoint {path!r} is the {name}'s part of its step, but --role is {role}")
        return os.path.dirname(path), name
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        if os.path.isfile(os.path.join(path, LATEST)) or any(re.fullmatch(r"global_step_\d+", n)
                                                              for n in os.listdir(path)):
            latest = CheckpointManager(path).latest()
            if latest is None:
                raise ExportError(f"{path!r} holds no complete checkpoint (no global_step_K with {STATE_FILE})")
            path = latest
        else:
            raise ExportError(f"{path!r} is not a meshppo checkpoint: give a run's checkpoints/ directory, a "
                              f"global_step_K directory in it (with {STATE_FILE}) or its actor/ or critic/")
    return path, role or "actor"


def _without_weights(state: dict, keys) -> dict:
    """`state` (a trainer state, or `{"bases": current_bases(...)}`) with the weights files left out of the
    fingerprints of `keys`' directories: what an export that takes every weight from the checkpoint reads."""
    bases = state.get("bases")
    if not isinstance(bases, dict):
        return state
    kept = dict(bases)
    for key in keys:
        entry = bases.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("fingerprint"), dict):
            kept[key] = {**entry, "fingerprint": {name: digest for name, digest in entry["fingerprint"].items()
                                                  if not name.endswith(".safetensors")
                                                  and name != "model.safetensors.index.json"}}
    return {**state, "bases": kept}


def _paths_as_read(state: dict) -> dict:
    """The run's stored config with each model, adapter and tokenizer directory given relative to the
    run's working directory replaced by the absolute path the checkpoint recorded for it (`bases`),
    where that directory is still there: the export then reads what the run read from whatever
    directory it is run in. A directory gone from there (moved) is read at the path as written."""
    import copy

    from trainer.checkpointing import MODEL_PATH_KEYS

    config, recorded = copy.deepcopy(state.get("config", {})), state.get("bases")
    for key in MODEL_PATH_KEYS if isinstance(recorded, dict) else ():
        *parents, name = key.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        path = node.get(name) if isinstance(node, dict) else None
        run_read = (recorded.get(key) or {}).get("path")
        if (isinstance(path, str) and path and not os.path.isabs(path) and isinstance(run_read, str)
                and os.path.isabs(run_read) and os.path.isdir(run_read)):
            node[name] = run_read
    return config


def _check_output(out: str, step_dir: str, cfg, overwrite: bool) -> str:
    """OUTPUT as an absolute path, refused where replacing it would lose what is there: the
    checkpoint, a directory that the run (`cfg`) read its model, adapter or tokenizer from."""
    from trainer.config import paths_read_under

    out, step = os.path.realpath(out), os.path.realpath(step_dir)
    if os.path.commonpath([out, step]) in (out, step):
        raise ExportError(f"output {out!r} holds the checkpoint or lies inside it: choose a directory apart from "
                          f"{step!r}")
    inside = paths_read_under(cfg, out)
    if inside:
        raise ExportError(f"output {out!r} holds {os.path.realpath(inside[0])!r}, which the checkpoint's run reads a "
                          "model or tokenizer from: choose another directory")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ExportError(f"output {out!r} exists and is not a directory")
        if os.listdir(out):
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise ExportError(f"output {out!r} is a directory with other files in it (no config.json: not a "
                                  "model directory); choose an empty or new one")
            if not overwrite:
                raise ExportError(f"output {out!r} already holds a model; pass --overwrite to replace it")
    from trainer.setup import check_output_dir

    check_output_dir("OUTPUT", out)  # a file in the way, or a folder that takes no files: ConfigError
    return out


def export_checkpoint(checkpoint: str, output: str, role: str | None = None, overwrite: bool = False,
                      log=print) -> str:
    """Write the model `role` of `checkpoint` to `output` (see the module's docstring); returns
    the output's absolute path. Input problems raise ExportError, UserError or ConfigError."""
    import torch
    import torch.distributed as dist

    from models.checkpoint import NO_TOKEN_CLASSIFIER, value_export_refusal
    from sharding.checkpoint import check_checkpoint, load_checkpoint
    from sharding.mesh import ParallelDims
    from trainer.checkpointing import (LEGACY_CONTENTS, ROLE_KEYS, current_bases, export_hf, read_trainer_state,
                                       same_bases)
    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, build_dataclass
    from trainer.launch import init_distributed
    from trainer.setup import build_trained_model, load_actor_tokenizer

    if role is not None and role not in ROLES:
        raise ExportError(f"--role {role!r}: one of {', '.join(ROLES)}")
    step_dir, role = _step_and_role(checkpoint, role)
    state = read_trainer_state(step_dir)
    key = f"{ROLE_KEYS[role]}.checkpoint.save_contents"
    # written before `contents` existed: every model directory there holds all but 'hf_model' (as a resume reads it)
    contents = state.get("contents") or {name: LEGACY_CONTENTS for name in ROLES
                                         if os.path.isdir(os.path.join(step_dir, name))}
    if role not in contents:
        raise ExportError(f"checkpoint {step_dir!r} holds no {role} (its run trained {', '.join(contents) or 'none'})")
    if "model" not in contents[role]:
        raise ExportError(f"checkpoint {step_dir!r} holds no weights of the {role}: its run's {key} was "
                          f"{contents[role]}, without 'model'")
    try:
        cfg = build_dataclass(PPOConfig, _paths_as_read(state))
    except ConfigError as e:
        raise ExportError(f"checkpoint {step_dir!r} stores a config this meshppo does not read ({e}); export it "
                          "with the meshppo version that wrote it") from None
    arr = cfg.actor_rollout_ref
    model_cfg = arr.model if role == "actor" else cfg.critic.model
    # as `build_trained_model` draws them: the actor's, and a critic's of the actor's path
    random_base = arr.model.load_format == "dummy" and (role == "actor" or model_cfg.path == arr.model.path)
    if model_cfg.lora is not None and random_base:
        raise ExportError(f"checkpoint {step_dir!r}: its run's LoRA base weights were random "
                          "(actor_rollout_ref.model.load_format=dummy, drawn per rank), so the merged model cannot "
                          "be rebuilt")
    # The export reads again what the run read from its directories: the model's config (its shapes, norm
    # epsilon, RoPE), generation_config.json and the actor's tokenizer, and a LoRA model's base weights (the
    # adapters are merged into them; a full fine-tune's checkpoint holds all its weights). Those files must be
    # what the run read, as the checkpoint records them, or the export is another model.
    keys = ("actor_rollout_ref.model.path" if role == "actor" else "critic.model.path", "data.tokenizer")
    recorded, now = state, current_bases(cfg, keys)
    if model_cfg.lora is None:
        recorded, now = _without_weights(state, keys), _without_weights({"bases": now}, keys)["bases"]
    same_bases(step_dir, recorded, now, lambda _: None, keys,
               otherwise=" (the export rebuilds the model from these files)")
    weights = os.path.join(step_dir, role)
    check_checkpoint(weights)
    output = _check_output(output, step_dir, cfg, overwrite)
    tokenizer = load_actor_tokenizer(cfg)

    ctx = init_distributed("cpu")
    try:
        if ctx.world_size != 1:
            raise ExportError(f"the export runs in one process; it was started as one of {ctx.world_size} "
                              "(run it with python, not torchrun)")
        mesh = ParallelDims(world_size=1).build_meshes("cpu").train
        model = build_trained_model(cfg, role, mesh, torch.device("cpu"), initial_adapters=False)
        if model.head == "value" and model.args.model_type in NO_TOKEN_CLASSIFIER:
            raise ExportError(f"checkpoint {step_dir!r}: {value_export_refusal(model.args.model_type)}")
        load_checkpoint(weights, model)
        # a LoRA actor's adapters also alone, as the trainer's final export has them (a critic's, with
        # its value head, are no causal-LM adapter: merged only)
        adapters = role == "actor" and getattr(model, "lora_config", None) is not None
        export_hf(model, model.args, tokenizer, output, True,
                  adapter_dir=os.path.join(output, "lora_adapter") if adapters else None,
                  base_model=arr.model.path if role == "actor" else None)
    finally:
        if ctx.owns_group:
            dist.destroy_process_group()
    step = state["global_step"]
    log(f"wrote {output}: the {role} of step {step} ({step_dir})"
        + (", LoRA adapters merged, and alone in lora_adapter/" if adapters else ""))
    return output


def main(argv=None) -> int:
    from models.checkpoint import CheckpointFileError
    from sharding.checkpoint import UnsafeCheckpointError
    from trainer.configlib import ConfigError
    from trainer.errors import UserError
    from trainer.versions import check_versions

    parser = argparse.ArgumentParser(prog="python -m tools.export_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="RUN/checkpoints, RUN/checkpoints/global_step_K or its actor/ or critic/")
    parser.add_argument("output", help="the Hugging Face directory to write")
    parser.add_argument("--role", choices=ROLES, default=None,
                        help="which model (default: the one CHECKPOINT names, else the actor)")
    parser.add_argument("--overwrite", action="store_true", help="replace an OUTPUT that already holds a model")
    args = parser.parse_args(argv)
    if code := check_versions():  # an older transformers would write another config.json
        return code
    try:
        export_checkpoint(args.checkpoint, args.output, args.role, args.overwrite)
    except (ExportError, UserError, ConfigError, CheckpointFileError, UnsafeCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a missing file inside the checkpoint, a disk that filled while writing
        print(f"error: {e.filename}: {e.strerror}" if e.filename and e.strerror else f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
