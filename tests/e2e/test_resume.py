"""What a user meets when a run directory already holds a run: resume only the same run (with
a message naming what changed), `resume_mode=disable` starting over, a crafted checkpoint
refused, the per-step sample dumps, and resuming on another world size (torchrun)."""

import json
import math
import os
import pickle
import re
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import (assert_resumed_run_matches, demo_args, read_metrics, torchrun,
                                train_in_ranks)
from tests.unit.test_checkpoint_state import _Payload
from trainer import cli

BATCH = 16
DATA_DIGEST = re.compile(r"[0-9a-f]{32}")  # the data loader's state: the training data's digest
# In-process runs at world size 1 on the untrained tiny model: two steps, a checkpoint at the end.
BASE = ["trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "trainer.test_freq=-1", f"data.train_batch_size={BATCH}", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.rollout.n=4",
        "trainer.export_hf_at_end=false"]
LENGTH_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': float(len(solution_str)), 'has_digit': float(any(c.isdigit() for c in "
                 "solution_str))}\n")


def _full_device() -> bool:
    """/dev/full is the character device whose every write fails with ENOSPC (on some hosts a plain file)."""
    return os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _main(assets, run, capsys, *extra):
    # The untrained model never solves the task: reward the response length, so that scores
    # and advantages are not all zero. (The reward file's path is part of what makes the run.)
    reward = run.parent.parent / "reward.py"
    reward.write_text(LENGTH_REWARD)
    code = cli.main(demo_args(assets, run, *BASE, f"custom_reward_function.path={reward}", *extra))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def two_step_run(tiny_assets, tmp_path_factory):
    """A finished 2-step GRPO run, with validation and sample dumps; tests work on copies."""
    root = tmp_path_factory.mktemp("resume")
    (root / "reward.py").write_text(LENGTH_REWARD)
    code = cli.main(demo_args(tiny_assets, root / "base" / "run", *BASE,
                                    f"custom_reward_function.path={root / 'reward.py'}",
                                    "trainer.val_before_train=true", "trainer.test_freq=2",
                                    # sampled validation: responses of several lengths to score
                                    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                                    f"trainer.rollout_data_dir={root / 'rollouts'}",
                                    f"trainer.validation_data_dir={root / 'validation'}"))
    assert code == 0
    return root


def _copy(two_step_run, name):
    """A copy of the base run next to it (the same reward file)."""
    run = two_step_run / name / "run"
    shutil.copytree(two_step_run / "base" / "run", run)
    return run


