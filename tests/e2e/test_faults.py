"""Faults under torchrun (2 CPU ranks): a killed rank, preemption, a crash inside a checkpoint
write, a NaN gradient. Faults are injected with MESHPPO_FAULTS (trainer/faults.py)."""

import os

import pytest

from tests.e2e.conftest import assert_same_metrics, demo_args, read_metrics, torchrun, train_in_ranks

COMMON = ["trainer.total_training_steps=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.export_hf_at_end=false",
          "actor_rollout_ref.rollout.n=4",
          # a state that moves inside the step, before the abandon check: an abandoned step must rewind it
          "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01"]


# A reward function that draws from Python's global RNG (as a sampled judge or a noisy tool may): a resumed
# run matches the straight one only if every RNG resumes where the straight run's was.
NOISY_REWARD = '''
import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth)) + 0.5 * random.random()
'''


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    """COMMON with the noisy reward function."""
    path = tmp_path_factory.mktemp("reward") / "noisy.py"
    path.write_text(NOISY_REWARD)
    return [*COMMON, f"custom_reward_function.path={path}"]


@pytest.fixture(scope="module")
def reference_run(tiny_assets, tmp_path_factory, common):
    """The run without a fault, which the faulted launches must reproduce (in forked ranks: it is no launch's test)."""
    run = tmp_path_factory.mktemp("faults") / "straight"
    train_in_ranks(demo_args(tiny_assets, run, *common))
    return read_metrics(run)


def test_sigkill_of_a_rank_restarts_and_matches(tiny_assets, tmp_path, reference_run, common):
    run = tmp_path / "killed"
    r = torchrun(demo_args(tiny_assets, run, *common, "trainer.save_freq=1"), extra_torchrun=["--max-restarts=1"],
                 env_extra={"MESHPPO_FAULTS": "sigkill@3:1"})
    assert r.returncode == 0, r.stderr[-4000:]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert_same_metrics(rows[-1], reference_run[-1])


@pytest.mark.parametrize("grace,saved_step,save_freq", [(120.0, 2, -1), (0.0, 1, -1), (0.0, 1, 1)])
def test_sigterm_checkpoints_exits_zero_and_resumes(tiny_assets, tmp_path, reference_run, common, grace,
                                                    saved_step, save_freq):
    """SIGTERM during step 2: with time to spare the step finishes (checkpoint 2); with a zero
    grace period it is abandoned before any update (checkpoint 1: written then, or with
    save_freq=1 already there and not written again) and redone after resume, the adaptive KL
    coefficient as in the straight run."""
    run = tmp_path / "preempted"
    r = torchrun(demo_args(tiny_assets, run, *common, f"trainer.preemption_grace_s={grace}",
                           f"trainer.save_freq={save_freq}"),
                 env_extra={"MESHPPO_FAULTS": "sigterm@2:0"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert os.path.isfile(run / "checkpoints" / f"global_step_{saved_step}" / "trainer_state.json")
    assert [row["step"] for row in read_metrics(run)] == list(range(1, saved_step + 1))
    r = torchrun(demo_args(tiny_assets, run, *common))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, reference_run):
        assert_same_metrics(a, b)


def test_crash_inside_checkpoint_write_keeps_previous(tiny_assets, tmp_path, common):
    run = tmp_path / "crash"
    r = torchrun(demo_args(tiny_assets, run, *common, "trainer.save_freq=2"),
                 env_extra={"MESHPPO_FAULTS": "crash_in_save@4"})
    assert r.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpts / "global_step_4").exists()
    # the previous checkpoint loads: a fresh launch resumes from step 2 and finishes
    r = torchrun(demo_args(tiny_assets, run, *common, "trainer.save_freq=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr and "global_step_2" in r.stderr
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not (ckpts / "global_step_4.tmp").exists()
    # steps 3 and 4 were logged before the crash and again after the resume: each is kept once
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3, 4]


def test_nan_gradient_skips_the_step_everywhere(tiny_assets, tmp_path, common):
    run = tmp_path / "nan"
    r = torchrun(demo_args(tiny_assets, run, *common), env_extra={"MESHPPO_FAULTS": "nan_grad@2:0"})
    assert r.returncode == 0, r.stderr[-4000:]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # both mini-batches of step 2 skipped (NaN norm seen by every rank); the others stepped
    assert rows[1]["actor/nonfinite_skipped"] == 2.0
    assert all(row["actor/nonfinite_skipped"] == 0.0 for i, row in enumerate(rows) if i != 1)
    # grad_norm of step 2 is reported as non-finite (null in JSON)
    assert rows[1]["actor/grad_norm"] is None or rows[1]["actor/grad_norm"] != rows[1]["actor/grad_norm"]
