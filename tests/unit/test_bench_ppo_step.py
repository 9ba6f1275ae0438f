"""bench/ppo_step.py: what a run measures and writes (its `--smoke` mode on CPU), and the one-GPU
baseline its scaling figures are computed against."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO_STEP = os.path.join(ROOT, "bench", "ppo_step.py")


def _smoke(work, *args):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, PPO_STEP, "--smoke", "--workloads", "grpo", "--steps", "2",
                           "--work-dir", str(work), *args], capture_output=True, text=True, timeout=300, env=env)


def test_smoke_run_writes_no_checkpoint_times_the_steps_only_and_takes_the_lengths(tmp_path):
    """The trainer's `train()` writes a checkpoint at its last step whatever `save_freq` says (91 GB
    of weights and Adam states at 7b): the bench drives the steps alone, so nothing is saved and
    no `timing_s/save_checkpoint` enters the measured step's figures."""
    r = _smoke(tmp_path, "--prompt-len", "12", "--response-len", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1 and records[0]["benchmark"] == "ppo_step"
    rec = records[0]
    # --smoke takes the lengths given (it replaced them by 16 and 8): the step ran 12 + 6 tokens a
    # sample, 6 of them generated (EOS ignored), so all tokens / generated tokens is 18 / 6
    assert (rec["workload"]["prompt_len"], rec["workload"]["response_len"]) == (12, 6)
    assert abs(rec["throughput_tok_s_per_gpu"] / rec["response_tok_s_per_gpu"] - 3.0) < 1e-6
    assert rec["steps_measured"] == 1
    assert "timing_s/step" in rec["timing_s"] and "timing_s/update_actor" in rec["timing_s"]
    assert not any("save_checkpoint" in k for k in rec["timing_s"]), rec["timing_s"]
    written = [os.path.relpath(os.path.join(d, name), tmp_path) for d, dirs, _ in os.walk(tmp_path) for name in dirs]
    assert not any("checkpoints" in p or "global_step" in p for p in written), written


def test_overrides_of_the_train_loop_are_refused(capsys):
    """Options only `train()` acts on would be silently ignored by the bench's step loop."""
    import pytest

    from bench.ppo_step import main

    with pytest.raises(SystemExit) as e:
        main(["--smoke", "trainer.save_freq=1", "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "trainer.save_freq=1, trainer.total_training_steps=9: the bench runs" in err, err
