"""A tiny GAE run's steps, in process on CPU: verl's host-memory figure in every step's row."""

import os

import pytest

from tests.e2e.conftest import demo_args, read_metrics
from trainer import cli

STEPS = 3
WARMUP = 2


def _mem_total_gib() -> float:
    """The machine's memory from /proc/meminfo (kB), apart from psutil, which the trainer reads."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib / 2**20


@pytest.fixture(scope="module")
def warmup_run(tiny_assets, tmp_path_factory):
    """`trainer.critic_warmup=2` over 3 steps: the run's rows."""
    root = tmp_path_factory.mktemp("warmup")
    code = cli.main(demo_args(tiny_assets, root / "run", "trainer.n_gpus_per_node=1",
                              f"trainer.total_training_steps={STEPS}", f"trainer.critic_warmup={WARMUP}",
                              "trainer.val_before_train=false", "trainer.test_freq=-1",
                              "trainer.export_hf_at_end=false", "algorithm.adv_estimator=gae",
                              "data.train_batch_size=16", "actor_rollout_ref.rollout.n=1",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                              "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=16"))
    assert code == 0
    return None, read_metrics(root / "run")


def test_every_step_logs_verls_host_memory_in_use(warmup_run):
    """verl's perf/cpu_memory_used_gb, the machine's memory in use in GiB: above nothing, below its total."""
    if not os.path.isfile("/proc/meminfo"):
        pytest.skip("needs /proc/meminfo (Linux) for the machine's total")
    _, rows = warmup_run
    total = _mem_total_gib()
    for row in rows:
        assert 0 < row["perf/cpu_memory_used_gb"] < total, (row["perf/cpu_memory_used_gb"], total)
