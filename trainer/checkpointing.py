"""Trainer checkpoints: atomic, rotated, resumable on another world size.

Layout under `trainer.default_local_dir/checkpoints/`:

    global_step_K/
        actor/            model + optimizer, sharded (torch.distributed.checkpoint)
            huggingface/  the full weights, config and tokenizer (with 'hf_model', below)
            lora_adapter/ a LoRA actor's adapters as a peft directory (as verl's model_merger writes them; a lora_adapter_path)
        critic/           the same, when there is a critic
        trainer_state.json  the step, world size, the actor's shape and the run's resolved config
                            (to refuse a checkpoint of another model or another run), what each
                            model's directory holds (`contents`), a fingerprint of each model,
                            adapter and tokenizer directory the run reads (`bases`: compared by
                            what they hold, not by path, at a resume), and the `state_dict()` of every
                            registered `Stateful` under its name (trainer counters, data loader,
                            LR schedulers, KL coefficients, guard)
        rng/rank_R.pt       every rank's RNG states: plain tensors and numbers only
    latest_checkpointed_iteration.txt   (verl's name) the newest complete step

What a model's part holds is verl's `checkpoint.save_contents` of its section
(`actor_rollout_ref.actor`, `critic`): 'model' the sharded weights, 'optimizer' its state
beside them, 'extra' its LR scheduler (the actor's also the RNG files), 'hf_model' the
`huggingface/` directory, written by rank 0 from parameters gathered one at a time. The step,
data position, KL coefficients and guard are always saved, as verl's trainer always saves its
step and data loader. A resume loads what `checkpoint.load_contents` lists, as verl does, and
says what it leaves fresh; a listed item that the checkpoint lacks is refused before anything
is loaded ('hf_model' loads nothing: the weights come from 'model').

A checkpoint is written into `global_step_K.tmp/` and renamed once every rank has finished,
and only then does the `latest` file move (os.replace): a save interrupted at any point
leaves the previous checkpoint, and the pointer to it, intact. A write that fails on any rank
(rank 0 alone writes the trainer state, the pointer and the Hugging Face export) fails the save
on every rank, agreed in one collective, so that no rank waits for one that has given up.

Trainer state is JSON, the RNG files are read with `torch.load(weights_only=True)` and the
model and optimizer shards through `sharding.checkpoint`'s restricted readers, so a checkpoint
made by someone else cannot run code when it is resumed (a pickle could): one that tries is
refused with a message naming it.

The manager owns no training state: whoever has state to keep registers it by name
(`states={"trainer": ..., "loader": ..., "kl": ...}`, as torchtitan's trainer does) and the
manager only calls `state_dict()` / `load_state_dict()`; the models and optimizers are
registered the same way (`models={"actor": (model, optimizer), ...}`).

A checkpoint resumes only the run that wrote it: the options in `SAME_RUN_OPTIONS` (what the
run learns from and how) must be unchanged; `trainer.total_training_steps` may grow to extend
it, and how the run executes (micro-batches, offload, world size) or logs may change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import glob
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from typing import Callable, Protocol

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError

from models.args import torch_dtypes
from models.checkpoint import one_line, save_pretrained
from models.lora import is_lora_name, merged_state_dict, save_peft_adapter
from trainer import faults
from trainer.config import (CHECKPOINT_CONTENTS, MODEL_SECTIONS, FilterGroupsConfig, PPOConfig, acting_overrides,
                            paths_read_under)
from trainer.configlib import iter_options, no_effect_options
from trainer.errors import UserError
from sharding import comm
from sharding.checkpoint import (
    UnsafeCheckpointError,
    check_checkpoint,
    gather_full_state_dict,
    load_checkpoint,
    save_checkpoint,
    unpickling_reason,
)

LATEST = "latest_checkpointed_iteration.txt"
ADAPTER_DIR = "lora_adapter"  # a LoRA actor's adapters in each checkpoint, as verl's model_merger writes them
LAUNCH_MARKER = "launch_id.txt"  # the launch (TORCHELASTIC_RUN_ID) whose later checkpoints a restart resumes, as JSON
STATE_FILE = "trainer_state.json"

# What a run learns from and how: a checkpoint resumes only under the same values. A dotted
# prefix covers every option under it; NOT_SAME_RUN_OPTIONS carves out of those prefixes the
# options that only change how the same computation executes (micro-batching, memory
# placement, compilation), what is validated or logged, or how long the run is.
SAME_RUN_OPTIONS = (
    "data",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path",
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.model.custom_chat_template",  # how every prompt (and inserted turn) reads
    "actor_rollout_ref.actor",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.do_sample",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.ignore_eos",
    "actor_rollout_ref.rollout.multi_turn",  # the turns, tools and interactions the responses are made of
    "actor_rollout_ref.rollout.agent.default_agent_loop",
    "critic",
    "reward_model",
    "custom_reward_function",
    "algorithm",
    "trainer.seed",
    "trainer.critic_warmup",
)
NOT_SAME_RUN_OPTIONS = (
    "data.val_files",
    "actor_rollout_ref.actor.checkpoint",
    "critic.checkpoint",
    "actor_rollout_ref.actor.profiler",
    "actor_rollout_ref.ref.profiler",
    "actor_rollout_ref.rollout.profiler",
    "critic.profiler",
    "reward_model.profiler",
    "data.val_batch_size",
    "data.return_raw_chat",
    "data.reward_fn_key",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.use_remove_padding",  # (verl's copy of model.use_remove_padding: execution only)
    "actor_rollout_ref.actor.calculate_entropy",  # whether the update logs actor/entropy_loss
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.actor.use_prefix_grouper",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.optim.total_training_steps",
    "actor_rollout_ref.actor.optim.warmup_style",
    "actor_rollout_ref.actor.fsdp_config",
    "critic.strategy",
    "critic.optim.total_training_steps",
    "critic.optim.warmup_style",
    "critic.model.tokenizer_path",
    "critic.model.enable_gradient_checkpointing",
    "critic.model.enable_activation_offload",
    "critic.model.use_remove_padding",
    "critic.model.fsdp_config",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu",
    "critic.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu",
    "critic.ulysses_sequence_parallel_size",
    "reward_model.ulysses_sequence_parallel_size",
    "reward_model.micro_batch_size_per_gpu",
    "reward_model.use_dynamic_bsz",
    "reward_model.forward_max_token_len_per_gpu",
    "reward_model.model.fsdp_config",
    "reward_model.model.use_remove_padding",
    "reward_model.strategy",
)
# Options inside a NOT_SAME_RUN_OPTIONS prefix that change what is learned all the same: the master weights'
# dtype (a bf16 resume of an fp32 run rounds the weights and the optimizer's moments, and small updates
# round away from then on).
SAME_RUN_EXCEPTIONS = ("actor_rollout_ref.actor.fsdp_config.model_dtype", "critic.model.fsdp_config.model_dtype")

# The config section of each model a checkpoint holds (its `checkpoint` options).
ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "critic": "critic"}
# What a checkpoint written before `checkpoint.save_contents` existed holds of each model.
LEGACY_CONTENTS = ["model", "optimizer", "extra"]
# What a resume leaves fresh when load_contents omits an item.
FRESH = {"model": "weights from its model path", "optimizer": "empty optimizer state",
         "extra": "LR schedule from its start"}


# An option's older name, whose value a resolved config moves to it (`optim.warmup_style` above is
# always null then): a checkpoint written before the newer name existed ran with the older one's.
RENAMED_OPTIONS = {f"{p}.optim.lr_scheduler_type": f"{p}.optim.warmup_style" for p in ("actor_rollout_ref.actor",
                                                                                     "critic")}
RENAMED_OPTIONS["reward_model.model.path"] = "reward_model.path"

# How a run written before an option existed ran, where that is not the option's default: the reward
# model read the actor's token ids (input_tokenizer null) until verl's re-rendering came.
PREDATING_VALUES = {"reward_model.model.input_tokenizer": None}


# Options of which a part only acts: a resume compares that part. The models' override_config may change its
# keys that change nothing (attn_implementation, ...), not those that change the model (rope_theta, ...).
ACTING_PART = {f"{section}.override_config": functools.partial(acting_overrides, section) for section in MODEL_SECTIONS}
# a dtype by what it is, not how it is spelled (fp32 and float32 are one)
ACTING_PART.update({key: lambda name: torch_dtypes().get(name, name) for key in SAME_RUN_EXCEPTIONS})
# filter_groups.metric defaulted to null before verl's `reward`: a run saved with null had filter_groups off (null
# is refused with it on), so null reads as the default it now is
ACTING_PART["algorithm.filter_groups.metric"] = lambda metric: FilterGroupsConfig().metric if metric is None else metric


# Options naming a directory the run reads a model, adapter or tokenizer from. A resume compares
# what they hold, not how they are spelled: a checkpoint records each one's fingerprint
# (`model_dir_fingerprint`; the trainer state's "bases"), and a path spelled otherwise (a link, a
# relative path from another directory) resumes, as does another directory holding the same files
# (a copy, a move; said in the log, since a fingerprint samples the weights), while the same
# path whose files changed (a LoRA run's base, which its checkpoints do not hold; the reference
# model of a full fine-tune) is refused.
MODEL_PATH_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_adapter_path", "data.tokenizer",
                   "critic.model.path", "reward_model.model.path", "reward_model.model.input_tokenizer")
# The files of such a directory that its model, adapter or tokenizer is read from, and only those: the
# model's config and weights (`models.checkpoint`: model.safetensors, the index and its shards, or
# every *.safetensors without them; generation_config.json, read for the stop tokens), a peft
# adapter's (`models.lora`) and the tokenizer files transformers reads (`models.tokenizer`:
# tokenizer.json and its config, a slow tokenizer's vocabulary, merges and sentencepiece or
# tiktoken model, the chat template and its additional_chat_templates/). Any other file (a README,
# the trainer_state.json or eval_results.json of a Hugging Face Trainer, an evaluation's output)
# is no part of the model: adding or changing it never refuses a resume.
_FINGERPRINTED_NAMES = frozenset((
    "config.json", "generation_config.json", "model.safetensors.index.json", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tekken.json", "chat_template.jinja", "chat_template.json"))
_FINGERPRINTED_SUFFIXES = (".safetensors", ".model", ".tiktoken")  # weights; sentencepiece and tiktoken vocabularies
_CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' named chat templates, <name>.jinja


def _fingerprinted(name: str) -> bool:
    """Whether file `name` (relative to a model directory) is one a model, adapter or tokenizer is read from."""
    folder, _, base = name.rpartition("/")
    if folder:
        return folder == _CHAT_TEMPLATE_DIR and base.endswith(".jinja")
    return name in _FINGERPRINTED_NAMES or name.endswith(_FINGERPRINTED_SUFFIXES)


_WHOLE_FILE_LIMIT = 64 << 20  # files up to this size are hashed whole; larger ones by size and samples
_SAMPLES, _SAMPLE_BYTES = 16, 16 << 10  # a weights file's data: evenly spaced samples, read and hashed


def _file_digest(path: str) -> str:
    """One file's digest, cheap to take: small files whole; a safetensors file its size, its header
    (every tensor's name, dtype, shape and offsets) and `_SAMPLES` evenly spaced samples of its data
    (fine-tuned weights of the same shapes differ in nearly every byte); another large file its
    size and the same samples."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        start = 0
        if path.endswith(".safetensors") and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, _WHOLE_FILE_LIMIT)))
            start = min(8 + n, size)
        if size - start <= _WHOLE_FILE_LIMIT and not path.endswith(".safetensors"):
            f.seek(start)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                f.seek(start + span * i // max(_SAMPLES - 1, 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def model_dir_fingerprint(path: str | None) -> dict[str, str] | None:
    """What model (or adapter, or tokenizer) directory `path` holds, as `{file name: digest}` of the
    files it is read from (`_fingerprinted`; `_file_digest`: the weights by their headers, sizes and
    samples, not read whole); None where `path` is unset or not a readable directory (a hub name)."""
    if not path or not os.path.isdir(path):
        return None
    try:
        names = os.listdir(path)
        templates = os.path.join(path, _CHAT_TEMPLATE_DIR)
        if os.path.isdir(templates):
            names += [f"{_CHAT_TEMPLATE_DIR}/{name}" for name in os.listdir(templates)]
        return {name: _file_digest(os.path.join(path, name)) for name in sorted(names)
                if _fingerprinted(name) and os.path.isfile(os.path.join(path, name))}
    except OSError:
        return None


def same_bases(path: str, state: dict, bases: dict, log: Callable[[str], None], keys=MODEL_PATH_KEYS,
               otherwise: str = ", or start a new run in another trainer.default_local_dir") -> set[str]:
    """The options among `keys` (`MODEL_PATH_KEYS`) that name the same files in checkpoint `path`'s
    run (`state`) as now (`bases`, from `current_bases`), however spelled: what a directory holds
    decides (the fingerprint recorded with the checkpoint against the one taken at this start),
    else (a hub name, a directory unreadable then or now) its resolved path (links, `..`). The
    same directory whose files changed since the checkpoint's run read them is refused (a
    UserError naming the option, the path and the files); another directory with other files is
    another setting, left to `run_differences`. A directory at another path whose fingerprint
    matches resumes, and `log` says it moved and how it was compared (a fingerprint samples the
    weights: files that differ only where it does not read would pass). A checkpoint written
    before fingerprints were recorded compares resolved paths, and says so (`log`). `otherwise`: the
    refusal's tail after "put back the model the run started from" (a resume's: or a new run)."""
    recorded = state.get("bases")
    if not isinstance(recorded, dict):
        recorded = None
        if bases:
            log(f"checkpoint {path}: written before meshppo recorded what the run's model directories hold, so "
                "their files are not compared; their paths are, resolved")
    saved, same, moved = state.get("config", {}), set(), {}
    for key in keys:
        new_path, now = bases.get(key, {}).get("path"), bases.get(key, {}).get("fingerprint")
        if recorded is not None:
            old_path, then = (recorded.get(key) or {}).get("path"), (recorded.get(key) or {}).get("fingerprint")
            if isinstance(then, dict):  # an older meshppo recorded every *.json and *.txt: the files read only
                then = {name: digest for name, digest in then.items() if _fingerprinted(name)}
            if then is not None and now is not None:
                if then != now and _same_path(old_path, new_path):
                    changed = sorted(n for n in set(then) | set(now) if then.get(n) != now.get(n))
                    raise UserError(
                        f"checkpoint {path!r} was trained on other files than {key}={new_path!r} holds now "
                        f"({', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} differ from what its run "
                        f"read in {old_path!r}): put back the model the run started from{otherwise}")
                if then == now:
                    same.add(key)
                    if not _same_path(old_path, new_path):
                        moved.setdefault((old_path, new_path), []).append(key)
                continue  # another directory with other files: another setting (`run_differences` lists it)
        else:
            old_path = _lookup(saved, key, _lookup(saved, RENAMED_OPTIONS[key], None)
                               if key in RENAMED_OPTIONS else None)
        if _same_path(old_path, new_path):
            same.add(key)
    for (old_path, new_path), moved_keys in moved.items():
        log(f"checkpoint {path}: {', '.join(moved_keys)} moved from {old_path!r} to {new_path!r}; resumed because "
            "its files match what the run read there, compared by their contents, the weights by their headers, sizes "
            "and samples (not read whole)")
    return same


def _same_path(old, new) -> bool:
    """Whether two spellings of a path name one directory (links and `..` resolved)."""
    return isinstance(old, str) and isinstance(new, str) and bool(old and new) and \
        (old == new or os.path.realpath(old) == os.path.realpath(new))


def current_bases(config: PPOConfig, keys=MODEL_PATH_KEYS) -> dict:
    """`{option: {"path", "fingerprint"}}` of each of `keys` that `config` sets: what a checkpoint
    records of the directories its run reads (`same_bases` compares them at a resume)."""
    current = dataclasses.asdict(config)
    # a local directory by its resolved path: a relative one means another directory from another working directory
    return {key: {"path": os.path.realpath(path) if os.path.isdir(path) else path,
                  "fingerprint": model_dir_fingerprint(path)}
            for key in keys if (path := _lookup(current, key, None))}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def same_run_keys() -> list[tuple[str, object]]:
    """`(dotted key, default)` of every option that must match for a checkpoint to resume."""
    inert = no_effect_options(PPOConfig)  # options that change nothing never block a resume
    return [(key, default) for key, _, default, _ in iter_options(PPOConfig)
            if (key in SAME_RUN_EXCEPTIONS or _under(key, SAME_RUN_OPTIONS) and not _under(key, NOT_SAME_RUN_OPTIONS))
            and key not in inert]


def _lookup(tree: dict, key: str, default):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default  # an option newer than the checkpoint: it ran with the default
        node = node[part]
    return node


def run_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """`(key, saved value, current value)` for each `SAME_RUN_OPTIONS` option that differs
    between two resolved configs (`dataclasses.asdict` of `PPOConfig`)."""
    out = []
    for key, default in same_run_keys():
        before = PREDATING_VALUES.get(key, default)
        old = _lookup(saved, key, _lookup(saved, RENAMED_OPTIONS[key], before) if key in RENAMED_OPTIONS else before)
        new = _lookup(current, key, default)
        part = ACTING_PART.get(key, lambda value: value)
        if part(old) != part(new):
            out.append((key, old, new))
    return out


def _newest_step_dir(folder: str) -> str | None:
    """The newest `global_step_K` directory in `folder` (complete or not), None if none."""
    steps = sorted((int(m.group(1)), name) for name in (os.listdir(folder) if os.path.isdir(folder) else ())
                   if (m := re.fullmatch(r"global_step_(\d+)", name)))
    return os.path.join(folder, steps[-1][1]) if steps else None


def _checkpoint_hint(path: str) -> str:
    """What `path`, given as a checkpoint and not one, is instead, as the tail of the refusal: a run's
    `checkpoints/` directory, a run directory (verl's `default_local_dir` holds its `global_step_K`
    itself, meshppo's in `checkpoints/`), a model's part of a checkpoint, or a `global_step_K` named
    in verl's layout; '' when it is none of them."""
    path = os.path.normpath(path)
    if (newest := _newest_step_dir(path)) is not None:
        return f": it holds checkpoints; name one of them, e.g. {newest!r}"
    if (newest := _newest_step_dir(os.path.join(path, "checkpoints"))) is not None:
        return f": it is a run directory, whose checkpoints are in its checkpoints/; name one of them, e.g. {newest!r}"
    parent, name = os.path.split(path)
    if name in ROLE_KEYS and os.path.isfile(os.path.join(parent, STATE_FILE)):
        return f": it is the {name}'s part of checkpoint {parent!r}; name the checkpoint"
    moved = os.path.join(parent, "checkpoints", name)
    if re.fullmatch(r"global_step_\d+", name) and os.path.isdir(moved):
        return (f": meshppo keeps a run's checkpoints in its checkpoints/ directory (verl in the run directory "
                f"itself): {moved!r}")
    return ""


def read_trainer_state(step_dir: str) -> dict:
    """The JSON trainer state of a checkpoint directory (never a pickle)."""
    path = os.path.join(step_dir, STATE_FILE)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(step_dir, "trainer_state.pt")):
            raise UserError(f"checkpoint {step_dir!r} stores its trainer state as a pickle (trainer_state.pt, "
                            "an older meshppo); pickles are not loaded because they can run code: start a fresh "
                            "run (trainer.resume_mode=disable or another trainer.default_local_dir)")
        raise UserError(f"resume checkpoint {step_dir!r} does not exist or is incomplete (no {STATE_FILE})"
                        f"{_checkpoint_hint(step_dir)}")
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint file {path!r} is not readable JSON: {e}") from None
    fields = {"global_step": int, "world_size": int, "model": dict}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in fields.items()):
        raise UserError(f"checkpoint file {path!r} is not a meshppo trainer state (it needs "
                        f"{', '.join(f'{k!r} ({t.__name__})' for k, t in fields.items())})")
    return state


