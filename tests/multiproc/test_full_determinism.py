"""`fsdp_config.full_determinism` on the CPU: the trainer switches its process to torch's
deterministic algorithms (with cuBLAS's fixed workspace for the GPU) before any model is built,
every op of a GRPO step with a KL loss and the engine's generation has a deterministic
implementation (an op without one would raise), and two runs give the same metrics to the bit.
One rank in a process of its own, so the process-wide switch does not reach other tests. The GPU,
where the switch changes kernels, is tested in tests/gpu/test_trainer_gpu.py."""

from __future__ import annotations

import os

from tests.dist_utils import run_distributed
from tests.e2e.conftest import MACHINE_METRICS, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _body(rank, world_size, assets, run_root):
    import torch

    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)  # this process's: the trainer sets it
    ctx = init_distributed("cpu")
    assert not torch.are_deterministic_algorithms_enabled()
    for run in ("a", "b"):
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run_root}/{run}",
            "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "trainer.val_before_train=false",
            "trainer.save_freq=0", "trainer.resume_mode=disable", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.fsdp_config.full_determinism=true",
            "actor_rollout_ref.ref.fsdp_config.full_determinism=true"])
        trainer = PPOTrainer(cfg, ctx)
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert trainer.train() == 0


def test_full_determinism_runs_and_repeats(tiny_assets, tmp_path):
    run_distributed(_body, 1, str(tiny_assets), str(tmp_path), timeout=600)
    a, b = (read_metrics(tmp_path / run) for run in ("a", "b"))
    assert len(a) == len(b) == 2
    for row_a, row_b in zip(a, b):
        kept = [k for k in row_a if not k.startswith(MACHINE_METRICS)]
        assert "actor/grad_norm" in kept and "actor/pg_loss" in kept
        assert {k: row_a[k] for k in kept} == {k: row_b.get(k) for k in kept}
