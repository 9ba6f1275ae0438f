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


def _record(world_size=1, **changes):
    workload = {"model": "qwen2.5-0.5b", "workload": "grpo", "prompts": 32 * world_size, "n": 8, "prompt_len": 128,
                "response_len": 256, "smoke": False, "world_size": world_size, "overrides": ["a.b=1"], **changes}
    return {"benchmark": "ppo_step", "workload": workload, "timing_s": {"timing_s/step": 1.0}}


def test_the_baseline_is_the_one_gpu_record_of_the_whole_workload():
    """It was matched on (model, workload) alone: a baseline of other lengths, samples or overrides
    gave speed-ups of one configuration against another, and a missing one gave `scaling: null`."""
    import pytest

    from bench.ppo_step import baseline_record

    one = _record()
    records = [_record(world_size=2), _record(prompt_len=64), one]
    run = _record(world_size=2)["workload"]
    assert baseline_record(records, {**run, "prompts": 32}, 1) is one  # strong: the same global batch
    assert baseline_record(records, run, 2) is one  # weak: N times the one-GPU batch
    for change, named in (({"prompt_len": 512}, "prompt_len 128"), ({"response_len": 64}, "response_len 256"),
                          ({"n": 4}, "n 8"), ({"overrides": ["a.b=2"]}, "overrides ['a.b=1']"),
                          ({"smoke": True}, "smoke False")):
        with pytest.raises(ValueError, match="differ in") as e:
            baseline_record([one], {**run, **change}, 2)
        assert named in str(e.value), (change, str(e.value))
    with pytest.raises(ValueError, match="differ in: prompts 32"):
        baseline_record([one], run, 1)  # a weak run's batch against a strong baseline
    with pytest.raises(ValueError, match="no ppo_step record of model qwen2.5-1.5b, workload grpo"):
        baseline_record([one], {**run, "model": "qwen2.5-1.5b"}, 2)


def test_a_baseline_without_the_workload_is_refused_before_any_work(tmp_path, capsys):
    import pytest
    import torch.distributed as dist

    from bench.ppo_step import main

    baseline = tmp_path / "one.jsonl"
    baseline.write_text(json.dumps(_record(model="qwen2.5-0.5b", prompts=2, smoke=True, prompt_len=16,
                                           response_len=8, overrides=[])) + "\n")
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as e:
        main(["--smoke", "--workloads", "grpo", "--work-dir", str(work), "--baseline", str(baseline),
              "--response-len", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--baseline {baseline}: no record of qwen2.5-0.5b grpo" in err, err
    assert "differ in: response_len 8" in err
    assert list(work.iterdir()) == []  # no model, prompts or run written
    # nor the process group it made left behind: a later test of this process that makes one would fail
    assert not dist.is_initialized()
