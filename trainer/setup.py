"""Building what the trainer runs on: meshes, FSDP2 models, optimizers, the engine.

`preflight` runs first, in every process before any work (and in the launcher before it
starts the ranks); importing this module loads no model, FSDP or optimizer implementation (the
functions that build import them), so that a config error is said without them. Then, in the same
order on every rank (each step may be a collective):
meshes -> actor -> reference (none for a LoRA actor) -> critic -> reward model -> engine -> resharder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from models import ModelArgs, load_model_args, torch_dtypes
from models.args import DROPOUT_KEYS, tiled_moe_refusal
from models.checkpoint import CheckpointFileError
from models.lora import trainable_parameters
from trainer.config import OptimConfig, PPOConfig, check_final_exports, described_launch, validate
from trainer.configlib import ConfigError, shown
from trainer.errors import UserError
from trainer.launch import DistContext
from trainer.profiling import profile_plan, save_path_key
from trainer.tracking import file_logger_path
from rollout.config import check_quantization, check_tp_divisibility
from sharding.compile import apply_compile
from sharding.mesh import ParallelDims, ParallelMeshes
from sharding.ulysses import (SequenceParallel, apply_sequence_parallel, build_sequence_parallel,
                              check_sequence_parallel)


# trainer.logger entries that need a package requirements.txt does not install.
OPTIONAL_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def preflight(cfg: PPOConfig, world_size: int | None = None, local_world_size: int | None = None,
              devices: bool = True) -> None:
    """Everything that can be checked before any work: the config against the launch it
    describes and, given, against the real one (`validate`); the packages the loggers need;
    the output directories; with `devices`, this machine's devices (CUDA present for
    trainer.device=cuda, trainer.n_gpus_per_node GPUs visible, a SLURM allocation of no more
    GPUs). `--print-config` checks without `devices`: a config is checked, for the launch it
    describes or the launcher's, on any machine (a login node without GPUs, a workstation with
    fewer), and the launch checks the devices where it runs. Raises ConfigError."""
    validate(cfg, world_size, local_world_size)
    check_sequence_parallel_models(cfg, *described_launch(cfg))  # validate: the real launch is the described one
    check_engine_tensor_parallel(cfg)
    check_engine_quantization(cfg)
    check_lora_adapter(cfg)
    check_value_model_export(cfg)
    check_tiled_mlp(cfg)
    check_routing_replay(cfg)
    t = cfg.trainer
    if t.default_local_dir is not None and not t.default_local_dir.strip():
        # (an unset shell variable: trainer.default_local_dir=$RUN) no directory to lock, log or write into
        raise ConfigError(f"trainer.default_local_dir={shown(t.default_local_dir)} is empty: give the run directory, or "
                          "null for runs/<trainer.project_name>/<trainer.experiment_name>")
    for key in ("default_local_dir", "rollout_data_dir", "validation_data_dir"):
        check_output_dir(f"trainer.{key}", getattr(t, key))
    check_final_exports(cfg)
    if "tensorboard" in t.logger:  # verl's variable: the event files' directory instead of the run directory's
        check_output_dir("TENSORBOARD_DIR (environment, trainer.logger=tensorboard)", os.environ.get("TENSORBOARD_DIR"))
    if "file" in t.logger:  # verl's file logger writes outside the run directory
        path, source = file_logger_path(t.project_name, t.experiment_name)
        if path.is_dir():
            raise ConfigError(f"trainer.logger=file writes {path} ({source}), which is a directory: point "
                              "VERL_FILE_LOGGER_PATH at a file")
        check_output_dir(f"the file logger's directory ({source}, trainer.logger=file)", str(path.parent))
    profile_key = save_path_key(cfg)
    if profile_key is not None:  # the profiled step's trace would be lost at its export
        check_output_dir(profile_key, profile_plan(cfg).save_path)
    for name in cfg.trainer.logger:
        package = OPTIONAL_LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.logger includes {name} but the {package} package is not installed: "
                              f"pip install {package}, or remove {name} from trainer.logger")
    if devices:
        _check_devices(cfg)


def _check_devices(cfg: PPOConfig) -> None:
    """This machine's devices against the config's node (`preflight`)."""
    device = cfg.trainer.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but CUDA is not available on this machine")
    per_node = described_launch(cfg)[1]
    if device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < per_node:
        raise ConfigError(f"trainer.n_gpus_per_node={per_node} but this node has {torch.cuda.device_count()} "
                          "visible GPUs (CUDA_VISIBLE_DEVICES)")
    allocated = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if device != "cpu" and allocated.isdigit() and int(allocated) > per_node:
        raise ConfigError(f"this SLURM job has {allocated} GPUs on the node but trainer.n_gpus_per_node={per_node} "
                          f"uses {per_node}: submit with --gpus-per-node={per_node}, or set "
                          f"trainer.n_gpus_per_node={allocated}")


def check_output_dir(key: str, path: str | None) -> None:
    """A directory the run will write (or create): refused, naming `key`, when it or a folder above it is a file."""
    if not path:
        return
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return
        p = parent
    if not os.path.isdir(p):
        what = "is a file" if p == os.path.abspath(path) else f"is under {p}, a file"
        raise ConfigError(f"{key}={path} {what}: the run writes a directory there")
    try:  # a file made and removed at once: permissions, a read-only mount, what access() would not tell root
        fd, probe = tempfile.mkstemp(prefix=".meshppo-write-check-", dir=p)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        where = "" if p == os.path.abspath(path) else f" (in {p}, the nearest folder that exists)"
        raise ConfigError(f"{key}={path}: cannot write there{where}: {e.strerror or e}") from None


@dataclass
class Models:
    dims: ParallelDims
    meshes: ParallelMeshes
    actor_args: ModelArgs
    actor: torch.nn.Module
    actor_optim: torch.optim.Optimizer
    actor_sched: torch.optim.lr_scheduler.LRScheduler
    ref: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_optim: torch.optim.Optimizer | None = None
    critic_sched: torch.optim.lr_scheduler.LRScheduler | None = None
    reward_model: torch.nn.Module | None = None
    # Ulysses groups (None: size 1) of the actor and reference, the critic and the reward model
    actor_sp: SequenceParallel | None = None
    critic_sp: SequenceParallel | None = None
    reward_model_sp: SequenceParallel | None = None

    def ulysses_sizes(self) -> dict[str, int]:
        """The roles' Ulysses group sizes above 1 (the reference's is the actor's)."""
        groups = {"actor": self.actor_sp, "critic": self.critic_sp, "reward model": self.reward_model_sp}
        return {role: sp.size for role, sp in groups.items() if sp is not None}


