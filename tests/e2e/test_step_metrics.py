"""A tiny GAE run's steps, in process on CPU: which steps update the actor (`trainer.critic_warmup`)
and verl's memory figures, under its default trainer's names, in every step's row."""

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


def _peak_rss_gib() -> float:
    """This process's peak resident memory so far (VmHWM, kB, what `ru_maxrss` reads) in GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


@pytest.fixture(scope="module")
def warmup_run(tiny_assets, tmp_path_factory):
    """`trainer.critic_warmup=2` over 3 steps: the steps at which the actor and the critic updated, and
    the run's rows."""
    root = tmp_path_factory.mktemp("warmup")
    updated = {"actor": [], "critic": []}
    peak_before = _peak_rss_gib() if os.path.isfile("/proc/self/status") else None
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
    updated["peak_rss_gib"] = (peak_before, _peak_rss_gib() if peak_before is not None else None)
    return updated, read_metrics(root / "run")


def test_critic_warmup_skips_exactly_that_many_actor_updates(warmup_run):
    """critic_warmup=2: steps 1 and 2 train only the critic, the actor first updates at step 3 (verl
    0.9.1's code, `critic_warmup <= global_steps` with steps from 1, would update it at step 2 already)."""
    updated, rows = warmup_run
    assert updated["actor"] == [3] and updated["critic"] == [1, 2, 3]
    assert updated["peak_rss_gib"]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert ["timing_s/update_actor" in row for row in rows] == [False, False, True]
    assert all("critic/vf_loss" in row for row in rows)


def test_every_step_logs_verls_host_memory_in_use(warmup_run):
    """verl 0.9.1's default trainer's actor/perf/cpu_memory_used_gb, the machine's memory in use in GiB:
    above nothing, below its total."""
    if not os.path.isfile("/proc/meminfo"):
        pytest.skip("needs /proc/meminfo (Linux) for the machine's total")
    _, rows = warmup_run
    total = _mem_total_gib()
    for row in rows:
        assert 0 < row["actor/perf/cpu_memory_used_gb"] < total, (row["actor/perf/cpu_memory_used_gb"], total)


def test_every_step_logs_the_memory_peak_under_verls_name(warmup_run):
    """verl 0.9.1's default trainer logs its actor worker's peak as actor/perf/max_memory_allocated_gb
    (GiB): on the CPU the process's peak resident memory, which never falls, between this process's
    peak before the run and after it. The figures sit under that name alone: no perf/ copy, and no
    critic/perf/ one (the critic lives in the same process)."""
    if not os.path.isfile("/proc/self/status"):
        pytest.skip("needs /proc/self/status (Linux) for the process's peak")
    updated, rows = warmup_run
    before, after = updated["peak_rss_gib"]
    peaks = [row["actor/perf/max_memory_allocated_gb"] for row in rows]
    assert before <= peaks[0] and peaks == sorted(peaks) and peaks[-1] <= after, (before, peaks, after)
    for row in rows:
        assert not [k for k in row if k.startswith(("perf/max_memory", "perf/cpu_memory", "critic/perf/"))], row


def test_every_step_logs_verls_trajectory_versions(warmup_run):
    """verl 0.9.1's default trainer's training/off_policy/* in every step's row: each response generated
    with one weight version (spans 1), the one the step trains from (staleness 0, worst 0)."""
    _, rows = warmup_run
    want = {f"training/off_policy/{name}/{s}": v
            for name, v in (("trajectory_spans", 1.0), ("trajectory_staleness", 0.0), ("trajectory_staleness_worst", 0.0))
            for s in ("mean", "max", "min")}
    for row in rows:
        assert {k: row.get(k) for k in want} == want, row