def test_a_changed_run_is_refused_and_total_steps_extends(tiny_assets, two_step_run, capsys):
    run = _copy(two_step_run, "changed")
    before = (run / "checkpoints" / "global_step_2" / "trainer_state.json").read_text()
    code, err = _main(tiny_assets, run, capsys, "algorithm.adv_estimator=rloo",
                      "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.total_training_steps=3")
    assert code == 1
    assert "comes from a run with other training settings (actor_rollout_ref.actor.optim.lr: 0.0001 -> 0.001; " \
           "algorithm.adv_estimator: 'grpo' -> 'rloo')" in err
    assert "trainer.default_local_dir" in err and "trainer.resume_mode=disable" in err
    # nothing of the refused run was kept
    assert (run / "checkpoints" / "global_step_2" / "trainer_state.json").read_text() == before
    # validation before step 1, step 2's row and its validation's
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2]
    assert "adv_estimator: grpo" in (run / "config.yaml").read_text()

    # more steps, another logger and smaller micro-batches: the same run, continued
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3", "trainer.logger=[console,jsonl]",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    assert code == 0, err
    assert "resumed from" in err and "(resumed at step 2)" in err
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2, 3]
    # verl's training/global_step and training/epoch on every step (64 prompts: 4 steps an epoch)
    # (the validation's row too)
    assert [(r["training/global_step"], r["training/epoch"]) for r in read_metrics(run)[1:]] == [(1, 0), (2, 0), (2, 0),
                                                                                                  (3, 0)]
    state = json.loads((run / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 0, "position": 3 * BATCH, "size": 64, "order": "draws per epoch: 2",
                               "data": DATA_DIGEST.fullmatch(state["loader"]["data"]).group()}  # and the data's digest


def test_resume_mode_disable_starts_the_directory_over(tiny_assets, two_step_run, capsys):
    run = _copy(two_step_run, "disabled")
    for export in ("hf_actor", "lora_adapter"):  # the earlier run's final exports (this one exports none)
        (run / export).mkdir()
        (run / export / "config.json").write_text("{}")
    code, err = _main(tiny_assets, run, capsys, "algorithm.adv_estimator=rloo", "trainer.resume_mode=disable",
                      "trainer.total_training_steps=1")
    assert code == 0, err
    assert "deleting the earlier run's checkpoints" in err and "(fresh start)" in err
    for export in ("hf_actor", "lora_adapter"):
        assert f"deleting the earlier run's export {run / export}" in err
        assert not (run / export).exists()
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert sorted(os.listdir(run / "checkpoints")) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert "adv_estimator: rloo" in (run / "config.yaml").read_text()
    # and the new run is the one that resumes
    code, err = _main(tiny_assets, run, capsys, "algorithm.adv_estimator=rloo")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    # a second stage trained from the first's export in the same directory keeps it
    shutil.copytree(f"{tiny_assets}/sft_model", run / "hf_actor")
    code, err = _main(tiny_assets, run, capsys, "algorithm.adv_estimator=rloo", "trainer.resume_mode=disable",
                      "trainer.total_training_steps=1", f"actor_rollout_ref.model.path={run / 'hf_actor'}")
    assert code == 0, err
    assert f"keeping the earlier run's export {run / 'hf_actor'}: this run reads it" in err
    assert (run / "hf_actor" / "model.safetensors").is_file()


def test_a_checkpoint_with_a_crafted_pickle_is_refused(tiny_assets, two_step_run, tmp_path, capsys):
    run = _copy(two_step_run, "crafted")
    marker = str(tmp_path / "pwned")
    rng = run / "checkpoints" / "global_step_2" / "rng" / "rank_0.pt"
    torch.save({"python": _Payload(marker)}, rng)
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 1
    assert f"meshppo: error (rank 0): RNG state file '{rng}' was refused" in err and "could run code" in err
    assert not os.path.exists(marker)
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2]
    # the actor's sharded checkpoint: its DCP metadata is a pickle too
    shutil.copy(two_step_run / "base" / "run" / "checkpoints" / "global_step_2" / "rng" / "rank_0.pt", rng)
    actor = run / "checkpoints" / "global_step_2" / "actor"
    (actor / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 1 and "Traceback" not in err
    assert (f"meshppo: error (rank 0): checkpoint '{actor}' holds a pickle (.metadata) that would call posix.mkdir: "
            "refusing to load it") in err
    assert not os.path.exists(marker)
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2]


def test_the_first_step_after_a_resume_trains_at_the_new_schedules_lr(tiny_assets, tmp_path, capsys):
    """A finished 2-step cosine run (lr 1e-4, floor 0.1, no warm-up) extended to 4 steps: the
    schedule stretches, and step 3 trains at its value for update 2 of 4, 1e-4 * (0.1 + 0.9 * (1 +
    cos(pi / 2)) / 2) = 5.5e-5, not at the 2-step schedule's last, 1e-5 (the rate the checkpoint's
    optimizer holds). Without the schedule's state (load_contents) it starts over: 1e-4."""
    cosine = ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
              "actor_rollout_ref.actor.optim.lr_warmup_steps=0"]
    run = tmp_path / "runs" / "run"
    assert _main(tiny_assets, run, capsys, *cosine)[0] == 0
    shutil.copytree(run, tmp_path / "runs" / "fresh_schedule")
    code, err = _main(tiny_assets, run, capsys, *cosine, "trainer.total_training_steps=4")
    assert code == 0, err
    expected = [1e-4 * (0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2) for k in range(4)]
    assert [r["actor/lr"] for r in read_metrics(run)] == pytest.approx(
        [1e-4, 1e-4 * (0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2), expected[2], expected[3]], rel=1e-12)
    run = tmp_path / "runs" / "fresh_schedule"
    code, err = _main(tiny_assets, run, capsys, *cosine, "trainer.total_training_steps=3",
                      "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer]")
    assert code == 0, err
    assert [r["actor/lr"] for r in read_metrics(run)][2] == pytest.approx(1e-4, rel=1e-12)