def _schedule_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's learning rates to `scheduler`'s at its step. A loaded optimizer holds the
    rates the checkpoint's run last used, which the next update would train at: under a schedule
    stretched to a larger total (or a fresh one, its state not loaded), those are the old
    schedule's, and `LambdaLR.load_state_dict` does not set them."""
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)


def read_rng_state(path: str) -> dict:
    """A rank's RNG states, loaded as tensors and numbers only (`weights_only=True`)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"RNG state file {path!r} was refused: it is not the plain tensors and numbers meshppo "
                        f"writes, and loading it could run code ({unpickling_reason(e)})") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise UserError(f"RNG state file {path!r} is not readable: {e}") from None


class WriteFailed(UserError):
    """A write that failed on some rank (a full disk, a quota, a directory gone), raised on every
    rank: `cause` is this rank's own error in one line, or the rank whose log has it."""

    def __init__(self, what: str, error: BaseException | None, rank: int):
        self.cause = one_line(_first_failure(error)) if error is not None else f"on rank {rank}, whose log says why"
        super().__init__(f"{what} failed ({self.cause})")


def _first_failure(error: BaseException) -> BaseException:
    """The error that says why a write failed (`models.checkpoint.one_line` words it, e.g.
    `OSError: [Errno 28] No space left on device`): DCP's exception (raised on every rank) by the
    first of its writers' failures, an OSError where there is one; any other error itself. An
    OSError may be what another error was raised while handling: torch.save's zip writer turns
    the file's failed write into `RuntimeError: ... unexpected pos`, the OSError its context."""
    errors = [err for err, _ in error.failures.values()] if isinstance(error, dcp.CheckpointException) else [error]
    for err in errors:
        seen = set()
        while err is not None and id(err) not in seen:
            if isinstance(err, OSError):
                return err
            seen.add(id(err))
            err = err.__cause__ or err.__context__
    return errors[0] if errors else error


