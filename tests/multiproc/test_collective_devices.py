"""Every collective of a trainer run is issued where its tensor's device is known to be right.

NCCL takes CUDA tensors only; a CPU tensor handed to an NCCL collective fails on the GPU and
passes every gloo test (the first two-GPU run crashed this way in its first step). On CPU
the device itself cannot tell the two apart, so this test checks the rule that makes it
right by construction: trainer runs on 2 gloo ranks, covering the configurations with their
own collectives (dynamic batching, the critic and GAE, CPU offload with the gradient norm
over CPU gradients, HYBRID_SHARD, the TP 2 engine, the no-cache reference rollout, KL in
reward, rollout correction in both modes, rollout dumps, Ulysses sequence parallelism), with every `torch.distributed` tensor collective traced. A call is allowed from
PyTorch itself (FSDP2, DTensor), from `sharding/comm.py` (which moves tensors to
`group_device(group)` — checked here too) and from the engine's TP group (`rollout/parallel.py`,
engine tensors only). Any other call site fails with its file and line.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_DIR = os.path.dirname(torch.__file__)
ALLOWED = (os.path.join(ROOT, "sharding", "comm.py"), os.path.join(ROOT, "rollout", "parallel.py"))
TRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
          "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "all_to_all", "gather", "scatter")

CASES = {
    "grpo_dynamic_tp2": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                         "actor_rollout_ref.actor.use_dynamic_bsz=true",
                         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
                         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
                         "algorithm.rollout_correction.rollout_is=token"],
    "gae_offload_policy": ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                           "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
                           "critic.model.fsdp_config.offload_policy=true", "critic.use_dynamic_bsz=true",
                           "critic.ppo_max_token_len_per_gpu=64", "trainer.rollout_data_dir={run}/dumps"],
    "ulysses_gae": ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2",
                    "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32"],
    "hsdp_kl_in_reward_hf": ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "actor_rollout_ref.rollout.name=hf",
                             "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true",
                             "algorithm.adv_estimator=rloo", "algorithm.rollout_correction.bypass_mode=true"],
}


def _trace(calls: list):
    """Wrap torch.distributed's tensor collectives; record (name, caller file:line, tensor device)."""
    from sharding import comm

    for name in TRACED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_traced", False):
            continue

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            caller = sys._getframe(1)
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
            group = kwargs.get("group")
            expected = comm.group_device(group)
            calls.append((_name, f"{caller.f_code.co_filename}:{caller.f_lineno}",
                          [t.device for t in tensors], expected))
            return _fn(*args, **kwargs)

        wrapper._traced = True
        setattr(dist, name, wrapper)


def _body(rank, world_size, assets, run_root):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    calls: list = []
    _trace(calls)
    ctx = init_distributed("cpu")
    for name, overrides in CASES.items():
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run_root}/{name}",
            "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "trainer.test_freq=2",
            "trainer.val_before_train=false", "trainer.save_freq=1", "data.train_batch_size=8",
            "data.val_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "data.max_response_length=6",
            "trainer.export_hf_at_end=true", *(o.format(run=f"{run_root}/{name}") for o in overrides)])
        start = len(calls)
        assert PPOTrainer(cfg, ctx).train() == 0
        assert len(calls) > start, f"{name}: no collective traced"
    bad = [(n, site) for n, site, _, _ in calls
           if not site.startswith(TORCH_DIR) and not site.startswith(ALLOWED)]
    assert not bad, f"rank {rank}: collectives called outside sharding/comm.py: {sorted(set(bad))}"
    wrong = [(n, site, devs, exp) for n, site, devs, exp in calls
             if site.startswith(ALLOWED[0]) and any(d != exp for d in devs)]
    assert not wrong, f"rank {rank}: tensors not on the group's device: {wrong[:5]}"
    own = [c for c in calls if c[1].startswith(ALLOWED)]
    assert own, "no collective went through sharding/comm.py or the engine: the trace is not wired"


def test_trainer_collectives_go_through_comm(tiny_assets, tmp_path):
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def test_tracer_catches_a_direct_collective():
    """The check itself can fail: a direct `dist.all_reduce` from a test file is flagged."""
    run_distributed(_direct_body, 2)


def _direct_body(rank, world_size):
    calls: list = []
    _trace(calls)
    dist.all_reduce(torch.ones(1))
    from sharding import comm

    comm.all_reduce_sum(1.0)
    sites = [site for _, site, _, _ in calls]
    assert sites[0].startswith(__file__), sites
    assert sites[1].startswith(ALLOWED[0]), sites


def test_comm_moves_tensors_to_the_group_device(monkeypatch):
    """`group_device` follows the backend: CUDA for NCCL, CPU otherwise (no process group here)."""
    from sharding import comm

    assert comm.group_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert comm.group_device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm.group_device() == torch.device("cpu")