def test_a_corrupt_checkpoint_file_is_one_line_before_any_state_changes(tiny_assets, two_step_run, capsys):
    """A checkpoint's small JSON files, truncated or missing a field by hand: one line naming the
    file, no traceback, the run directory as it was."""
    run = _copy(two_step_run, "corrupt")
    step = run / "checkpoints" / "global_step_2"
    extra = step / "actor" / "extra.json"
    extra.write_text("{")
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 1 and "Traceback" not in err, err
    assert f"meshppo: error (rank 0): checkpoint file '{extra}' is not readable JSON" in err
    extra.write_text("[]")
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 1 and f"checkpoint file '{extra}' holds a list, not the JSON object meshppo writes" in err, err
    extra.write_text("{}")
    state_file = step / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "world_size"}))
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 1 and "Traceback" not in err, err
    assert f"meshppo: error (rank 0): checkpoint file '{state_file}' is not a meshppo trainer state" in err
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2]
    state_file.write_text(json.dumps(state))
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 2, 3]


def test_a_model_whose_config_does_not_match_its_weights_is_one_line(tiny_assets, tmp_path, capsys):
    """config.json says one layer more than the weights hold (a hand-edited or mixed-up directory):
    an input error naming the checkpoint, exit 1, not a traceback."""
    model = tmp_path / "model"
    shutil.copytree(f"{tiny_assets}/sft_model", model)
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers + 1
    config.pop("layer_types", None)
    (model / "config.json").write_text(json.dumps(config))
    code, err = _main(tiny_assets, tmp_path / "runs" / "run", capsys, f"actor_rollout_ref.model.path={model}")
    assert code == 1 and "Traceback" not in err, err
    assert (f"meshppo: error (rank 0): checkpoint '{model}' lacks tensors: ['layers.{layers}.") in err, err
    assert ("(the model that its config.json, with any override_config, describes is not the one its weights "
            "hold)") in err, err


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_and_validation_dumps_agree_with_the_metrics(two_step_run):
    rows = read_metrics(two_step_run / "base" / "run")
    assert sorted(os.listdir(two_step_run / "rollouts")) == ["1.jsonl", "2.jsonl"]
    assert sorted(os.listdir(two_step_run / "validation")) == ["0.jsonl", "2.jsonl"]
    for step in (1, 2):
        dumped = _lines(two_step_run / "rollouts" / f"{step}.jsonl")
        (metrics,) = [r for r in rows if r["step"] == step and "critic/score/mean" in r]
        assert len(dumped) == BATCH * 4 and {d["step"] for d in dumped} == {step}
        assert {"input", "output", "gts", "score", "reward", "advantage", "has_digit"} <= set(dumped[0])
        assert all(d["score"] == float(len(d["output"])) for d in dumped)  # the length reward
        assert sum(d["score"] for d in dumped) / len(dumped) == pytest.approx(metrics["critic/score/mean"], rel=1e-9)
        # the token-weighted mean of the per-sample advantages is the logged masked mean
        tokens = sum(d["response_length"] for d in dumped)
        adv = sum(d["advantage"] * d["response_length"] for d in dumped) / tokens
        assert adv == pytest.approx(metrics["critic/advantages/mean"], rel=1e-6, abs=1e-9)
        # GRPO: each prompt's advantages are centred on its group
        by_prompt = {}
        for d in dumped:
            by_prompt.setdefault(d["input"], []).append(d["advantage"])
        assert all(abs(sum(a)) < 1e-4 for a in by_prompt.values())
    for step in (0, 2):
        dumped = _lines(two_step_run / "validation" / f"{step}.jsonl")
        (val,) = [r for r in rows if r["step"] == step and "val/meshppo/demo_add/score" in r]
        assert len(dumped) == 16 and {d["data_source"] for d in dumped} == {"meshppo/demo_add"}
        assert all(d["score"] == float(len(d["output"])) for d in dumped)
        assert sum(d["score"] for d in dumped) / 16 == pytest.approx(val["val/meshppo/demo_add/score"], rel=1e-9)
        # one token a character at most (special tokens are not in the text), 6 at most, and 6 when cut
        assert all(len(d["output"]) <= d["response_length"] <= 6 for d in dumped)
        assert all(d["finish_reason"] == "stop" or d["response_length"] == 6 for d in dumped)
        assert {d["finish_reason"] for d in dumped} <= {"stop", "length"}


# ---------------------------------------------------------------------- another world size
WORLD = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
         f"data.train_batch_size={BATCH}", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=4"]


def _weights(run):
    return load_file(str(run / "hf_actor" / "model.safetensors"))


