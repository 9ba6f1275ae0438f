"""Training-side parallelism: meshes, FSDP2 wrapping, the FSDP → engine resharder, checkpoints.

The trainer's order (every call is collective unless noted; docs/ARCHITECTURE.md):

    dims = ParallelDims.from_env(fsdp_size=actor.fsdp_config.fsdp_size,
                                 tp=rollout.tensor_model_parallel_size)           # validates sizes
    meshes = dims.build_meshes()                                                  # train / gen / micro-DP
    actor = build_fsdp_model(path, meshes.train, actor.fsdp_config, trainable=True,
                             enable_gradient_checkpointing=..., enable_activation_offload=...)
    ref = build_fsdp_model(path, meshes.train, ref.fsdp_config, trainable=False)
    critic = build_fsdp_model(critic_path, meshes.train, critic.fsdp_config, head="value")
    optimizers on actor.parameters() / critic.parameters()
    engine = LLMEngine(args, EngineConfig(...), tp_mesh=meshes.tp)
    resharder = Resharder(actor, meshes, engine)
    (load_checkpoint(dir, actor, actor_optim) to resume)

    each step:
      resharder.reshard()                                  # FSDP shards → engine weights
      offload_states(actor, actor_optim, actor_cfg)        # param_offload / optimizer_offload
      engine.generate(prompts for rollout_dp_rank)         # then engine.free_cache() per config
      load_states(actor, actor_optim, actor_cfg, device)   # back for log-probs and the update
      ...forward / backward / optimizer steps on actor, ref, critic...
      save_checkpoint(dir, actor, actor_optim, extra=...)  # every save_freq steps
    export: sd = gather_full_state_dict(actor); rank 0: actor.save_pretrained(path, state_dict=sd)

A LoRA actor (`models.lora`) changes four calls and drops the reference model:

    actor = build_fsdp_model(path, meshes.train, actor.fsdp_config, lora=LoRAConfig(rank, alpha, target_modules),
                             lora_adapter_path=None or a peft adapter directory, ...)
    optimizer on models.lora.trainable_parameters(actor)                # the adapters only
    ref log-probs: with torch.no_grad(), adapters_disabled(actor): actor(...)
    save_checkpoint / load_checkpoint as above: they hold the trainable parameters only
    Resharder(actor, meshes, engine) as above: adapted slots get base + scaling·B@A
    export: sd = gather_full_state_dict(actor, trainable_only=True); rank 0: save_peft_adapter(path, sd, cfg, base, model_type=...)
            merged: sd = gather_full_state_dict(actor); rank 0:
                    actor.save_pretrained(path, state_dict=merged_state_dict(sd, cfg.scaling))
"""

from models.lazy import lazy_exports

_EXPORTS = {
    "sharding.ac": ("apply_ac",),
    "sharding.checkpoint": ("gather_full_state_dict", "load_checkpoint", "save_checkpoint"),
    "sharding.fsdp_config": ("FSDPConfig", "MixedPrecisionConfig"),
    "sharding.fsdp": (
        "apply_fsdp", "build_fsdp_model", "fsdp_shard_dim",
        "keep_compute_copies", "load_fsdp_model_to_device", "load_fsdp_optimizer", "load_full_tensors", "load_states",
        "no_gradient_sync", "offload_fsdp_model_to_cpu", "offload_fsdp_optimizer", "offload_states",
        "offloaded_tensors", "release_gradients", "reshard_all",
    ),
    "sharding.mesh": ("ParallelDims", "ParallelMeshes"),
    "sharding.resharder": ("Resharder", "ReshardStats"),
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
