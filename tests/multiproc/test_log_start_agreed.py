"""The run's logs start agreed on every rank. Rank 0 alone rewrites metrics.jsonl, writes config.yaml
and run_info.json, opens TensorBoard and starts the wandb run (`Tracking.begin`): a failure there (a full
disk, a name taken by a directory, wandb refusing to start) raised on rank 0 alone while the other ranks
went on into their next collective and waited there until the collective timeout. Now every rank raises
one UserError at once, rank 0 its cause and the others naming rank 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.dist_utils import run_distributed

OTHERS = "rank 0 could not write the run's logs"


def _trainer(rank, world, run_dir, loggers):
    """A `PPOTrainer` with only what `_begin_logs` reads, at a fresh start."""
    import torch

    from trainer.config import PPOConfig
    from trainer.ppo_trainer import PPOTrainer
    from trainer.tracking import Tracking

    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device, trainer.run_dir, trainer.global_step = PPOConfig(), torch.device("cpu"), run_dir, 0
    trainer.ctx = SimpleNamespace(rank=rank, world_size=world, local_world_size=world, is_main=rank == 0)
    dims = SimpleNamespace(hsdp=False, dp_shard=world, dp_replicate=1, tp=1, rollout_dp=world)
    trainer.models = SimpleNamespace(dims=dims, ulysses_sizes=dict)
    trainer.tracking = Tracking(loggers, run_dir, "p", "e", {}, 10, enabled=rank == 0)
    return trainer


def _both_come_out(world):
    """Every rank left the failed start: they meet in this collective."""
    from sharding import comm

    assert comm.all_reduce_values([1.0], "sum")[0] == world


def _config_yaml_is_a_directory(rank, world, run_dir):
    import os

    from trainer.errors import UserError

    if rank == 0:  # after preflight, which checked the run directory itself
        os.makedirs(os.path.join(run_dir, "config.yaml"))
    trainer = _trainer(rank, world, run_dir, ["console", "jsonl"])
    own = rf"writing {run_dir}/config.yaml failed \(Is a directory\)" if rank == 0 else OTHERS
    with pytest.raises(UserError, match=own):
        trainer._begin_logs()
    _both_come_out(world)


def _wandb_refuses_to_start(rank, world, run_dir):
    from trainer.errors import UserError

    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    if rank == 0:
        wandb.init = refuse
    trainer = _trainer(rank, world, run_dir, ["jsonl", "wandb"])
    own = (r"trainer.logger includes wandb but starting its run failed \(UsageError: api_key not configured"
           if rank == 0 else OTHERS)
    with pytest.raises(UserError, match=own):
        trainer._begin_logs()
    _both_come_out(world)


@pytest.mark.parametrize("body", [_config_yaml_is_a_directory, _wandb_refuses_to_start])
def test_a_failed_start_of_the_logs_on_rank_0_stops_every_rank(tmp_path, body):
    run_distributed(body, 2, str(tmp_path / "run"), timeout=60)