def make_optimizer(model: torch.nn.Module, oc: OptimConfig, total_steps: int, device: torch.device):
    """AdamW over the trainable parameters (a LoRA model's adapters only) plus a linear warm-up
    from 0 followed by a constant or cosine schedule: verl's options and schedules, step for step.
    Past the schedule's length (optim.total_training_steps below the run's) the cosine holds its
    final value."""
    from sharding.optim import ShardAdamW

    params = trainable_parameters(model)
    # On the GPU the fused kernel (one pass over each parameter's fp32 state) is ~3x faster
    # than foreach (BENCHMARKS.md); parameters kept on CPU (offload_policy) use foreach.
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    # AdamW itself, with the update kernels given the DTensors' local shards (sharding.optim).
    optim = ShardAdamW(params, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay,
                       foreach=not fused, fused=fused)
    total = oc.total_training_steps if oc.total_training_steps > 0 else total_steps
    warmup = oc.lr_warmup_steps if oc.lr_warmup_steps > 0 else int(oc.lr_warmup_steps_ratio * total)  # (as verl)

    def factor(step: int) -> float:
        # verl's get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup (transformers'
        # convention): update `step` (from 0) warms up at step / warmup, so the first one's lr is 0.
        if step < warmup:
            return step / warmup
        if oc.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return oc.min_lr_ratio + (1 - oc.min_lr_ratio) * 0.5 * (1 + math.cos(2 * math.pi * oc.num_cycles * progress))

    return optim, torch.optim.lr_scheduler.LambdaLR(optim, factor)