# what a write raises when the disk is full (or a quota, permissions, a vanished directory): the OS's
# error, DCP's collection of its writers' errors, safetensors' own (not an OSError) from the Hugging
# Face export and the peft adapter
WRITE_ERRORS = (OSError, dcp.CheckpointException, SafetensorError)


def agreed_write(what: str, fn: Callable[[], object] | None) -> None:
    """`sharding.comm.on_every_rank` for the writes of a checkpoint or an export: a write error on
    any rank (one inside `sharding.checkpoint.save_checkpoint` too) is `WriteFailed` on every rank."""
    try:
        comm.on_every_rank(fn, WRITE_ERRORS)
    except comm.RankFailed as e:
        raise WriteFailed(what, e.error, e.rank) from None


def agreed_user_error(fn: Callable[[], object] | None, others_say: Callable[[int], str]) -> None:
    """`sharding.comm.on_every_rank` for a step that can fail with a UserError on some ranks only (a rank's
    own file): every rank raises, the failed ones their own error, the others `others_say(the first rank
    that failed)`."""
    try:
        comm.on_every_rank(fn, (UserError,))
    except comm.RankFailed as e:
        raise e.error if e.error is not None else UserError(others_say(e.rank)) from None


def flush_to_disk(f) -> None:
    """`f`'s bytes on the disk, not only in the page cache: after a power loss or a node's crash a
    checkpoint's completion marker (the trainer state), its RNG files and the pointer to it hold
    what was written (the shards are synced by DCP's writer), as does a metrics row logged before
    the checkpoint of its step is put in place (`tracking.Tracking.log`)."""
    f.flush()
    os.fsync(f.fileno())


