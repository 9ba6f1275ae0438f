"""The trainer shuffles its prompts in the order verl's loader takes them: `data.dataloader_num_workers`
above 0 (verl's default 8) draws the sampler's permutation twice an epoch (torchdata's multi-process
iterator starts the sampler twice and keeps the second), 0 once. Built on the demo's tiny assets, one rank
(the trainer needs a process group)."""

from __future__ import annotations

import os

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _body(rank, world_size, assets, run_root):
    import torch

    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    for workers, draws in ((0, 1), (2, 2)):
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]", "data.seed=3",
            f"data.dataloader_num_workers={workers}", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"actor_rollout_ref.model.path={assets}/sft_model",
            f"trainer.default_local_dir={run_root}/{workers}", "trainer.logger=[jsonl]", "trainer.save_freq=0",
            "trainer.resume_mode=disable", "trainer.n_gpus_per_node=1"])
        trainer = PPOTrainer(cfg, ctx)
        n = len(trainer.train_ds)
        generator = torch.Generator().manual_seed(3)
        perms = [torch.randperm(n, generator=generator).tolist() for _ in range(2 * draws)]
        first = [item["input_ids"] for item in trainer.loader.next_batch()]
        assert first == [trainer.train_ds[i]["input_ids"] for i in perms[draws - 1][:8]], workers
        state = trainer.loader.state_dict()
        assert state["order"] == f"draws per epoch: {draws}"
        trainer.loader.load_state_dict({**state, "epoch": 1, "position": 0})  # the next epoch's first batch
        second = [item["input_ids"] for item in trainer.loader.next_batch()]
        assert second == [trainer.train_ds[i]["input_ids"] for i in perms[2 * draws - 1][:8]], workers


def test_the_prompt_order_follows_dataloader_num_workers_as_verls_loader(tiny_assets, tmp_path):
    run_distributed(_body, 1, str(tiny_assets), str(tmp_path), timeout=600)