def load_actor_tokenizer(cfg: PPOConfig):
    """The actor's tokenizer (`data.tokenizer`, by default the actor's model path), with
    `actor_rollout_ref.model.custom_chat_template` in place of its own once that renders a chat."""
    from models.tokenizer import TOKENIZER_FILES, has_tokenizer, load_tokenizer

    path = cfg.data.tokenizer
    if not os.path.isdir(path):
        raise UserError(f"tokenizer directory {path!r} does not exist (data.tokenizer or actor_rollout_ref.model.path)")
    if not has_tokenizer(path):
        raise UserError(f"tokenizer directory {path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; "
                        "data.tokenizer or actor_rollout_ref.model.path)")
    tokenizer = load_tokenizer(path, "data.tokenizer")
    check_tokenizer_fits(cfg, tokenizer)
    template = cfg.actor_rollout_ref.model.custom_chat_template
    if template is not None:
        # a template that does not render a one-message chat with the generation prompt (bad
        # Jinja, a variable it cannot find) is refused naming the key before any data is read
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], chat_template=template,
                                          add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise ConfigError(f"actor_rollout_ref.model.custom_chat_template does not render a chat: "
                              f"{type(err).__name__}: {err}") from None
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_size(tokenizer) -> int:
    """How many token ids `tokenizer` can produce: past its largest id, added tokens included.

    The one rule for "a model embeds this tokenizer's ids" (the actor's, a critic's, a reward
    model's): `tokenizer_size(tokenizer) <= vocab_size`. Every id counts, an added special token's
    too: special tokens are matched in the prompts' text and written by chat templates, and the pad
    token is fed to the models as input (`pad_note`)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def pad_note(tokenizer, vocab: int) -> str:
    """What to add to a refusal of `tokenizer` for a model embedding `vocab` ids when its pad token is
    one of those past it (Llama-2 with a [PAD] added and the embeddings not resized): the pad id is not
    only a label that no input holds. meshppo fills the padded layout's rows, the packed layout's
    Ulysses padding, the HF rollout's prompts and the reward model's batches with it, and the models
    embed it as any other input id."""
    pad = tokenizer.pad_token_id
    if pad is None or pad < vocab:
        return ""
    return (f"; its pad token {tokenizer.pad_token!r} (id {pad}) is one of them, and meshppo pads the models' "
            "inputs with the pad token, which they embed as any other token id: give the tokenizer a pad token "
            "the model embeds (its eos or unk token), or resize the model's embeddings")


def check_tokenizer_fits(cfg: PPOConfig, tokenizer) -> None:
    """UserError, before any data or model loads, unless the actor's model (and a critic of another
    model directory, which scores the actor's tokens) embeds every token id of the actor's
    `tokenizer` (`data.tokenizer`): an id past its vocab_size would stop the first generation. A
    vocabulary larger than the tokenizer's (Qwen's, padded) is as it should be."""
    arr = cfg.actor_rollout_ref
    models = [("actor_rollout_ref.model.path", arr.model.path, arr.model.override_config)]
    critic = cfg.critic.model
    if cfg.uses_critic and (critic.path, critic.override_config) != (arr.model.path, arr.model.override_config):
        models.append(("critic.model.path", critic.path, critic.override_config))
    size = tokenizer_size(tokenizer)
    for key, path, overrides in models:
        vocab = load_model_args(path, overrides).vocab_size
        if size > vocab:
            raise UserError(f"the tokenizer (data.tokenizer {cfg.data.tokenizer!r}) has {size} token ids but the "
                            f"model of {key} {path!r} embeds {vocab} (vocab_size): token ids {vocab} and up would be "
                            "outside its vocabulary; use the model's own tokenizer (or one of its vocabulary)"
                            + pad_note(tokenizer, vocab))


def reward_model_inputs(rm, actor_tokenizer, actor_path: str):
    """Checks the reward model (`reward_model`'s options) before any model loads, and returns how
    its inputs are made: `RewardModelInputs` rendering each chat with the reward model's own
    tokenizer and template (`model.input_tokenizer` set, verl's default: the actor's model path,
    `actor_path`, which means `actor_tokenizer`), or None when it reads the
    actor's token ids as they are (`input_tokenizer` null: it must then share the actor's
    vocabulary). Every model needs a trained score head: a causal-LM checkpoint has none, and the
    value head that a critic may start at zero would make every reward 0."""
    from models.checkpoint import checkpoint_tensor_names
    from models.tokenizer import TOKENIZER_FILES, has_tokenizer, load_tokenizer
    from rewards.model_inputs import RewardModelInputs

    path, src = rm.model.path, rm.model.input_tokenizer
    key = f"reward_model.model.path {path!r}"
    if "score.weight" not in checkpoint_tensor_names(path):
        raise UserError(f"{key} has no score head (score.weight): a reward model is a meshppo value model or a "
                        "Hugging Face *ForSequenceClassification / *ForTokenClassification directory, not a causal "
                        "LM (it would score every response 0)")
    vocab = load_model_args(path, rm.model.override_config).vocab_size
    own_tokenizer = has_tokenizer(path)
    if src is None:
        size = tokenizer_size(actor_tokenizer)
        if size > vocab:
            raise UserError(f"{key} embeds {vocab} token ids but the actor's tokenizer (data.tokenizer) has "
                            f"{size}: with reward_model.model.input_tokenizer=null the reward model "
                            "reads the actor's token ids, so it needs the actor's vocabulary"
                            + pad_note(actor_tokenizer, vocab))
        if own_tokenizer and load_tokenizer(path, "reward_model.model.path").get_vocab() != actor_tokenizer.get_vocab():
            raise UserError(f"{key} has a tokenizer other than the actor's (data.tokenizer): with "
                            "reward_model.model.input_tokenizer=null the reward model is given the actor's token ids "
                            "as they are, which another vocabulary reads as other text; leave input_tokenizer at its "
                            "default to have each chat rendered with the reward model's own tokenizer")
        return None
    why = ("reward_model.model.input_tokenizer is set (verl's default: the actor's model path), so the reward model "
           "reads each chat rendered with its own tokenizer and chat template")
    if not own_tokenizer:
        raise UserError(f"{key} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): {why}; save them with the "
                        "model, or set input_tokenizer=null to give it the actor's token ids")
    rm_tokenizer = load_tokenizer(path, "reward_model.model.path")
    if not getattr(rm_tokenizer, "chat_template", None):
        raise UserError(f"{key}: its tokenizer has no chat template: {why}; use a reward model with one, or set "
                        "input_tokenizer=null to give it the actor's token ids")
    size = tokenizer_size(rm_tokenizer)
    if size > vocab:
        raise UserError(f"{key}: its tokenizer has {size} token ids but the model embeds {vocab}"
                        + pad_note(rm_tokenizer, vocab))
    if src == actor_path:
        src_tokenizer = actor_tokenizer
    elif not os.path.isdir(src) or not has_tokenizer(src):
        raise UserError(f"reward_model.model.input_tokenizer {src!r} is not a directory holding a tokenizer (one of "
                        f"{', '.join(TOKENIZER_FILES)})")
    else:
        src_tokenizer = load_tokenizer(src, "reward_model.model.input_tokenizer")
    return RewardModelInputs(src_tokenizer, rm_tokenizer, rm.max_length)


def _compute_dtype_guard(cfg_fsdp, device: torch.device):
    """bf16 matmuls on CPU are slow and lossy; CPU runs compute in the master dtype."""
    if device.type == "cpu":
        cfg_fsdp.mixed_precision.param_dtype = cfg_fsdp.model_dtype
    return cfg_fsdp


def build_models(cfg: PPOConfig, ctx: DistContext, total_steps: int, tokenizer) -> Models:
    """The step's models on their meshes; `tokenizer` is the actor's (the reward model must share it).
    Each model's `override_config` applies to its arguments; the actor's also to the reference's and
    the engine's (`Models.actor_args`), as in verl."""
    from sharding.fsdp import build_fsdp_model

    arr = cfg.actor_rollout_ref
    path, overrides = arr.model.path, arr.model.override_config
    actor_args = load_model_args(path, overrides)
    check_sequence_parallel_models(cfg, ctx.world_size, ctx.local_world_size)
    dims = ParallelDims(world_size=ctx.world_size, fsdp_size=arr.actor.fsdp_config.fsdp_size,
                        tp=arr.rollout.tensor_model_parallel_size, local_world_size=ctx.local_world_size)
    meshes = dims.build_meshes(ctx.device.type, timeout_s=cfg.trainer.nccl_timeout)
    seed = cfg.trainer.seed
    dummy = arr.model.load_format == "dummy"
    actor = build_trained_model(cfg, "actor", meshes.train, ctx.device)
    if arr.actor.use_torch_compile:
        apply_compile(actor)
    actor_optim, actor_sched = make_optimizer(actor, arr.actor.optim, total_steps, ctx.device)
    models = Models(dims, meshes, actor_args, actor, actor_optim, actor_sched)
    # A LoRA actor is its own reference with the adapters off (roles.AdaptersOffReference): no second model.
    if cfg.uses_ref and arr.model.lora is None:
        models.ref = build_fsdp_model(path, meshes.train, _compute_dtype_guard(arr.ref.fsdp_config, ctx.device),
                                      device=ctx.device, trainable=False, seed=seed, dummy_weights=dummy,
                                      overrides=overrides)
        _tiled_mlp(models.ref, arr.model.tiled_mlp)  # verl's tiled_mlp is actor_rollout_ref.model's: the ref's too
        if arr.ref.use_torch_compile:
            apply_compile(models.ref)
    if cfg.uses_critic:
        models.critic = build_trained_model(cfg, "critic", meshes.train, ctx.device)
        if arr.actor.use_torch_compile:
            apply_compile(models.critic)
        models.critic_optim, models.critic_sched = make_optimizer(models.critic, cfg.critic.optim, total_steps,
                                                                  ctx.device)
    if cfg.reward_model.enable:
        rm = cfg.reward_model.model
        models.reward_model = build_fsdp_model(rm.path, meshes.train, _compute_dtype_guard(rm.fsdp_config, ctx.device),
                                               head="value", device=ctx.device, trainable=False, seed=seed,
                                               overrides=rm.override_config)
    _sequence_parallel(cfg, ctx, models)
    return models