def _synced_dir(path: str) -> None:
    """The renames in directory `path` on the disk (POSIX: a rename is durable once its directory is
    synced), where the file system syncs directories (some network mounts refuse: nothing to do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _rng_state() -> dict:
    """Every RNG's state as tensors, ints, floats and tuples: what `weights_only` loads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RngSnapshot:
    """Every RNG's state (Python's, NumPy's, torch's, CUDA's) as it is now, to put back with `restore`."""

    def __init__(self) -> None:
        self.state = _rng_state()

    def restore(self) -> None:
        _set_rng_state(self.state)


@contextlib.contextmanager
def rng_set_aside():
    """Every RNG's state put back as it was after the block."""
    snapshot = RngSnapshot()
    try:
        yield
    finally:
        snapshot.restore()


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointManager:
    """Saves and restores what is registered with it.

    `states`: JSON-able `Stateful`s by name; `models`: `(model, optimizer)` pairs by name
    (`ROLE_KEYS`), written sharded; `extras`: the states that are a model's 'extra' (state
    name: model name), saved and loaded with it; the RNG files are the actor's 'extra'.
    `tokenizer` and `base_model` (the actor's model path) go into an 'hf_model' export. A
    KL-guard rollback (`keep_progress`) restores only the models and their optimizers: every
    registered state (the step counter, data position, KL coefficients, LR schedules, guard)
    and the RNG move on."""

    def __init__(self, root: str, *, states: dict[str, Stateful] | None = None,
                 models: dict[str, tuple] | None = None, extras: dict[str, str] | None = None,
                 fingerprint: dict | None = None, config: PPOConfig | None = None,
                 tokenizer=None, base_model: str | None = None, rank: int = 0, world_size: int = 1,
                 keep: int | None = None, log: Callable[[str], None] = print):
        self.root, self.states, self.models = root, states or {}, models or {}
        self.extras, self.tokenizer, self.base_model = extras or {}, tokenizer, base_model
        self.fingerprint, self.config, self.keep, self.log = fingerprint, config, keep, log
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        self.saved_step: int | None = None  # the step whose checkpoint in `root` holds this run's state
        # what the directories the run reads its models from hold as it starts (`MODEL_PATH_KEYS`)
        self.bases = current_bases(config) if config is not None else {}

    def contents(self, name: str, which: str) -> list[str]:
        """Model `name`'s `save_contents` or `load_contents` (`which`)."""
        section = self.config
        for part in ROLE_KEYS[name].split("."):
            section = getattr(section, part)
        return getattr(section.checkpoint, which)

    def _state_kept(self, name: str, which: str) -> bool:
        """Whether state `name` is saved / loaded (`which`): a model's 'extra' only when listed."""
        return name not in self.extras or "extra" in self.contents(self.extras[name], which)

    # --------------------------------------------------------------- discovery
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = re.fullmatch(r"global_step_(\d+)", name)
            if m and os.path.isfile(os.path.join(self.root, name, STATE_FILE)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> str | None:
        pointer = os.path.join(self.root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer) as f:
                text = f.read().strip()
            # `.old`: the step's previous checkpoint, when a save of the same step was cut off
            # between moving it aside and putting the new one in place (`save`)
            for path in ((self.step_dir(int(text)), self.step_dir(int(text)) + ".old") if text.isdigit() else ()):
                if os.path.isfile(os.path.join(path, STATE_FILE)):
                    return path
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # --------------------------------------------------------------- save
    def save(self, step: int) -> str:
        """The checkpoint of `step`, written (`write`) and put in place (`publish`); its path."""
        self.write(step)
        return self.publish(step)

    def write(self, step: int) -> None:
        """Every rank's part of the checkpoint of `step`, into `global_step_K.tmp/`: not yet a
        checkpoint a run resumes from (`publish` makes it one). The trainer logs the step's metrics
        row in between, so that the steps of every checkpoint a run resumes from have their rows."""
        tmp = self.step_dir(step) + ".tmp"
        try:
            agreed_write("writing", lambda: self._write(step, tmp))
        except WriteFailed as e:
            # a full disk, a quota, a directory gone, on any rank: one line on every rank, the
            # partial directory removed, the earlier checkpoints as they were
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failure(f"writing the checkpoint of step {step} into {tmp}", e) from None

    def publish(self, step: int) -> str:
        """The checkpoint of `step` that `write` wrote becomes the newest (`_publish`); its path."""
        final, tmp = self.step_dir(step), self.step_dir(step) + ".tmp"
        faults.crash("crash_before_publish", step, self.rank)
        try:
            agreed_write("publishing", functools.partial(self._publish, step, final, tmp) if self.is_main else None)
        except WriteFailed as e:
            raise self._failure(f"putting the checkpoint of step {step} in place ({final})", e) from None
        faults.crash("crash_after_publish", step, self.rank)
        self.saved_step = step
        return final

    def _failure(self, what: str, e: WriteFailed) -> UserError:
        good = self.latest()
        return UserError(f"{what} failed ({e.cause}); the last complete checkpoint is "
                         f"{good if good is not None else 'none'}; free space in {self.root} (or move "
                         "trainer.default_local_dir) and resume")

    def _publish(self, step: int, final: str, tmp: str) -> None:
        """Rank 0, once every rank has written its part: `tmp` becomes the step's directory, the
        `latest` pointer moves to it, and the rotation runs."""
        # A step saved again (a stale branch's, after resuming from an earlier step) is moved
        # aside, not deleted, until the new one is in place: a kill in between leaves it.
        # The names inside the step's directory on the disk before it is published (the files are: DCP's
        # writer and `flush_to_disk`): its trainer state (the completion marker), the RNG files, and each
        # model's directory, renamed from `<model>.tmp` once its shards were written.
        for folder, _, _ in os.walk(tmp, topdown=False):
            _synced_dir(folder)
        old = final + ".old"
        if os.path.isdir(final):  # else `old` may be the step's only complete copy: kept till below
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _synced_dir(self.root)  # the step's directory under its name before the pointer names it
        pointer_tmp = os.path.join(self.root, LATEST + ".tmp")
        with open(pointer_tmp, "w") as f:
            f.write(str(step))
            flush_to_disk(f)
        os.replace(pointer_tmp, os.path.join(self.root, LATEST))
        _synced_dir(self.root)
        # Debris of saves killed before (any step's): a partial `.tmp`, and an `.old` that only a pointer
        # naming its step could reach (`latest`), which now names this one.
        for name in os.listdir(self.root):
            if re.fullmatch(r"global_step_\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self._rotate(step, self.keep)

    def _write(self, step: int, tmp: str) -> None:
        """`save`'s writing of every part of the checkpoint into `tmp`, the trainer state last."""
        rng = "extra" in self.contents("actor", "save_contents")

        def prepare():
            self._make_room(step)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng") if rng else tmp, exist_ok=True)
        # (agreed: no rank writes before rank 0 has made room)
        agreed_write("creating the directory", prepare if self.is_main else None)
        contents = {}
        for k, (name, (model, optimizer)) in enumerate(self.models.items()):
            items = self.contents(name, "save_contents")
            contents[name] = [i for i in CHECKPOINT_CONTENTS if i in items]
            if "model" in items:
                save_checkpoint(os.path.join(tmp, name), model, optimizer if "optimizer" in items else None)
                lora = getattr(model, "lora_config", None)
                if name == "actor" and lora is not None:
                    # global_step_K/actor/lora_adapter/: the adapters alone as a peft directory (what verl's
                    # model_merger writes from a checkpoint; verl's checkpoint itself holds none),
                    # a next stage's lora_adapter_path
                    adapters = gather_full_state_dict(model, trainable_only=True)
                    agreed_write("writing the LoRA adapter", functools.partial(
                        save_peft_adapter, os.path.join(tmp, name, ADAPTER_DIR), adapters, lora, self.base_model,
                        model_type=model.args.model_type)
                        if self.is_main else None)
            if k == 0:
                faults.crash("crash_in_save", step, self.rank)
            if "hf_model" in items:
                export_hf(model, model.args, self.tokenizer, os.path.join(tmp, name, "huggingface"), self.is_main,
                          base_model=self.base_model if name == "actor" else None)
        if rng:
            with open(os.path.join(tmp, "rng", f"rank_{self.rank}.pt"), "wb") as f:
                torch.save(_rng_state(), f)
                flush_to_disk(f)
        if self.is_main:
            state = {"global_step": step, "world_size": self.world_size, "model": self.fingerprint,
                     "config": dataclasses.asdict(self.config), "contents": contents, "bases": self.bases}
            state.update({name: s.state_dict() for name, s in self.states.items()
                          if self._state_kept(name, "save_contents")})
            # The trainer state is written last: its presence marks a complete checkpoint.
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state, f, indent=1)
                flush_to_disk(f)

    def _make_room(self, step: int) -> None:
        """Before step `step` is written, with `keep` >= 2 (verl 0.9.1's order): only the newest `keep` - 1
        earlier checkpoints stay, so a disk or quota that holds `keep` checkpoints holds the save too.
        With `keep` = 1 the only one stays until the new one is in place (`_publish`)."""
        if self.keep is not None and self.keep >= 2:
            self._rotate(step - 1, self.keep - 1)

    def _rotate(self, newest: int, keep: int | None):
        """Keep the newest `keep` complete checkpoints up to step `newest` (after a save: the one just
        written). Newer ones, from a run resumed at an earlier step, are neither counted nor deleted."""
        if keep is None or keep <= 0:
            return
        for old in [s for s in self.complete_steps() if s <= newest][:-keep]:
            # its completion marker first: a process killed while the files go (a large checkpoint's take
            # a while) leaves no checkpoint that a rollback, a fallback from the pointer or a launch's
            # restart takes for complete
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.step_dir(old), STATE_FILE))
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    # --------------------------------------------------------------- load
    def load(self, path: str, keep_progress: bool = False) -> None:
        """Restore the run from checkpoint `path`. With `keep_progress` (a KL-guard rollback) only
        the models and their optimizers come back: the step counter, data position, guard and RNG
        move on, so the run continues on new data instead of replaying the batches that led to the
        rollback, and the KL coefficients and LR schedules (with the guard's own reactions,
        `raise_coef`, `lower_lr`) carry on as they are: the optimizers' learning rates are set
        from the schedules, not taken from the checkpoint."""
        # Everything read from files is checked before any model or optimizer changes.
        state = read_trainer_state(path)
        # (a model's 'extra' states: checked with its contents below)
        missing = [name for name in self.states if name not in state and name not in self.extras]
        if missing:
            raise UserError(f"checkpoint {path!r} has no {missing} state: it was written by an older meshppo (see "
                            "the README); start a fresh run (trainer.resume_mode=disable or another "
                            "trainer.default_local_dir)")
        if state["model"] != self.fingerprint:
            diff = {k: (state["model"].get(k), v) for k, v in self.fingerprint.items() if state["model"].get(k) != v}
            raise UserError(f"checkpoint {path!r} belongs to a different model: (checkpoint, config) differ in {diff}")
        same = same_bases(path, state, self.bases, self.log)
        diffs = [d for d in run_differences(state.get("config", {}), dataclasses.asdict(self.config))
                 if d[0] not in same]
        if diffs:
            listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diffs)
            raise UserError(f"checkpoint {path!r} comes from a run with other training settings ({listed}); it "
                            "cannot continue under these. Start a new run in another trainer.default_local_dir, or "
                            f"start {os.path.dirname(self.root)!r} over with trainer.resume_mode=disable (this "
                            "deletes its checkpoints and metrics)")
        # written before `contents` existed: every model directory there holds all but 'hf_model'
        saved = state.get("contents") or {name: LEGACY_CONTENTS for name in self.models
                                          if os.path.isdir(os.path.join(path, name))}
        fresh = []
        for name in self.models:
            if name not in saved:
                raise UserError(f"checkpoint {path!r} has no {name} but this run trains one (algorithm.adv_estimator)")
            wanted, key = self.contents(name, "load_contents"), f"{ROLE_KEYS[name]}.checkpoint"
            for item in ("model", "optimizer", "extra"):
                if item in wanted and item not in saved[name]:
                    raise UserError(f"checkpoint {path!r} has no {name} {item!r} (it holds {saved[name]}, the "
                                    f"save_contents of the run that wrote it): drop {item!r} from "
                                    f"{key}.load_contents to start it fresh, or resume another checkpoint")
                if item not in wanted and not keep_progress:  # (a rollback loads model and optimizer, never extra)
                    rng = ", RNG as seeded" if (name, item) == ("actor", "extra") else ""
                    fresh.append(f"{name} {item} ({FRESH[item]}{rng})")
        loaded = [name for name in self.states
                  if not keep_progress and self._state_kept(name, "load_contents")]
        for name in loaded:  # a state that can tell whether it fits (the data loader: the data it read)
            check = getattr(self.states[name], "check_state_dict", None)
            if check is not None:
                try:
                    check(state[name])
                except ValueError as e:
                    raise UserError(f"checkpoint {path!r}: {e}") from None
        load_rng = not keep_progress and "extra" in self.contents("actor", "load_contents")
        rng_file = os.path.join(path, "rng", f"rank_{self.rank}.pt")
        same_world = state["world_size"] == self.world_size
        rng = None

        def read_rng() -> None:
            nonlocal rng
            if load_rng and same_world and os.path.isdir(os.path.dirname(rng_file)):  # written with RNG states
                if not os.path.isfile(rng_file):
                    raise UserError(f"checkpoint {path!r} is incomplete: it has no {os.path.relpath(rng_file, path)}, "
                                    f"rank {self.rank}'s RNG state (saved with the actor's 'extra'); resume an earlier "
                                    "checkpoint or leave 'extra' out of actor_rollout_ref.actor.checkpoint.load_contents")
                rng = read_rng_state(rng_file)

        # a rank's own file: agreed, so that no rank is left in the models' load below
        agreed_user_error(read_rng, lambda rank: f"checkpoint {path!r}: rank {rank}'s RNG state is missing or "
                                                 "unreadable (that rank's log says which file and why)")
        loads = []  # (directory, model, optimizer or None) of each model whose weights load
        for name, (model, optimizer) in self.models.items():
            wanted = self.contents(name, "load_contents")
            if "model" in wanted:
                loads.append((os.path.join(path, name), model, optimizer if "optimizer" in wanted else None))
        try:
            for model_dir, _, optimizer in loads:
                check_checkpoint(model_dir, with_optimizer=optimizer is not None)
            for model_dir, model, optimizer in loads:
                load_checkpoint(model_dir, model, optimizer)
        except UnsafeCheckpointError as e:
            raise UserError(str(e)) from None
        for name, s in self.states.items():
            if name in loaded:
                s.load_state_dict(state[name])
            if isinstance(s, torch.optim.lr_scheduler.LambdaLR):
                _schedule_lr(s)
        if rng is not None:
            _set_rng_state(rng)
        if fresh:
            self.log(f"checkpoint {path}: not loaded (checkpoint.load_contents), starting fresh: {'; '.join(fresh)}")
        if load_rng and not same_world:
            self.log(f"checkpoint {path}: written by {state['world_size']} ranks, resumed on {self.world_size}: "
                     "Python's, NumPy's and torch's global RNG streams keep their trainer.seed seeding (a rank's saved "
                     "state belongs to its rank; a custom reward function or an agent's tool drawing from them draws "
                     "other numbers). The trainer's own generators are seeded from trainer.seed, the step and the "
                     "rank or replica, not from the saved states: the data order (data.seed and the saved position) "
                     "and the engine's rollout sampling (keyed by step and prompt) do not depend on the world size, "
                     "but the mini-batches (each rank shuffles its own rows), clip_cov's draws (per data-parallel "
                     "rank), rollout.name=hf's sampling (per replica) and the order of the reductions do: the run "
                     "does not reproduce the uninterrupted one")
        if not keep_progress and os.path.abspath(path) == os.path.abspath(self.step_dir(state["global_step"])):
            self.saved_step = state["global_step"]

    def maybe_resume(self, resume_mode: str, resume_from_path: str | None = None) -> str | None:
        """Continue from a checkpoint (`trainer.resume_mode`), or start fresh; the checkpoint's path
        if one was loaded.
        `disable` starts the run directory over: an earlier run's checkpoints there are deleted,
        so that they can be neither resumed nor rotated in place of this run's. Both `disable` and
        `resume_path` describe the launch's first start, which marks the run directory as the
        launch's (`LAUNCH_MARKER`, its TORCHELASTIC_RUN_ID): after a restart by torchrun
        (`TORCHELASTIC_RESTART_COUNT`, `--max-restarts`) or a SLURM requeue (`SLURM_RESTART_COUNT`,
        the job id the rendezvous id) the run continues from the newest checkpoint
        the launch wrote since, where there is one, instead of deleting it or going back to where it
        began; an earlier run's checkpoints are never taken for the launch's."""
        # torchrun's restarts, and a SLURM requeue (a new torchrun under the same job, whose id the
        # sbatch templates give as the rendezvous id)
        restarts = {name: int(os.environ.get(var, "0") or 0) for name, var in
                    (("torchrun restart", "TORCHELASTIC_RESTART_COUNT"), ("SLURM requeue", "SLURM_RESTART_COUNT"))}
        if resume_mode in ("disable", "resume_path"):
            own = self._launch_checkpoint() if any(restarts.values()) else None
            if own is not None:
                which = ", ".join(f"{name} {n}" for name, n in restarts.items() if n)
                self.log(f"{which} of this launch: resuming its newest checkpoint {own} "
                         f"(trainer.resume_mode={resume_mode} is for the launch's first start)")
                self.load(own)
                return own
            path = self._first_start(resume_mode, resume_from_path)
            self._mark_launch()
            return path
        return self._first_start(resume_mode, resume_from_path)

    def _launch_checkpoint(self) -> str | None:
        """After a restart: the newest complete checkpoint this launch wrote (the launch marker names
        its TORCHELASTIC_RUN_ID and the checkpoints that were there before it), None if none."""
        try:
            with open(os.path.join(self.root, LAUNCH_MARKER)) as f:
                marker = json.load(f)
            launch, before = marker["launch"], marker["before"]
        except (OSError, ValueError, TypeError, KeyError):  # none, or an older meshppo's (plain run id)
            return None
        if launch != os.environ.get("TORCHELASTIC_RUN_ID", ""):
            return None
        own = [s for s in self.complete_steps() if self._state_identity(s) != before.get(str(s))]
        return self.step_dir(own[-1]) if own else None

    def _state_identity(self, step: int) -> list[int]:
        """What tells a step's checkpoint from one written over it later: its trainer state file's inode,
        modification time and size (a save writes a new file and renames it into place). Not the time
        alone: file systems that keep it to the second (NFS, Lustre) or two (FAT) give a checkpoint
        written just before the launch marker the marker's own time."""
        st = os.stat(os.path.join(self.step_dir(step), STATE_FILE))
        return [st.st_ino, st.st_mtime_ns, st.st_size]

    def _mark_launch(self) -> None:
        """Record that this launch (its TORCHELASTIC_RUN_ID) owns the run directory from now: its
        checkpoints are those that were not there, as they are now, when it started, which a restart
        resumes."""
        launch = os.environ.get("TORCHELASTIC_RUN_ID")

        def mark():
            os.makedirs(self.root, exist_ok=True)
            before = {str(s): self._state_identity(s) for s in self.complete_steps()}
            with open(os.path.join(self.root, LAUNCH_MARKER), "w") as f:
                json.dump({"launch": launch, "before": before}, f)
        agreed_write(f"marking {self.root} as this launch's", mark if self.is_main and launch else None)

    def _first_start(self, resume_mode: str, resume_from_path: str | None) -> str | None:
        """`maybe_resume` at the launch's first start (or a restart with no checkpoint of its own)."""
        if resume_mode == "disable":
            self._refuse_deleting_what_the_run_reads()
            def delete():
                self.log(f"trainer.resume_mode=disable: deleting the earlier run's checkpoints in {self.root}")
                shutil.rmtree(self.root)
            earlier = self.is_main and os.path.isdir(self.root) and os.listdir(self.root)
            agreed_write(f"deleting the earlier run's checkpoints in {self.root}", delete if earlier else None)
            return None
        if resume_mode == "resume_path":
            if not os.path.isdir(resume_from_path):
                raise UserError(f"trainer.resume_from_path {resume_from_path!r} does not exist"
                                f"{_checkpoint_hint(resume_from_path)}")
            path = resume_from_path
        else:
            path = self.latest()
            if path is None:
                legacy = sorted(glob.glob(os.path.join(self.root, "global_step_*", "trainer_state.pt")))
                if legacy:  # an older meshppo's pickled checkpoint: say so rather than start over on it
                    read_trainer_state(os.path.dirname(legacy[-1]))
                return None
        self.load(path)
        return path

    def _refuse_deleting_what_the_run_reads(self) -> None:
        """A UserError, before anything is deleted, when resume_mode=disable would delete a checkpoint
        directory this run reads its model, adapter or tokenizer from (a second stage trained from the
        first's `global_step_N/actor/huggingface` in the same run directory)."""
        if self.config is None or not os.path.isdir(self.root):
            return
        inside = paths_read_under(self.config, self.root)
        if inside:
            raise UserError(f"trainer.resume_mode=disable would delete {self.root}, which holds {inside[0]!r}, "
                            "a model, adapter or tokenizer this run reads (actor_rollout_ref.model.path, "
                            "lora_adapter_path, data.tokenizer, critic.model.path or reward_model.model.path): copy it "
                            "out of the run directory first, or train in another trainer.default_local_dir")

    def rollback(self, step: int) -> str:
        """Load the models and optimizers of the checkpoint of `step` (a KL-guard rollback, which
        picks the step: `KLGuard.rollback_target`); its path."""
        path = self.step_dir(step)
        self.load(path, keep_progress=True)
        return path