@pytest.mark.parametrize("before,after,then_train", [(4, 2, False), (2, 1, True)])
def test_resume_on_another_world_size(tiny_assets, tmp_path, before, after, then_train):
    run = tmp_path / "run"
    # written by `before` forked ranks; the launches under test are torchrun's on `after` ranks that resume it
    train_in_ranks(demo_args(tiny_assets, run, *WORLD, f"trainer.n_gpus_per_node={before}"), nproc=before)
    saved = _weights(run)
    # Resumed on `after` ranks with nothing left to train, the exported actor is the
    # checkpoint's, bit for bit (DCP reshards the FSDP shards on load).
    r = torchrun(demo_args(tiny_assets, run, *WORLD, f"trainer.n_gpus_per_node={after}"), nproc=after)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"world: {after} rank" in r.stderr and "(resumed at step 2)" in r.stderr
    # both said (they were silent): the RNG states left behind, and that nothing is left to train
    # what the other world size changes, said as it is: not the engine's rollout sampling, but the mini-batches
    (said,) = [line for line in r.stderr.splitlines() if f"written by {before} ranks, resumed on {after}: " in line]
    assert "Python's, NumPy's and torch's global RNG streams" in said
    assert "the engine's rollout sampling (keyed by step and prompt) do not depend on the world size" in said
    assert "but the mini-batches (each rank shuffles its own rows)" in said and "unaffected" not in said
    assert "are done at step 2: nothing to train" in r.stderr
    loaded = _weights(run)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    if not then_train:  # what follows does not depend on the world sizes: once is enough
        return
    # One more step continues the schedule (verl's warm-up from 0: lr x 2/4 at step 3) and the data.
    r = torchrun(demo_args(tiny_assets, run, *WORLD, f"trainer.n_gpus_per_node={after}",
                           "trainer.total_training_steps=3"), nproc=after)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["actor/lr"] for row in rows] == pytest.approx([0.0, 0.25e-3, 0.5e-3], rel=1e-12)
    state = json.loads((run / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 0, "position": 3 * BATCH, "size": 64, "order": "draws per epoch: 2",
                               "data": DATA_DIGEST.fullmatch(state["loader"]["data"]).group()} and state["world_size"] == after


def test_validation_timings_are_named_as_validation(two_step_run):
    """Validation regenerates (reshard, generation): its phases are logged as timing_s/val_*, so on a
    step that validates, timing_s/reshard and the like stay the step's own."""
    rows = read_metrics(two_step_run / "base" / "run")
    val_only, last, last_val = rows[0], rows[-2], rows[-1]
    assert val_only["step"] == 0 and "actor/pg_loss" not in val_only
    timings = {k for k in val_only if k.startswith("timing_s/")}
    assert "timing_s/testing" in timings and "timing_s/val_reshard" in timings, timings
    assert all(k == "timing_s/testing" or k.startswith("timing_s/val_") for k in timings), timings
    # the validating step 2: the step's row has its reshard, its validation's row validation's
    assert last["step"] == last_val["step"] == 2
    assert {"timing_s/reshard", "timing_s/step"} <= set(last) and "timing_s/val_reshard" not in last, sorted(last)
    assert {"timing_s/testing", "timing_s/val_reshard"} <= set(last_val) and "timing_s/step" not in last_val


def test_val_only_validates_the_resumed_checkpoint_and_trains_nothing(tiny_assets, two_step_run, capsys):
    """`trainer.val_only` on a finished run: the real trainer loads the last checkpoint, validates it
    with the run's validation settings and exits 0. The score is the one the run logged when it
    validated the same weights at its last step; no step, checkpoint or dump follows."""
    run = _copy(two_step_run, "val_only")
    before = read_metrics(run)
    checkpoints = sorted(os.listdir(run / "checkpoints"))
    code, err = _main(tiny_assets, run, capsys, "trainer.val_only=true", "trainer.test_freq=2",
                      "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                      "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")
    assert code == 0, err
    assert "trainer.val_only: validated the model of step 2" in err
    rows = read_metrics(run)
    assert rows[:-1] == before and rows[-1]["step"] == 2 and "actor/pg_loss" not in rows[-1]
    score = [k for k in rows[-1] if k.startswith("val/")]
    assert score and all(rows[-1][k] == before[-1][k] for k in score), (rows[-1], before[-1])
    assert sorted(os.listdir(run / "checkpoints")) == checkpoints


def test_a_resume_over_changed_training_data_is_refused(tiny_assets, tmp_path, capsys):
    """The files keep their path but not their rows: the checkpoint's place in the data (a position
    in a shuffled order over its dataset size) fits no other size. Shrunk, the resume once died in
    a traceback after the models had loaded; grown, it went on silently over another order. Each is
    one line naming the checkpoint and data.train_files, with the run directory untouched."""
    data = tmp_path / "train.jsonl"
    rows = (tiny_assets / "train.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(rows[:48]))
    run = tmp_path / "data" / "run"
    same = [f"data.train_files=[{data}]", "trainer.total_training_steps=1"]
    code, err = _main(tiny_assets, run, capsys, *same)
    assert code == 0, err
    step = run / "checkpoints" / "global_step_1"
    before = sorted((p.relative_to(run), p.read_bytes() if p.is_file() else None) for p in run.rglob("*"))
    for kept in (40, 64):
        data.write_text("".join((rows * 2)[:kept]))
        code, err = _main(tiny_assets, run, capsys, f"data.train_files=[{data}]", "trainer.total_training_steps=2")
        assert code == 1
        assert (f"meshppo: error (rank 0): checkpoint '{step}': its run trained on 48 prompts, and data.train_files "
                f"(with the data options) now give {kept}: the training data changed since it was written") in err
        assert "Traceback" not in err
        assert sorted((p.relative_to(run), p.read_bytes() if p.is_file() else None) for p in run.rglob("*")) == before


def test_an_offloaded_critic_and_a_save_before_the_first_actor_update_resume_exactly(tiny_assets, tmp_path, capsys):
    """GAE with the critic's parameters and optimizer states in host memory between its phases,
    and a critic warm-up of 2 steps: the run saved at step 2 and resumed trains step 3 as the run
    that never stopped. Before, the critic's save read its offloaded (empty) device storage and
    crashed the process, and so did its load; and the step-2 checkpoint of the actor, which had not
    stepped yet, held AdamW step counters of 1 (DCP lays out a state by a zero-gradient step), so
    the resumed actor's first update came out smaller (step 3's actor/ppo_kl 0.00023 against 0.00032
    uninterrupted)."""
    common = ["algorithm.adv_estimator=gae", "trainer.critic_warmup=2", "critic.ppo_mini_batch_size=16",
              "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true",
              "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
              "actor_rollout_ref.actor.optim.lr=1e-3"]
    straight, split, saving = (tmp_path / name / "run" for name in ("straight", "split", "saving"))
    code, err = _main(tiny_assets, straight, capsys, *common, "trainer.total_training_steps=3")
    assert code == 0, err
    code, err = _main(tiny_assets, split, capsys, *common)  # BASE: 2 steps, a checkpoint at the end
    assert code == 0, err
    code, err = _main(tiny_assets, split, capsys, *common, "trainer.total_training_steps=3")
    assert code == 0 and "resumed from" in err, err
    assert_resumed_run_matches(straight, split, 3)
    # saving at every step of the warm-up and going on: the live optimizers are as if nothing was saved
    code, err = _main(tiny_assets, saving, capsys, *common, "trainer.total_training_steps=3", "trainer.save_freq=1")
    assert code == 0, err
    assert_resumed_run_matches(straight, saving, 3)


def test_a_signal_writes_the_checkpoint_before_a_validation(tiny_assets, tmp_path, capsys, monkeypatch):
    """SIGTERM / SIGUSR1 in a step that also validates: the checkpoint is written and the run exits
    without the validation (it ran first, outside the grace period, for minutes with a real
    validation set, and could be killed before the checkpoint was written)."""
    from trainer.ppo_trainer import PPOTrainer

    validated = []
    real_validate = PPOTrainer.validate
    monkeypatch.setattr(PPOTrainer, "validate", lambda self: validated.append(self.global_step) or real_validate(self))
    monkeypatch.setattr(PPOTrainer, "_agreed_stop_signal", lambda self: self.global_step == 2)
    run = tmp_path / "signalled" / "run"
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=4", "trainer.test_freq=1",
                      f"data.val_files=[{tiny_assets}/val.jsonl]")
    assert code == 0, err
    assert validated == [1] and "step 2's validation skipped, the checkpoint written first" in err
    assert [row["step"] for row in read_metrics(run)] == [1, 1, 2]  # step 1's row and its validation's
    assert not any(k.startswith("val") for k in read_metrics(run)[2])
    assert os.path.isfile(run / "checkpoints" / "global_step_2" / "trainer_state.json")


def test_a_signal_during_a_validation_and_at_the_last_step(tiny_assets, tmp_path, capsys, monkeypatch):
    """A signal that arrives during a validation is acted on after it (it waited for the next step's
    rollout); one at the last step writes the checkpoint and then runs the last validation (skipped, it
    was lost for good: the resumed run has nothing to train), logged in a row of its own after the step's."""
    from trainer.ppo_trainer import PPOTrainer

    calls = []
    real_validate = PPOTrainer.validate

    def validate(self):
        calls.append((self.global_step, os.path.isdir(run / "checkpoints" / f"global_step_{self.global_step}")))
        return real_validate(self)

    signalled = {1}  # the signal reaches the ranks during step 1's validation
    monkeypatch.setattr(PPOTrainer, "validate", validate)
    monkeypatch.setattr(PPOTrainer, "_agreed_stop_signal", lambda self: bool(calls) and calls[-1][0] in signalled)
    run = tmp_path / "during" / "run"
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=3", "trainer.test_freq=1",
                      f"data.val_files=[{tiny_assets}/val.jsonl]")
    assert code == 0, err
    rows = read_metrics(run)  # the step's row, then its validation's, whose checkpoint time is in it
    assert calls == [(1, False)] and [row["step"] for row in rows] == [1, 1]
    assert any(k.startswith("val") for k in rows[1]) and rows[1]["timing_s/save_checkpoint"] > 0
    assert os.path.isfile(run / "checkpoints" / "global_step_1" / "trainer_state.json")
    # at the last step (2): the checkpoint first, then the validation, logged at that step
    calls.clear()
    monkeypatch.setattr(PPOTrainer, "_agreed_stop_signal", lambda self: self.global_step == 2)
    run = tmp_path / "last" / "run"
    code, err = _main(tiny_assets, run, capsys, "trainer.total_training_steps=2", "trainer.test_freq=1",
                      f"data.val_files=[{tiny_assets}/val.jsonl]")
    assert code == 0, err
    assert calls == [(1, False), (2, True)]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 1, 2, 2] and any(k.startswith("val") for k in rows[3])
    assert "actor/pg_loss" in rows[2] and rows[2]["timing_s/save_checkpoint"] > 0