def build_trained_model(cfg: PPOConfig, role: str, mesh, device: torch.device, *, initial_adapters: bool = True):
    """The actor (`role` "actor") or the critic ("critic") as the run trains it, on `mesh`, before
    `torch.compile`: its model path, overrides, head, LoRA, tiled MLP and memory options.
    `initial_adapters=False`: a LoRA actor's adapters start from peft's initialisation, not from
    `actor_rollout_ref.model.lora_adapter_path` (a checkpoint about to load its own)."""
    from sharding.fsdp import build_fsdp_model

    arr = cfg.actor_rollout_ref
    dummy = arr.model.load_format == "dummy"
    if role == "actor":
        m, fsdp_config, head = arr.model, arr.actor.fsdp_config, "lm"
        adapters = m.lora_adapter_path if initial_adapters else None
    elif role == "critic":
        m, fsdp_config, head, adapters = cfg.critic.model, cfg.critic.model.fsdp_config, "value", None
        dummy = dummy and m.path == arr.model.path  # a critic of another path than the actor's is read from it
    else:
        raise ValueError(f"role {role!r}: the trained models are 'actor' and 'critic'")
    model = build_fsdp_model(m.path, mesh, _compute_dtype_guard(fsdp_config, device), head=head, device=device,
                             trainable=True, seed=cfg.trainer.seed, dummy_weights=dummy,
                             enable_gradient_checkpointing=m.enable_gradient_checkpointing,
                             enable_activation_offload=m.enable_activation_offload, lora=m.lora,
                             lora_adapter_path=adapters, overrides=m.override_config)
    _tiled_mlp(model, m.tiled_mlp)
    return model