def export_hf(model, model_args, tokenizer, out_dir: str, is_main: bool, adapter_dir: str | None = None,
              base_model: str | None = None) -> None:
    """Write `model` (a policy or value model) as a Hugging Face directory (rank 0 writes; all
    ranks gather). A LoRA model is written with its adapters merged into the weights, and with
    `adapter_dir` its adapters alone as a peft adapter directory there (`base_model`: the
    adapter's `base_model_name_or_path`). The base checkpoint's `generation_config.json` (its EOS
    ids, sampling defaults) comes along. The weights are written in the dtype of the checkpoint
    the model was read from (`ModelArgs.hf_dtype`; a bf16 base's export is bf16, as verl's
    model_merger writes it, the trained master weights rounded once), float32 where it names none;
    config.json says which."""
    lora = getattr(model, "lora_config", None)
    full = gather_full_state_dict(model)

    def write_all():
        from models import Transformer

        state, adapters = full, None
        if lora is not None:
            adapters = {k: v for k, v in full.items() if is_lora_name(k)}
            state = merged_state_dict(full, lora.scaling)
        with torch.device("meta"):
            shell = Transformer(model_args, head=model.head)

        def write(tmp):
            save_pretrained(shell, tmp, state_dict=state, dtype=getattr(torch, model_args.hf_dtype or "float32"))
            tokenizer.save_pretrained(tmp)
            generation = os.path.join(base_model or "", "generation_config.json")
            if base_model and os.path.isfile(generation):
                shutil.copyfile(generation, os.path.join(tmp, "generation_config.json"))
        _replace_dir(out_dir, write)
        if adapters is not None and adapter_dir is not None:  # after the model: it may live inside out_dir
            _replace_dir(adapter_dir, lambda tmp: save_peft_adapter(tmp, adapters, lora, base_model,
                                                                    model_type=model_args.model_type))
    agreed_write(f"writing the Hugging Face model to {out_dir}", write_all if is_main else None)


def _replace_dir(out_dir: str, write) -> None:
    """`write(tmp)` a directory next to `out_dir`, then put it in `out_dir`'s place."""
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
