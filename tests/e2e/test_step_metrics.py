"""A tiny GAE run's steps, in process on CPU: which steps update the actor (`trainer.critic_warmup`)
and verl's host-memory figure in every step's row."""

import os

import pytest

from tests.e2e.conftest import demo_args, read_metrics
from trainer import cli, roles

STEPS = 3
WARMUP = 2


def _mem_total_gib() -> float:
    """The machine's memory from /proc/meminfo (kB), apart from psutil, which the trainer reads."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib / 2**20


@pytest.fixture(scope="module")
def warmup_run(tiny_assets, tmp_path_factory):
    """`trainer.critic_warmup=2` over 3 steps: the steps at which the actor and the critic updated, and
    the run's rows."""
    root = tmp_path_factory.mktemp("warmup")
    updated = {"actor": [], "critic": []}
    real_actor, real_critic = roles.Actor.update, roles.Critic.update

    def actor_update(self, ro, cfg, num_mini_batches, kl_loss_coef, seed, step=-1, **kw):
        updated["actor"].append(step)
        return real_actor(self, ro, cfg, num_mini_batches, kl_loss_coef, seed, step, **kw)

    def critic_update(self, *args, **kw):
        updated["critic"].append(len(updated["critic"]) + 1)
        return real_critic(self, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(roles.Actor, "update", actor_update)
        mp.setattr(roles.Critic, "update", critic_update)
        code = cli.main(demo_args(tiny_assets, root / "run", "trainer.n_gpus_per_node=1",
                                  f"trainer.total_training_steps={STEPS}", f"trainer.critic_warmup={WARMUP}",
                                  "trainer.val_before_train=false", "trainer.test_freq=-1",
                                  "trainer.export_hf_at_end=false", "algorithm.adv_estimator=gae",
                                  "data.train_batch_size=16", "actor_rollout_ref.rollout.n=1",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                  "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=16"))
    assert code == 0
    return updated, read_metrics(root / "run")


def test_critic_warmup_skips_exactly_that_many_actor_updates(warmup_run):
    """critic_warmup=2: steps 1 and 2 train only the critic, the actor first updates at step 3 (verl
    0.9.1's code, `critic_warmup <= global_steps` with steps from 1, would update it at step 2 already)."""
    updated, rows = warmup_run
    assert updated["actor"] == [3] and updated["critic"] == [1, 2, 3]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert ["timing_s/update_actor" in row for row in rows] == [False, False, True]
    assert all("critic/vf_loss" in row for row in rows)


def test_every_step_logs_verls_host_memory_in_use(warmup_run):
    """verl's perf/cpu_memory_used_gb, the machine's memory in use in GiB: above nothing, below its total."""
    if not os.path.isfile("/proc/meminfo"):
        pytest.skip("needs /proc/meminfo (Linux) for the machine's total")
    _, rows = warmup_run
    total = _mem_total_gib()
    for row in rows:
        assert 0 < row["perf/cpu_memory_used_gb"] < total, (row["perf/cpu_memory_used_gb"], total)