def _tiled_mlp(model, tiled) -> None:
    """A model's `tiled_mlp` section on its MLPs (an attribute each: FSDP's units and hooks stay;
    before `apply_compile`, whose graphs guard on it)."""
    if tiled.enabled:
        from models.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, tiled.num_shards)


def _sequence_parallel_roles(cfg: PPOConfig) -> list[tuple]:
    """(config key, size, its `Models` group field, the `Models` fields of its models, its model
    directory) of each role the run uses."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.ulysses_sequence_parallel_size, "actor_sp", ("actor", "ref"),
              arr.model.path)]
    if cfg.uses_critic:
        roles.append(("critic", cfg.critic.ulysses_sequence_parallel_size, "critic_sp", ("critic",),
                      cfg.critic.model.path))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.ulysses_sequence_parallel_size, "reward_model_sp",
                      ("reward_model",), cfg.reward_model.model.path))
    return roles


def check_sequence_parallel_models(cfg: PPOConfig, world_size: int, local_world_size: int | None) -> None:
    """Each role's Ulysses size against its model's attention heads and the launch, before any
    model is built."""
    for key, size, _, _, path in _sequence_parallel_roles(cfg):
        if size == 1:
            continue
        args = _readable_model_args(path)
        if args is None:
            continue
        try:
            check_sequence_parallel(f"{key}.ulysses_sequence_parallel_size", size, world_size, local_world_size,
                                    args.num_attention_heads, args.num_key_value_heads)
        except ValueError as e:
            raise ConfigError(f"{e} (the model in {path})") from None


def check_engine_tensor_parallel(cfg: PPOConfig) -> None:
    """The engine's TP size against the actor's model (its query heads, vocabulary and MLP are split over
    the TP ranks, its KV heads split or replicated: `rollout.config.check_tp_divisibility`), before any
    model is built."""
    arr = cfg.actor_rollout_ref
    tp = arr.rollout.tensor_model_parallel_size
    if arr.rollout.engine != "native" or tp == 1:
        return
    args = _readable_model_args(arr.model.path, arr.model.override_config)
    if args is None:
        return
    try:
        check_tp_divisibility(args, tp)
    except ValueError as e:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: {e} (the model in "
                          f"{arr.model.path})") from None


def check_engine_quantization(cfg: PPOConfig) -> None:
    """The engine's quantization against the actor's model (`rollout.config.check_quantization`: fp8 on an
    OLMo-2 or a Gemma), before any model is built."""
    arr = cfg.actor_rollout_ref
    if arr.rollout.engine != "native" or arr.rollout.quantization is None:
        return
    args = _readable_model_args(arr.model.path, arr.model.override_config)
    try:
        if args is not None:
            check_quantization(args, arr.rollout.quantization)
    except ValueError as e:
        raise ConfigError(f"actor_rollout_ref.rollout.quantization={arr.rollout.quantization}: {e} (the model in "
                          f"{arr.model.path})") from None


def check_lora_adapter(cfg: PPOConfig) -> None:
    """The LoRA adapters against the models they go on, before any model is built: the projections
    they select on the actor's and the critic's model (`models.lora.model_targets`: on a Phi-3 its fused qkv_proj
    and gate_up_proj, a part of one alone refused), and the actor's peft adapter (`lora_adapter_path`, its config and header already
    read by `validate`): every tensor the shape the model's adapter has. Its safetensors header alone
    is read: the tensors are read once, where the actor is built."""
    from models.lora import LM_HEAD, VALUE_HEAD, model_targets, read_peft_adapter_shapes

    arr = cfg.actor_rollout_ref
    models = [("actor_rollout_ref.model", arr.model)] + ([("critic.model", cfg.critic.model)] if cfg.uses_critic else [])
    for key, model in models:
        lora = model.lora
        args = None if lora is None else _readable_model_args(model.path, model.override_config)
        if args is None:
            continue
        try:
            model_targets(lora, args, heads=VALUE_HEAD if key == "critic.model" else LM_HEAD)
        except ValueError as e:
            given = "the adapter at lora_adapter_path's" if getattr(model, "lora_adapter_path", None) else "its"
            raise ConfigError(f"{key}: {e} ({given} target_modules, the model in {model.path})") from None
    adapter = arr.model.lora_adapter_path
    if adapter is None:
        return
    args = _readable_model_args(arr.model.path, arr.model.override_config)
    if args is None:
        return
    try:
        read_peft_adapter_shapes(adapter, args)
    except (OSError, ValueError) as e:
        raise ConfigError(f"actor_rollout_ref.model.lora_adapter_path: {e} (the model in {arr.model.path})") from None


def model_notes(cfg: PPOConfig) -> list[str]:
    """Start-up lines that need the actor's model directory (`config_notes` reads the config alone):
    an engine context beyond the positions the model was trained for (rollout.name=hf, which has no
    engine and reads no max_model_len: the longest prompt and response)."""
    arr = cfg.actor_rollout_ref
    args = _readable_model_args(arr.model.path, arr.model.override_config)
    notes = []
    r = arr.rollout
    if r.engine == "native":
        context = r.max_model_len
        what = (f"actor_rollout_ref.rollout.max_model_len={context} (data.max_prompt_length + rollout.response_length "
                "unless set)")
    else:
        context = cfg.data.max_prompt_length + r.response_length
        what = (f"data.max_prompt_length + actor_rollout_ref.rollout.response_length = {context} (the longest "
                f"sequence rollout.name={r.name} generates)")
    longest = cfg.data.max_prompt_length + r.response_length
    # a max_model_len set past the longest sequence: only the engine's context reaches past the positions
    fix = ("lower actor_rollout_ref.rollout.max_model_len (the longest prompt and response take "
           f"{longest})" if context > longest else "shorten the prompts or responses")
    if args is not None and context > args.max_position_embeddings:
        notes.append(f"{what} is beyond the max_position_embeddings of the actor's model "
                     f"({args.max_position_embeddings}, {arr.model.path}): its positions past that were never "
                     f"trained (vLLM refuses such a context); {fix}, or set "
                     "actor_rollout_ref.model.override_config.max_position_embeddings where its RoPE is scaled "
                     "for more")
    return (notes + _unapplied_dropout_notes(arr.model.path, arr.model.override_config)
            + _router_loss_notes(arr.model.path, arr.model.override_config))


def _config_json(path: str) -> dict:
    """The model directory's config.json as a mapping, or an empty one where it cannot be read as one (the start-up
    notes say nothing of such a directory: the ranks name it when they load the model)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _unapplied_dropout_notes(path: str, overrides: dict | None) -> list[str]:
    """A line for each dropout probability above 0 in the actor's config.json that its override_config leaves
    (`models.args.DROPOUT_KEYS`): meshppo's models have no dropout, where verl's Hugging Face actor drops in its
    updates (its reference, critic and reward model run without). An unreadable directory says nothing here: the
    ranks name it when they load the model."""
    config = _config_json(path)
    given = overrides or {}
    return [f"actor_rollout_ref.model.path {path!r}: config.json's {key}={config[key]} is not applied: meshppo's "
            "models have no dropout, where verl's actor drops in its updates; "
            f"actor_rollout_ref.model.override_config.{key}=0 trains the same in both and leaves this note out"
            for key in DROPOUT_KEYS if key not in given and isinstance(config.get(key), (int, float))
            and not isinstance(config[key], bool) and config[key] > 0]


