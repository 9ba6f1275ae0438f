"""FSDP2 (`fully_shard`) for the actor, the reference model and the critic.

The order, as in torchtitan: build on meta → `apply_fsdp` (casts to `model_dtype`, applies
activation checkpointing / offload per block, shards) → `to_empty` → load or initialise the
local shards (`build_fsdp_model` does all of it). Units, in execution order:

* `embed_tokens` on its own — unless the embedding is tied to the LM head: the tied weight is
  used again by the root's forward after the last block, so it must stay gathered for the
  whole forward and therefore lives in the root unit (with the final norm);
* one unit per transformer block (or per group of blocks, `wrap_policy.min_num_params`);
* `[norm, lm_head]` (or `[norm, score]` for the critic) as one unit, not resharded after
  forward when training: backward starts there immediately;
* the root last, holding whatever is left.

With shard groups of one rank (one GPU, or HYBRID_SHARD with `fsdp_size=1`) there are no
units: the same DTensor parameters get the lean runtime of `sharding.replicate`, unless they
live on the CPU (`offload_policy`), where the whole model is one FSDP2 unit.

`shard_placement_fn` shards every parameter on its TP dimension (`models.parallel_plan`), so
that chunk `k` of the shard group lies inside TP shard `k // (S/t)` and the resharder can fill
the engine with zero redundancy (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import itertools
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from models import ModelArgs, Transformer, load_model_args, tp_shard_dim, tp_shard_parts
from models.args import apply_overrides
from models.checkpoint import checkpoint_tensors
from models.lora import LoRAConfig, check_adapter, inject_lora, lora_init_tensors, read_peft_adapter
from sharding.ac import apply_ac
from sharding.fsdp_config import FSDPConfig
from sharding.replicate import apply_replicated, replicated_params


def fsdp_shard_dim(name: str, shape: torch.Size | tuple[int, ...], shard_size: int) -> int:
    """The dimension FSDP shards parameter `name` on: its TP dimension, 0 for replicated ones.

    FSDP2 requires even sharding on dimensions other than 0; a row-parallel weight whose input
    dimension is not divisible by the shard-group size falls back to dim 0 (the resharder then
    gathers it whole for that parameter, and counts it). So does a parameter whose TP dimension
    fuses several parts (`tp_shard_parts`: a MoE layer's experts' gate/up rows): a TP shard takes
    rows of each part, which no run of consecutive chunks of any dimension holds, and dim 0 (the
    experts) costs FSDP's own gathers no copy.
    """
    d = tp_shard_dim(name)
    if d is None or d >= len(shape) or tp_shard_parts(name) > 1:
        return 0
    if d != 0 and shape[d] % shard_size:
        return 0
    return d


def apply_fsdp(model: Transformer, mesh, cfg: FSDPConfig, *, trainable: bool = True,
               enable_gradient_checkpointing: bool = False, enable_activation_offload: bool = False) -> Transformer:
    """Shard `model` (in place, on meta or materialised) with FSDP2 on the training `mesh`.

    `mesh`: 1-D `("dp_shard",)` (FULL_SHARD) or 2-D `("dp_replicate", "dp_shard")`
    (HYBRID_SHARD), e.g. `ParallelMeshes.train`. `trainable=False` (reference model) freezes
    the parameters and, with `reshard_after_forward` (the default), reshards every unit after
    forward, so a forward-only pass never holds more than one or two gathered units. A frozen
    model with `reshard_after_forward=False` keeps its gathered parameters from the first
    forward on: no gather (or cast) per pass again, for the whole model in the compute dtype
    on every rank (on one GPU the gather is 2 kernels per parameter that the host pays on
    every pass: 146 parameters, 6 ms of a 73M model's 38 ms reference pass).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"apply_fsdp expects a models.Transformer, got {type(model).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"the training mesh must be 1-D (FULL_SHARD) or 2-D (HYBRID_SHARD), got {mesh.ndim}-D")
    model.to(cfg.model_torch_dtype)
    if not trainable:
        model.requires_grad_(False)
    else:
        _store_frozen_in_compute_dtype(model, cfg.param_torch_dtype)
    apply_ac(model, enable_gradient_checkpointing, enable_activation_offload)

    shard_size = mesh.size(mesh.ndim - 1)
    if cfg.fsdp_size not in (-1, shard_size):
        # One training mesh serves actor, reference and critic (docs/ARCHITECTURE.md).
        raise ValueError(f"fsdp_config.fsdp_size={cfg.fsdp_size} but the training mesh shards over {shard_size} ranks: "
                         f"meshppo builds one mesh for all models from actor_rollout_ref.actor.fsdp_config.fsdp_size; "
                         f"set this one to -1 or {shard_size}")
    names = {p: n for n, p in model.named_parameters()}

    def shard_placement_fn(param: nn.Parameter) -> Shard:
        return Shard(fsdp_shard_dim(names[param], param.shape, shard_size))

    param_dtype = cfg.param_torch_dtype
    mp = MixedPrecisionPolicy(
        # Casting to the dtype the master weights already have would only add copies.
        param_dtype=None if param_dtype == cfg.model_torch_dtype else param_dtype,
        reduce_dtype=cfg.reduce_torch_dtype,
    )
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cfg.offload_policy else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, shard_placement_fn=shard_placement_fn)
    reshard = cfg.reshard_after_forward
    # The units used at both ends of the forward (the root, the final norm and head): a trainable
    # model's backward starts with them, a frozen one's next use is its next forward.
    ends = not trainable and reshard

    if shard_size == 1:
        # Every rank holds every parameter whole (one GPU, or HYBRID_SHARD with fsdp_size=1,
        # i.e. plain data parallelism): nothing to gather, so FSDP2's per-parameter host work at
        # every pass buys nothing (on an H200 the 0.5b update was bound by it: BENCHMARKS.md).
        # The same DTensor parameters get a lean runtime instead: one cast kernel before a
        # forward, the gradients all-reduced over the replicas in buckets while the backward
        # runs (`sharding.replicate`). Parameters living on the CPU (`offload_policy`) stay with
        # FSDP2's CPUOffloadPolicy, as one unit.
        if cfg.offload_policy:
            fully_shard(model, reshard_after_forward=ends, **common)
        else:
            apply_replicated(model, mesh, param_dtype=param_dtype, reduce_dtype=cfg.reduce_torch_dtype,
                             keep_after_forward=not trainable and not reshard,
                             shard_dim=lambda name, shape: fsdp_shard_dim(name, shape, 1))
        return model

    tied = model.head == "lm" and model.args.tie_word_embeddings
    units: list[nn.Module] = []
    if not tied:
        fully_shard(model.embed_tokens, reshard_after_forward=reshard, **common)
        units.append(model.embed_tokens)
    groups = _block_groups(model, cfg.wrap_policy.get("min_num_params", 0))
    for k, group in enumerate(groups):
        # Backward starts with the last blocks: resharding them after forward would only make
        # FSDP gather them again at once.
        last = k == len(groups) - 1
        fully_shard(group if len(group) > 1 else group[0],
                    reshard_after_forward=reshard and not (trainable and last), **common)
        units.append(group[0])
    if not tied:
        head = model.score if model.head == "value" else model.lm_head
        fully_shard([model.norm, head], reshard_after_forward=ends, **common)
        units.append(model.norm)
    # Root last: it owns what no unit took (the tied embedding and the norm), whose weights are
    # used at both ends of the forward.
    fully_shard(model, reshard_after_forward=ends, **common)

    if cfg.forward_prefetch:
        # FSDP2 issues a unit's all-gather in its pre-forward hook, so with a CPU that does not run
        # far ahead of the GPU the gather is exposed. Asking each unit to prefetch the next one
        # (the previous one in backward) overlaps the gather with the current unit's compute.
        model.set_modules_to_forward_prefetch(units[:1])
        for prev, nxt in zip(units, units[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def _store_frozen_in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base of a LoRA actor is never updated, so master precision buys it nothing:
    it is stored in the compute dtype (half the bytes of fp32, no cast per all-gather) while the
    trainable adapters keep `model_dtype`. FSDP2 needs one dtype only among the trainable
    parameters of a unit."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.requires_grad and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)


def _block_groups(model: Transformer, min_num_params: int) -> list[list[nn.Module]]:
    blocks = list(model.layers)
    if min_num_params <= 0 or not blocks:
        return [[b] for b in blocks]
    per_block = sum(p.numel() for p in blocks[0].parameters())
    n = max(1, math.ceil(min_num_params / per_block))
    return [blocks[i:i + n] for i in range(0, len(blocks), n)]


# ------------------------------------------------------------------ building and materialising
def build_fsdp_model(source: ModelArgs | str | os.PathLike, mesh, cfg: FSDPConfig, *, head: str = "lm",
                     device: torch.device | str | None = None, trainable: bool = True, seed: int = 0,
                     enable_gradient_checkpointing: bool = False,
                     enable_activation_offload: bool = False, dummy_weights: bool = False,
                     lora: LoRAConfig | None = None, lora_adapter_path: str | os.PathLike | None = None,
                     overrides: dict | None = None) -> Transformer:
    """Build a sharded actor / reference / critic without any rank holding the whole model.

    `source` is either `ModelArgs` (random init, identical on every rank and equal to
    `Transformer.build(args, head, seed=seed)` on CPU, so tests can compare with an unsharded
    model) or a Hugging Face checkpoint directory (each rank reads one tensor at a time from the
    memory-mapped safetensors and keeps only its shard). `device` is the compute device
    (default: the current CUDA device for a CUDA mesh, else CPU); with `offload_policy` the
    shards themselves live on CPU.

    `dummy_weights` (`actor_rollout_ref.model.load_format=dummy`, for benchmarks: speed does
    not depend on the values) reads only the config and draws each rank's local shards where
    they live, from a generator seeded by `seed` and the rank: no full tensor anywhere and no
    checkpoint to write. Models built with the same seed on the same mesh get the same weights
    (the reference equals the initial actor).

    `lora`: inject LoRA adapters (`models.lora.inject_lora`) on the meta model before sharding:
    the base is frozen (and stored in the compute dtype), the adapters start from peft's
    initialisation (A from a generator seeded by `seed`, B zero: the initial policy is the
    base) or from the peft adapter directory `lora_adapter_path`, checked against `lora`.

    `overrides`: verl's `model.override_config`, applied to the model's arguments
    (`models.args.apply_overrides`) before it is built.
    """
    path = None
    if isinstance(source, ModelArgs):
        args = apply_overrides(source, overrides)
    else:
        path = source
        args = load_model_args(path, overrides)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    device = torch.device(device)
    adapter = None
    if lora_adapter_path is not None:
        adapter = read_peft_adapter(lora_adapter_path, args)
        lora = adapter[0] if lora is None else lora  # the adapter's own r, alpha and targets, as peft's loading
    with torch.device("meta"):
        model = Transformer(args, head=head)
    if lora is not None:
        inject_lora(model, lora)
        if adapter is not None:
            check_adapter(model, *adapter, str(lora_adapter_path))
    apply_fsdp(model, mesh, cfg, trainable=trainable, enable_gradient_checkpointing=enable_gradient_checkpointing,
               enable_activation_offload=enable_activation_offload)
    model.to_empty(device="cpu" if cfg.offload_policy else device)
    if dummy_weights:
        _init_local_shards(model, seed)
        if adapter is not None:
            load_full_tensors(model, adapter[1].items(), partial=True)
    else:
        tensors = model.init_tensors(torch.Generator().manual_seed(seed)) if path is None else \
            checkpoint_tensors(model, path)
        if lora is not None:
            adapters = adapter[1].items() if adapter is not None else \
                lora_init_tensors(model, torch.Generator().manual_seed(seed))
            tensors = itertools.chain(tensors, adapters)
        load_full_tensors(model, tensors)
    model.reset_buffers()
    # Buffers are not sharded and are used on the compute device even when the parameter
    # shards live on CPU (offload_policy).
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model


@torch.no_grad()
def _init_local_shards(model: Transformer, seed: int) -> None:
    """normal(0, initializer_range) weights, unit norms, zero biases: `init_tensors`' recipe,
    drawn shard by shard on each rank's own device; LoRA adapters as `lora_init_tensors`
    (A uniform in ±1/√in, B zero), from their own generator so that the base weights are those
    of the same build without LoRA (the reference model).

    A rank's generators are seeded by which shard it holds (its coordinate over the sharded mesh
    dims), not by its rank: the replicas of HYBRID_SHARD and of data parallelism hold the same
    shards and draw the same numbers, so every replica starts from the same model."""
    generators: dict = {}

    def generator(device, shard: int, stream: int) -> torch.Generator:
        if (device, shard, stream) not in generators:
            generators[device, shard, stream] = torch.Generator(device=device).manual_seed(
                seed * 65537 + shard + stream)
        return generators[device, shard, stream]

    def shard_index(p) -> int:
        if not isinstance(p, DTensor):
            return 0  # a whole tensor on every rank (the replicated runtime)
        mesh, coord, index = p.device_mesh, p.device_mesh.get_coordinate(), 0
        for dim, placement in enumerate(p.placements):
            if placement.is_shard():
                index = index * mesh.size(dim) + coord[dim]
        return index

    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        shard = shard_index(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith((".bias", ".lora_B")):
            local.zero_()
        elif name.endswith(".lora_A"):
            # A is sharded by rows: every shard keeps the fan-in (its columns) of the bound.
            bound = p.shape[1] ** -0.5
            local.uniform_(-bound, bound, generator=generator(local.device, shard, 1 << 20))
        else:
            local.normal_(0.0, model.args.initializer_range, generator=generator(local.device, shard, 0))


def local_shard(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of `full` under `param`'s placements (torch.chunk semantics, as FSDP2)."""
    coord = param.device_mesh.get_coordinate()
    t = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(t, param.device_mesh.size(mesh_dim), dim=placement.dim)
            idx = coord[mesh_dim]
            t = chunks[idx] if idx < len(chunks) else t.narrow(placement.dim, 0, 0)
    return t


@torch.no_grad()
def load_full_tensors(model: nn.Module, tensors, partial: bool = False) -> None:
    """Copy `(name, full tensor)` pairs into the local shards of an FSDP model.

    Every parameter must be given exactly once (`partial`: at most once); each full tensor is
    dropped as soon as its shard is copied, so the peak is one full tensor, never the model.
    """
    params = dict(model.named_parameters())
    seen = set()
    for name, full in tensors:
        p = params[name]
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(f"{name!r}: got shape {tuple(full.shape)}, the model has {tuple(p.shape)}")
        if isinstance(p, DTensor):
            p.to_local().copy_(local_shard(full, p))
        else:
            p.copy_(full)
        seen.add(name)
    missing = set(params) - seen
    if missing and not partial:
        raise ValueError(f"no weights given for {sorted(missing)[:8]}")


# ------------------------------------------------------------------ offload between phases
# Offload copies each device storage (a parameter's padded FSDP shard, its gradient, an Adam
# moment) to a host buffer and shrinks the storage to zero bytes, the way FSDP2 itself frees
# unsharded parameters; loading re-grows the storages and copies back. Every tensor object —
# the DTensor parameters, FSDP's internal references to their shards, the optimizer's state —
# stays the same object throughout, so nothing can keep pointing at a stale copy and no
# reference anywhere can keep device memory alive. (Moving with `module.to("cpu")` swaps
# tensor objects instead; on torch 2.11 + CUDA that was measured to leave the fp32 shards
# allocated on the device.) The host buffers are kept and reused by the next offload; on CUDA
# they are pinned, so both copies run asynchronously on the current stream.
_OFFLOAD_ATTR = "_meshppo_offload"


@dataclass
class _Offloaded:
    flats: list[torch.Tensor]  # uint8 views of the device storages (zero bytes while offloaded)
    hosts: list[torch.Tensor]  # host copies, same byte sizes
    device: torch.device
    active: bool


def _flat_storages(tensors) -> list[torch.Tensor]:
    """One flat uint8 tensor over each distinct, non-empty storage behind `tensors`."""
    seen, flats = set(), []
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        flats.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
    return flats


@torch.no_grad()
def _offload(owner, tensors) -> None:
    state: _Offloaded | None = owner.__dict__.get(_OFFLOAD_ATTR)
    if state is not None and state.active:
        return  # already offloaded
    flats = _flat_storages(tensors)
    if not flats:
        return
    device = flats[0].device
    pin = device.type == "cuda"
    hosts = state.hosts if state is not None else []
    if [h.numel() for h in hosts] != [f.numel() for f in flats]:
        hosts = [torch.empty(f.numel(), dtype=torch.uint8, pin_memory=pin) for f in flats]
    for flat, host in zip(flats, hosts):
        host.copy_(flat, non_blocking=pin)
    # Shrinking a storage hands its block back to the caching allocator; later device work is
    # ordered after the copies on this stream, so the block cannot be overwritten before they read it.
    for flat in flats:
        flat.untyped_storage().resize_(0)
    owner.__dict__[_OFFLOAD_ATTR] = _Offloaded(flats, hosts, device, True)
    if pin:
        torch.cuda.empty_cache()


@torch.no_grad()
def _load(owner, device) -> None:
    state: _Offloaded | None = owner.__dict__.get(_OFFLOAD_ATTR)
    if state is None or not state.active:
        return
    if device is not None and torch.device(device).type != state.device.type:
        raise ValueError(f"the offloaded states came from {state.device}; they cannot be loaded onto {device}")
    for flat, host in zip(state.flats, state.hosts):
        flat.untyped_storage().resize_(host.numel())
        flat.copy_(host, non_blocking=state.device.type == "cuda")
    state.active = False


def offloaded_tensors(owner: nn.Module | torch.optim.Optimizer) -> list[torch.Tensor]:
    """The host copies holding `owner`'s offloaded states (empty when nothing is offloaded)."""
    state: _Offloaded | None = owner.__dict__.get(_OFFLOAD_ATTR)
    return list(state.hosts) if state is not None and state.active else []


@contextmanager
def offloaded_states_resident(model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Inside: the states of `model` (and `optimizer`) that are offloaded now are back on their
    device, for whatever reads or writes them in place (a checkpoint's save or load, an export's
    gather: an offloaded tensor's device storage is empty); after: offloaded again, with what was
    written into them. States that were on the device stay there."""
    model_out = bool(offloaded_tensors(model))
    optim_out = optimizer is not None and bool(offloaded_tensors(optimizer))
    if model_out:
        load_fsdp_model_to_device(model)
    if optim_out:
        load_fsdp_optimizer(optimizer)
    try:
        yield
    finally:
        if model_out:
            offload_fsdp_model_to_cpu(model)
        if optim_out:
            offload_fsdp_optimizer(optimizer)


def reshard_all(model: nn.Module) -> None:
    """Register the sharded parameters on every FSDP unit, freeing gathered ones.

    Units that skip resharding after forward (the root, the head, the last block) keep their
    gathered parameters registered after a forward pass; anything that works on the shards
    (offload, the resharder) calls this first.
    """
    rp = replicated_params(model)
    if rp is not None:
        rp.release()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _params_offloaded(model: nn.Module) -> bool:
    """Whether FSDP2 keeps `model`'s sharded parameters in host memory (`offload_policy`): their
    local tensors live off the mesh's device type."""
    p = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return p is not None and p.to_local().device.type != p.device_mesh.device_type


@contextmanager
def keep_compute_copies(model: nn.Module):
    """Forward and backward passes inside share one cast of the masters into compute copies:
    the micro-batches of one mini-batch (or of a forward-only phase), between which the masters
    do not change. No optimizer step (nor anything else that changes the masters) may run inside.
    Shard groups of one rank (`sharding.replicate`): the copies are cast at the first forward and
    freed at the end of the scope, instead of once per forward (a copy of 6 bytes per parameter
    read and written: ~0.6 ms at 0.5b, ~10 ms at 7b on an H200). FSDP2: nothing changes (its
    units gather per forward)."""
    rp = replicated_params(model)
    if rp is None:
        yield
        return
    with rp.kept():
        yield


@contextmanager
def no_gradient_sync(model: nn.Module):
    """Backward passes inside leave the gradients unreduced over the data-parallel replicas;
    the next backward outside reduces everything accumulated (DDP's `no_sync`). For the
    micro-batches of a mini-batch before its last: one reduction per optimizer step instead of
    one per micro-batch. Every rank must run the same number of backward passes inside.

    Shard groups of one rank (`sharding.replicate`): no all-reduce, the gradients add up in the
    gradient buffer. HYBRID_SHARD under FSDP2: each backward still reduce-scatters inside its
    shard group, and the sharded sums wait on the device for the all-reduce over the replicas
    (`set_requires_all_reduce`); with `offload_policy` they would hold device memory the
    offload is there to save, so those units reduce at every backward. FULL_SHARD: nothing to
    defer."""
    rp = replicated_params(model)
    units = [] if _params_offloaded(model) else [m for m in model.modules() if isinstance(m, FSDPModule)]
    if rp is not None:
        rp.sync_gradients = False
    for unit in units:
        unit.set_requires_all_reduce(False, recurse=False)
    try:
        yield
    finally:
        if rp is not None:
            rp.sync_gradients = True
        for unit in units:
            unit.set_requires_all_reduce(True, recurse=False)


def release_gradients(model: nn.Module) -> None:
    """After `optimizer.zero_grad(set_to_none=True)`: give back the gradients' memory.

    FSDP2's gradients are freed with the references the optimizer drops; the runtime of shard
    groups of one rank (`sharding.replicate`) keeps one gradient buffer for the next backward
    and frees it here, so that the phases after an update (the critic's, generation) have it."""
    rp = replicated_params(model)
    if rp is not None:
        rp.release_gradients()


def offload_fsdp_model_to_cpu(model: nn.Module) -> None:
    """Copy the sharded parameters (and gradients, if any) to host memory and free their device memory.

    Call after the last use of the parameters in a phase (after resharding into the engine);
    the model must not run until `load_fsdp_model_to_device`.
    """
    reshard_all(model)
    params = list(model.parameters())
    _offload(model, params + [p.grad for p in params if p.grad is not None])


def load_fsdp_model_to_device(model: nn.Module, device: torch.device | str | None = None) -> None:
    """Inverse of `offload_fsdp_model_to_cpu`: the shards come back into the same tensors."""
    _load(model, device)


def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Copy the optimizer states (Adam moments: 2x the fp32 shard) to host memory and free their device memory.

    Scalar `step` counters stay where they are (on CPU for foreach Adam, on the device for
    fused Adam): they are bytes.
    """
    _offload(optimizer, [v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0])


def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> None:
    """Inverse of `offload_fsdp_optimizer`."""
    _load(optimizer, device)


def offload_states(model: nn.Module, optimizer: torch.optim.Optimizer | None, cfg: FSDPConfig) -> None:
    """Before generation: offload what `cfg.param_offload` / `cfg.optimizer_offload` ask for."""
    if cfg.param_offload:
        offload_fsdp_model_to_cpu(model)
    if cfg.optimizer_offload and optimizer is not None:
        offload_fsdp_optimizer(optimizer)


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer | None, cfg: FSDPConfig, device=None) -> None:
    """Before a training (or forward) phase: bring back what `offload_states` moved."""
    if cfg.param_offload:
        load_fsdp_model_to_device(model, device)
    if cfg.optimizer_offload and optimizer is not None:
        load_fsdp_optimizer(optimizer, device)
