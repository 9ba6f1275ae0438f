"""Training-side parallelism: meshes, FSDP2 wrapping, the FSDP → engine resharder, checkpoints.

Call order for the trainer (DESIGN.md §3–§5):

    dims = ParallelDims.from_env(fsdp_size=cfg.fsdp_size, tp=rollout.tensor_model_parallel_size)
    meshes = dims.build_meshes()
    actor = build_fsdp_model(path, meshes.train, actor_fsdp_cfg, trainable=True, ...)
    engine = LLMEngine(args, EngineConfig(...), tp_mesh=meshes.tp, device=device)
    resharder = Resharder(actor, meshes, engine)
    ...each step: resharder.reshard() → generate → train
"""

from sharding.ac import apply_ac
from sharding.checkpoint import gather_full_state_dict, load_checkpoint, save_checkpoint
from sharding.fsdp import (
    FSDPConfig,
    MixedPrecisionConfig,
    apply_fsdp,
    build_fsdp_model,
    fsdp_shard_dim,
    load_fsdp_model_to_device,
    load_fsdp_optimizer,
    load_full_tensors,
    load_states,
    offload_fsdp_model_to_cpu,
    offload_fsdp_optimizer,
    offload_states,
)
from sharding.mesh import ParallelDims, ParallelMeshes
from sharding.resharder import Resharder, ReshardStats

__all__ = [
    "FSDPConfig",
    "MixedPrecisionConfig",
    "ParallelDims",
    "ParallelMeshes",
    "ReshardStats",
    "Resharder",
    "apply_ac",
    "apply_fsdp",
    "build_fsdp_model",
    "fsdp_shard_dim",
    "gather_full_state_dict",
    "load_checkpoint",
    "load_fsdp_model_to_device",
    "load_fsdp_optimizer",
    "load_full_tensors",
    "load_states",
    "offload_fsdp_model_to_cpu",
    "offload_fsdp_optimizer",
    "offload_states",
    "save_checkpoint",
]