def check_tiled_mlp(cfg: PPOConfig) -> None:
    """ConfigError, before any work, for a tiled MLP (`tiled_mlp.enabled`) on a mixture-of-experts model
    (`models.args.tiled_moe_refusal`), naming the key."""
    arr = cfg.actor_rollout_ref
    for key, model in [("actor_rollout_ref.model", arr.model)] + ([("critic.model", cfg.critic.model)]
                                                                   if cfg.uses_critic else []):
        args = _readable_model_args(model.path, model.override_config) if model.tiled_mlp.enabled else None
        if args is not None and args.moe_layers:
            raise ConfigError(f"{key}.tiled_mlp.enabled=true: {tiled_moe_refusal(args.model_type)} (the model in "
                              f"{model.path})")


def check_routing_replay(cfg: PPOConfig) -> None:
    """ConfigError, before any work, for routing replay on a model without experts, naming the key: the engine's
    record (`rollout.enable_rollout_routing_replay`, and with it `actor.router_replay.mode=R3`) or R2's
    (`actor.router_replay.mode=R2`, the old-log-prob pass's)."""
    arr = cfg.actor_rollout_ref
    keys = [key for key, on in (("actor_rollout_ref.actor.router_replay.mode=R2", arr.actor.router_replay.mode == "R2"),
                                ("actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                                 arr.rollout.enable_rollout_routing_replay)) if on]
    if not keys:
        return
    args = _readable_model_args(arr.model.path, arr.model.override_config)
    if args is not None and not args.moe_layers:
        raise ConfigError(f"{keys[0]} needs a mixture-of-experts model: the {args.model_type} in {arr.model.path} has "
                          f"no experts to route")


def _router_loss_notes(path: str, overrides: dict | None) -> list[str]:
    """A line where the actor's config.json sets output_router_logits (a mixture of experts): transformers then adds router_aux_loss_coef times its load-balancing loss to the loss it computes
    from labels, which verl's actor never asks for (it reads the logits and computes its own loss), and meshppo,
    like verl, trains without it. An unreadable directory says nothing here."""
    config = _config_json(path)
    from models.args import flat_overrides

    # (an override of it is named among the overrides that change nothing)
    if "output_router_logits" in flat_overrides(overrides or {}) or config.get("output_router_logits") is not True:
        return []
    return [f"actor_rollout_ref.model.path {path!r}: output_router_logits=true adds no load-balancing loss: "
            f"transformers adds router_aux_loss_coef={config.get('router_aux_loss_coef', 0.001)} times it only to the "
            "loss it computes from labels, which verl's actor does not ask for; meshppo, like verl, trains on the "
            "PPO loss alone"]


def check_value_model_export(cfg: PPOConfig) -> None:
    """ConfigError, before any work, where the critic's checkpoints would write it as a Hugging Face directory
    (critic.checkpoint.save_contents with hf_model) and its type's transformers family has no token classifier
    to read a value model back (`models.checkpoint.NO_TOKEN_CLASSIFIER`: OLMo-2, Gemma 3, Granite)."""
    from models.checkpoint import NO_TOKEN_CLASSIFIER, value_export_refusal

    if not cfg.uses_critic or "hf_model" not in cfg.critic.checkpoint.save_contents:
        return
    args = _readable_model_args(cfg.critic.model.path, cfg.critic.model.override_config)
    if args is not None and args.model_type in NO_TOKEN_CLASSIFIER:
        raise ConfigError(f"critic.checkpoint.save_contents={shown(cfg.critic.checkpoint.save_contents)} has "
                          f"hf_model: {value_export_refusal(args.model_type)} (the model in {cfg.critic.model.path}); "
                          "drop hf_model from it")


def _readable_model_args(path: str, overrides: dict | None = None) -> ModelArgs | None:
    """The model's arguments for a check before the run, or None when its directory cannot be read:
    that is an input error, which the ranks say in one line when they load the model."""
    try:
        return load_model_args(path, overrides)
    except (FileNotFoundError, CheckpointFileError):
        return None


def _sequence_parallel(cfg: PPOConfig, ctx: DistContext, models: Models) -> None:
    """The roles' Ulysses groups (one per distinct size, built in the same order on every rank),
    each model's attention layers split over its role's group."""
    groups: dict[int, SequenceParallel | None] = {}
    for _, size, group_field, model_fields, _ in _sequence_parallel_roles(cfg):
        if size not in groups:
            groups[size] = build_sequence_parallel(size, ctx.world_size, ctx.device.type, cfg.trainer.nccl_timeout)
        setattr(models, group_field, groups[size])
        for model in (getattr(models, f) for f in model_fields):
            if model is not None:
                apply_sequence_parallel(model, groups[size])


# ---------------------------------------------------------------------- generation
def build_engine(cfg: PPOConfig, ctx: DistContext, models: Models):
    """meshppo's engine for `rollout.name=native` (and verl's vllm, sglang, trtllm; None for the `hf` reference loop)."""
    r = cfg.actor_rollout_ref.rollout
    if r.engine != "native":
        return None
    from rollout import EngineConfig, LLMEngine

    dtype = torch_dtypes()[r.dtype]
    if ctx.device.type == "cpu":
        dtype = torch.float32
    ec = EngineConfig(dtype=dtype, block_size=r.block_size, gpu_memory_utilization=r.gpu_memory_utilization,
                      max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
                      enable_chunked_prefill=r.chunked_prefill, max_model_len=r.max_model_len,
                      enforce_eager=r.enforce_eager, cudagraph_capture_sizes=r.cudagraph_capture_sizes,
                      free_cache_engine=r.free_cache_engine, quantization=r.quantization,
                      kv_cache_dtype=r.kv_cache_dtype, return_routed_experts=r.enable_rollout_routing_replay)
    tp_mesh = models.meshes.tp if models.dims.tp > 1 else None
    return LLMEngine(models.actor_args, ec, tp_mesh=tp_mesh, device=ctx.device)