@pytest.mark.skipif(not _full_device(), reason="needs /dev/full, the full-disk device (Linux)")
def test_a_full_disk_under_the_metrics_keeps_the_checkpoint_and_says_one_line(tiny_assets, tmp_path, capsys):
    """The metrics row was written before the step's checkpoint, and its OSError was a traceback: a full
    disk at step 1 left no checkpoint. The checkpoint is now written first, and the error is one line
    naming the file."""
    run = tmp_path / "full" / "run"
    run.mkdir(parents=True)
    os.symlink("/dev/full", run / "metrics.jsonl")
    code, err = _main(tiny_assets, run, capsys, "trainer.save_freq=1", "trainer.logger=[jsonl]")
    assert code == 1 and "Traceback" not in err, err
    assert f"meshppo: error (rank 0): writing {run}/metrics.jsonl failed (No space left on device)" in err
    assert os.path.isfile(run / "checkpoints" / "global_step_1" / "trainer_state.json")


@pytest.mark.parametrize("fault,resumed_at", [("crash_after_publish", 2), ("crash_before_publish", 1)])
def test_a_kill_around_a_checkpoint_keeps_every_steps_row_once(tiny_assets, tmp_path, fault, resumed_at):
    """The process dies right after step 2's checkpoint is put in place, or right before: the resumed
    run's metrics.jsonl and TensorBoard hold steps 1 to 3 once each. The row was written after the
    checkpoint was in place, so a kill in between lost step 2's row for good (the resumed run starts
    at step 3)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    args = demo_args(tiny_assets, run, *BASE, f"custom_reward_function.path={reward}", "trainer.total_training_steps=3",
                     "trainer.save_freq=1", "trainer.logger=[jsonl,tensorboard]")
    env = {"TENSORBOARD_DIR": ""}  # (the run directory's tensorboard/)
    r = torchrun(args, nproc=1, env_extra={**env, "MESHPPO_FAULTS": f"{fault}@2"})
    assert r.returncode != 0
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(resumed_at)
    r = torchrun(args, nproc=1, env_extra=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"(resumed at step {resumed_at})" in r.stderr
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["training/global_step"] for row in rows] == [1, 2, 3]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("training/global_step")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
