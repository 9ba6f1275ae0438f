"""trainer.checkpointing without a trainer: which options make "the same run", and trainer
state that cannot run code (JSON, and RNG files loaded with weights_only)."""

import dataclasses
import json
import os
import random
import re
import time

import numpy as np
import pytest
import torch

from trainer.checkpointing import (
    LATEST,
    NOT_SAME_RUN_OPTIONS,
    STATE_FILE,
    CheckpointManager,
    SAME_RUN_OPTIONS,
    _rng_state,
    _set_rng_state,
    read_rng_state,
    read_trainer_state,
    run_differences,
    same_run_keys,
)
from trainer.config import PPOConfig
from trainer.configlib import iter_options
from trainer.errors import UserError

ALL_KEYS = [key for key, *_ in iter_options(PPOConfig)]


def test_every_listed_option_exists():
    # a misspelt entry would silently leave an option out of (or in) the check
    for prefix in SAME_RUN_OPTIONS + NOT_SAME_RUN_OPTIONS:
        assert any(k == prefix or k.startswith(prefix + ".") for k in ALL_KEYS), prefix


def test_what_makes_the_same_run():
    keys = {k for k, _ in same_run_keys()}
    # what the issue names: model, data, algorithm and KL settings, batch sizes, n, learning rate
    for k in ("actor_rollout_ref.model.path", "data.train_files", "data.max_response_length", "data.seed",
              "data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n",
              "actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "algorithm.adv_estimator", "algorithm.gamma",
              "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef", "actor_rollout_ref.actor.use_kl_loss",
              "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.clip_ratio",
              "actor_rollout_ref.rollout.temperature", "custom_reward_function.path", "reward_model.model.path",
              "reward_model.model.input_tokenizer", "reward_model.max_length",
              "trainer.seed",
              # inside the execution-only fsdp_config: the master weights' dtype (fp32 -> bf16 rounds them)
              "actor_rollout_ref.actor.fsdp_config.model_dtype", "critic.model.fsdp_config.model_dtype"):
        assert k in keys, k
    # how long, where, how it executes, what is logged: free to change on resume
    for k in ("trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
              "trainer.logger", "trainer.default_local_dir", "trainer.resume_mode", "trainer.n_gpus_per_node",
              "trainer.rollout_data_dir", "trainer.validation_data_dir", "data.val_files",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz",
              "actor_rollout_ref.actor.use_prefix_grouper",  # the same log-probs and gradients, laid out otherwise
              "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.fsdp_size",
              "actor_rollout_ref.actor.optim.total_training_steps", "actor_rollout_ref.rollout.tensor_model_parallel_size",
              "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.val_kwargs.temperature",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
              "actor_rollout_ref.rollout.prompt_length",  # only the default of max_model_len
              "actor_rollout_ref.actor.checkpoint.save_contents", "actor_rollout_ref.actor.checkpoint.load_contents",
              "critic.checkpoint.save_contents", "critic.checkpoint.load_contents",
              # how a model's tokens are spread over ranks (Ulysses): the same computation
              "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size",
              "reward_model.ulysses_sequence_parallel_size", "critic.model.fsdp_config.ulysses_sequence_parallel_size",
              # options that change nothing (opt no_effect=), inside sections that must match
              "actor_rollout_ref.actor.entropy_checkpointing", "actor_rollout_ref.actor.entropy_from_logits_with_chunking",
              "reward_model.num_workers", "reward_model.rollout", "reward_model.model.use_shm",
              # what is profiled
              "actor_rollout_ref.actor.profiler.enable", "critic.profiler.ranks", "reward_model.profiler.enable",
              "global_profiler.steps"):
        assert k in ALL_KEYS and k not in keys, k


def test_the_master_weights_dtype_differs_by_what_it_is_not_its_spelling():
    saved, current = PPOConfig(), PPOConfig()
    saved.actor_rollout_ref.actor.fsdp_config.model_dtype = "fp32"
    current.actor_rollout_ref.actor.fsdp_config.model_dtype = "float32"
    assert run_differences(dataclasses.asdict(saved), dataclasses.asdict(current)) == []
    current.actor_rollout_ref.actor.fsdp_config.model_dtype = "bf16"
    current.critic.model.fsdp_config.model_dtype = "bfloat16"
    assert run_differences(dataclasses.asdict(saved), dataclasses.asdict(current)) == [
        ("actor_rollout_ref.actor.fsdp_config.model_dtype", "fp32", "bf16"),
        ("critic.model.fsdp_config.model_dtype", "fp32", "bfloat16")]


def test_run_differences_lists_changed_training_options_only():
    saved = PPOConfig()
    current = PPOConfig()
    current.algorithm.adv_estimator = "rloo"
    current.actor_rollout_ref.actor.optim.lr = 1e-4
    current.trainer.total_training_steps = 100  # extends the run
    current.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4  # execution only
    diffs = run_differences(dataclasses.asdict(saved), dataclasses.asdict(current))
    assert diffs == [("actor_rollout_ref.actor.optim.lr", 1e-6, 1e-4), ("algorithm.adv_estimator", "gae", "rloo")]
    assert run_differences(dataclasses.asdict(current), dataclasses.asdict(current)) == []
    # an option the checkpoint predates ran at its default
    old = dataclasses.asdict(saved)
    del old["algorithm"]["norm_adv_by_std_in_grpo"]
    assert run_differences(old, dataclasses.asdict(saved)) == []
    current = PPOConfig()
    current.algorithm.norm_adv_by_std_in_grpo = False
    assert run_differences(old, dataclasses.asdict(current)) == [("algorithm.norm_adv_by_std_in_grpo", True, False)]
    # how prompts and turns read is training (a chat template change was accepted); remove-padding and
    # which pass reports the entropy only execute or report (they were refused)
    current = PPOConfig()
    current.actor_rollout_ref.model.custom_chat_template = "{{ messages }}"
    current.actor_rollout_ref.rollout.multi_turn.max_assistant_turns = 3
    current.actor_rollout_ref.actor.use_remove_padding = not saved.actor_rollout_ref.actor.use_remove_padding
    current.actor_rollout_ref.actor.calculate_entropy = not saved.actor_rollout_ref.actor.calculate_entropy
    assert run_differences(dataclasses.asdict(saved), dataclasses.asdict(current)) == [
        ("actor_rollout_ref.model.custom_chat_template", None, "{{ messages }}"),
        ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", None, 3)]


def test_a_checkpoint_from_before_lr_scheduler_type_ran_with_its_warmup_style():
    old = dataclasses.asdict(PPOConfig())
    for section in (old["actor_rollout_ref"]["actor"], old["critic"]):
        del section["optim"]["lr_scheduler_type"]
        section["optim"]["warmup_style"] = "cosine"
    current = PPOConfig()
    for section in (current.actor_rollout_ref.actor, current.critic):
        section.optim.lr_scheduler_type = "cosine"
    assert run_differences(old, dataclasses.asdict(current)) == []
    assert run_differences(old, dataclasses.asdict(PPOConfig())) == [
        ("actor_rollout_ref.actor.optim.lr_scheduler_type", "cosine", "constant"),
        ("critic.optim.lr_scheduler_type", "cosine", "constant")]



def test_a_checkpoint_from_before_the_reward_model_section_ran_with_the_actors_token_ids():
    """Before `reward_model.model` (verl's layout) the path was `reward_model.path` and the reward
    model read the actor's token ids: such a checkpoint resumes under input_tokenizer=null and the
    same path, and a run now at verl's default (its own chat rendering) is told what changed."""
    old = dataclasses.asdict(PPOConfig())
    old["reward_model"] = {k: v for k, v in old["reward_model"].items() if k != "model"} | {"path": "/rm"}
    current = PPOConfig()
    current.reward_model.model.path = "/rm"
    current.reward_model.model.input_tokenizer = "/actor"  # verl's default: the actor's model path
    assert run_differences(old, dataclasses.asdict(current)) == [
        ("reward_model.model.input_tokenizer", None, "/actor")]
    current.reward_model.model.input_tokenizer = None
    assert run_differences(old, dataclasses.asdict(current)) == []

class _Payload:
    """A pickle that creates a directory when it is unpickled (what a malicious one could do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_rng_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "rank_0.pt"
    torch.save({"python": _Payload(marker), "torch": torch.get_rng_state()}, path)
    with pytest.raises(UserError, match=r"rank_0\.pt' was refused: .*could run code \(.*posix\.mkdir"):
        read_rng_state(str(path))
    assert not os.path.exists(marker)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"was refused: .*\(Unsupported operand"):
        read_rng_state(str(path))


def test_rng_state_round_trips_through_weights_only(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    torch.save(_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    _set_rng_state(read_rng_state(str(tmp_path / "rng.pt")))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_trainer_state_is_json_and_an_old_pickle_is_not_loaded(tmp_path):
    step = tmp_path / "global_step_3"
    step.mkdir()
    with pytest.raises(UserError, match=r"does not exist or is incomplete \(no trainer_state\.json\)$"):
        read_trainer_state(str(step))
    # the checkpoints' directory instead of one of them: the newest is named
    for name in ("global_step_9", "global_step_10", "global_step_10.tmp"):
        (tmp_path / name).mkdir(exist_ok=True)
    newest = re.escape(repr(str(tmp_path / "global_step_10")))
    with pytest.raises(UserError, match=f"it holds checkpoints; name one of them, e.g. {newest}$"):
        read_trainer_state(str(tmp_path))
    marker = str(tmp_path / "pwned")
    torch.save({"global_step": _Payload(marker)}, step / "trainer_state.pt")
    with pytest.raises(UserError, match=r"trainer_state\.pt.*pickles are not loaded because they can run code"):
        read_trainer_state(str(step))
    assert not os.path.exists(marker)
    (step / "trainer_state.json").write_text('{"global_step": 3')
    with pytest.raises(UserError, match="is not readable JSON"):
        read_trainer_state(str(step))
    state = {"global_step": 3, "world_size": 2, "model": {}, "loader": {"epoch": 0, "position": 8}}
    (step / "trainer_state.json").write_text(json.dumps(state))
    assert read_trainer_state(str(step))["loader"] == {"epoch": 0, "position": 8}
    # valid JSON, but not what meshppo writes: the fields `load` reads are checked by name and type
    for broken in ({k: v for k, v in state.items() if k != "world_size"}, {**state, "model": "qwen"}, [state]):
        (step / "trainer_state.json").write_text(json.dumps(broken))
        with pytest.raises(UserError, match=r"is not a meshppo trainer state \(it needs 'global_step' \(int\), "
                                            r"'world_size' \(int\), 'model' \(dict\)\)"):
            read_trainer_state(str(step))


def test_auto_resume_over_an_older_pickled_checkpoint_says_so(tmp_path):
    """resume_mode=auto finds no checkpoint it may load; it must not start over silently on
    top of an older meshppo's run (whose trainer state was a pickle)."""
    (tmp_path / "global_step_4").mkdir()
    torch.save({"global_step": 4}, tmp_path / "global_step_4" / "trainer_state.pt")
    with pytest.raises(UserError, match=r"global_step_4' stores its trainer state as a pickle"):
        CheckpointManager(str(tmp_path)).maybe_resume("auto")
    CheckpointManager(str(tmp_path / "empty")).maybe_resume("auto")  # nothing there: a fresh start


def test_a_resume_path_that_names_no_checkpoint_says_which_one_it_meant(tmp_path):
    """verl keeps global_step_K in its default_local_dir itself, meshppo in the run directory's checkpoints/: a
    verl user's trainer.resume_from_path=RUN/global_step_K said only "does not exist", RUN itself "does not
    exist or is incomplete", as did a step's actor/. Each now names the checkpoint it meant."""
    run = tmp_path / "run"
    manager, counter = _manager(run / "checkpoints")
    counter.step = 4
    manager.save(4)
    step = re.escape(repr(manager.step_dir(4)))
    resumed, _ = _manager(run / "checkpoints")
    for given, says in ((run / "global_step_4", rf"does not exist: meshppo keeps a run's checkpoints in its "
                                                rf"checkpoints/ directory \(verl in the run directory itself\): {step}$"),
                        (run, rf"does not exist or is incomplete \(no trainer_state\.json\): it is a run directory, "
                              rf"whose checkpoints are in its checkpoints/; name one of them, e\.g\. {step}$"),
                        (run / "checkpoints" / "global_step_4" / "actor",
                         rf"is incomplete \(no trainer_state\.json\): it is the actor's part of checkpoint {step}; "
                         "name the checkpoint$")):
        if given.name == "actor":
            given.mkdir()
        with pytest.raises(UserError, match=says):
            resumed.maybe_resume("resume_path", str(given))
    assert resumed.maybe_resume("resume_path", manager.step_dir(4)) == manager.step_dir(4)


class _Counter:
    """A registered state: the step it was saved at."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _manager(root, keep=None):
    counter = _Counter()
    return CheckpointManager(str(root), states={"trainer": counter}, fingerprint={}, config=PPOConfig(), keep=keep,
                             log=lambda s: None), counter


def _saved(manager, path):
    return json.loads(open(os.path.join(path, "trainer_state.json")).read())["trainer"]["step"]


def test_rotation_after_resuming_an_earlier_step_keeps_the_new_checkpoint(tmp_path):
    """A run resumed from step 2 of a directory that also holds 4 and 6 (resume_path: rewinding a run)
    saves step 3 with max_actor_ckpt_to_keep=1: the newest checkpoint up to 3 is kept and the next
    auto resume finds it; 4 and 6 (the abandoned branch) are not counted in the rotation nor deleted."""
    first, counter = _manager(tmp_path)
    for step in (2, 4, 6):
        counter.step = step
        first.save(step)
    second, counter = _manager(tmp_path, keep=1)
    assert second.maybe_resume("resume_path", second.step_dir(2)) and counter.step == 2
    counter.step = 3
    second.save(3)
    assert second.complete_steps() == [3, 4, 6]
    assert second.latest() == second.step_dir(3) and _saved(second, second.latest()) == 3
    counter.step = 4
    second.save(4)  # replaces the abandoned branch's step 4; rotation deletes 3
    assert second.complete_steps() == [4, 6] and _saved(second, second.latest()) == 4
    assert not any(name.endswith((".tmp", ".old")) for name in os.listdir(tmp_path))


def test_a_save_of_an_existing_step_cut_off_keeps_that_step(tmp_path, monkeypatch):
    """Saving a step that has a checkpoint again, killed between moving the old one aside and
    putting the new one in place: the pointer's step still resolves to a complete checkpoint."""
    manager, counter = _manager(tmp_path, keep=1)
    counter.step = 1
    manager.save(1)
    replace = os.replace

    def killed(src, dst):
        if src.endswith(".tmp") and os.path.basename(dst).startswith("global_step_"):
            raise KeyboardInterrupt("killed")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    counter.step = 99  # a state that must not be what resumes
    with pytest.raises(KeyboardInterrupt):
        manager.save(1)
    monkeypatch.setattr(os, "replace", replace)
    fresh, counter = _manager(tmp_path)
    assert fresh.maybe_resume("auto") is not None and counter.step == 1
    counter.step = 1
    fresh.save(1)  # the next save of the step completes and leaves no debris
    assert fresh.latest() == fresh.step_dir(1)
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "latest_checkpointed_iteration.txt"]


def test_a_save_removes_what_killed_saves_of_other_steps_left(tmp_path):
    """A save killed while writing leaves `global_step_K.tmp`, one killed while replacing its step leaves
    `global_step_K.old`: they stayed on disk for good unless step K was saved again."""
    manager, counter = _manager(tmp_path)
    counter.step = 2
    manager.save(2)
    for name in ("global_step_3.tmp", "global_step_2.old", "global_step_1.old"):
        os.makedirs(tmp_path / name / "actor")
        (tmp_path / name / "actor" / "shard").write_bytes(b"x" * 1024)
    (tmp_path / "global_step_7.tmpx").mkdir()  # not a checkpoint's name: left alone
    counter.step = 4
    manager.save(4)
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_4", "global_step_7.tmpx",
                                            "latest_checkpointed_iteration.txt"]
    assert manager.latest() == manager.step_dir(4) and _saved(manager, manager.latest()) == 4


def test_a_restarted_launch_continues_from_its_own_checkpoints(tmp_path, monkeypatch):
    """torchrun's --max-restarts re-runs the same command: resume_mode=disable deleted the checkpoints
    the run had just written and started again from step 0, and resume_path went back to its
    checkpoint. After a restart both continue from the newest checkpoint the launch wrote, and never
    from an earlier run's (the launch's first start marks the directory with its run id)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    earlier, counter = _manager(tmp_path / "run")
    for step in (5, 10):  # an earlier run's checkpoints in the same directory
        counter.step = step
        earlier.save(step)
    # dated an hour ahead: the launch tells its checkpoints from these by what was there when it started,
    # not by time (a file system that keeps modification times to the second, NFS, Lustre, or two, FAT,
    # gives files written just before the launch marker the marker's own time)
    _redate(tmp_path / "run", 3600)
    # resume_path back to step 5 of them; a restart before the launch saved anything: step 5 again, not 10
    first, counter = _manager(tmp_path / "run")
    assert first.maybe_resume("resume_path", first.step_dir(5)) == first.step_dir(5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again, counter = _manager(tmp_path / "run")
    assert again.maybe_resume("resume_path", again.step_dir(5)) == again.step_dir(5) and counter.step == 5
    counter.step = 6  # not there when the launch started: its own
    again.save(6)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    third, counter = _manager(tmp_path / "run")
    assert third.maybe_resume("resume_path", third.step_dir(5)) == third.step_dir(6) and counter.step == 6
    # disable: the first start deletes the earlier run's, a restart keeps and resumes the launch's own
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # launch b's first attempt died before maybe_resume:
    fresh, counter = _manager(tmp_path / "run")           # launch a's checkpoints are not its own
    assert fresh.maybe_resume("disable") is None and fresh.complete_steps() == []
    for step in (1, 2):
        counter.step = step
        fresh.save(step)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    again, counter = _manager(tmp_path / "run")
    assert again.maybe_resume("disable") == again.step_dir(2) and counter.step == 2
    assert again.complete_steps() == [1, 2]  # nothing deleted
    # a SLURM requeue: a new torchrun (restart count 0) under the same job (the rendezvous id): the same
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued, counter = _manager(tmp_path / "run")
    assert requeued.maybe_resume("disable") == requeued.step_dir(2) and counter.step == 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # a first start of launch b again: it starts over
    assert _manager(tmp_path / "run")[0].maybe_resume("disable") is None


def _redate(root, seconds):
    """Set the access and modification times of `root` and everything under it `seconds` from now."""
    then = time.time() + seconds
    for folder, _, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, name) for name in files)]:
            os.utime(path, (then, then))


def test_disable_refuses_to_delete_a_checkpoint_the_run_reads(tmp_path):
    """A second stage trained from the first's global_step_N/actor/huggingface in the same run
    directory: resume_mode=disable deleted it (and the config then named a path that was gone)."""
    first, counter = _manager(tmp_path / "run")
    counter.step = 1
    first.save(1)
    model = os.path.join(first.step_dir(1), "actor", "huggingface")
    os.makedirs(model)
    cfg = PPOConfig()
    cfg.actor_rollout_ref.model.path = model
    second = CheckpointManager(str(tmp_path / "run"), states={"trainer": _Counter()}, fingerprint={}, config=cfg,
                               log=lambda s: None)
    with pytest.raises(UserError, match=r"trainer.resume_mode=disable would delete .*, which holds '.*huggingface', a "
                                        r"model, adapter or tokenizer this run reads"):
        second.maybe_resume("disable")
    assert os.path.isdir(model) and second.complete_steps() == [1]


def test_a_failed_write_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A full disk during a save ended in a traceback on every rank and left global_step_N.tmp taking
    space; now a UserError names the step, the cause and the last complete checkpoint, and the partial
    directory is gone."""
    import trainer.checkpointing as checkpointing

    manager, counter = _manager(tmp_path)
    counter.step = 1
    manager.save(1)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "_rng_state", full)
    counter.step = 2
    with pytest.raises(UserError, match=r"writing the checkpoint of step 2 into .*global_step_2\.tmp failed \(OSError: "
                                        r"\[Errno 28\] No space left on device\); the last complete checkpoint is "
                                        r".*global_step_1; free space in"):
        manager.save(2)
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert manager.latest() == manager.step_dir(1)


def test_a_disk_that_fills_while_the_shards_are_written_is_said_as_such(tmp_path):
    """The shards are most of a checkpoint, so a disk fills most likely while DCP writes them. torch.save's
    zip writer turns the file's failed write into `RuntimeError: [enforce fail at inline_container.cc:672] .
    unexpected pos 704 vs 598`, the OSError only that error's context; the message gave the RuntimeError.
    A file size limit makes the write fail for real (EFBIG: Python ignores SIGXFSZ), as a full disk does."""
    resource = pytest.importorskip("resource")
    model = torch.nn.Linear(200, 200)
    counter = _Counter()
    manager = CheckpointManager(str(tmp_path), states={"trainer": counter}, models={"actor": (model, None)},
                                fingerprint={}, config=PPOConfig(), log=lambda s: None)
    counter.step = 1
    manager.save(1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = 64 << 10  # below the shard's 160 kB
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        counter.step = 2
        with pytest.raises(UserError) as failed:
            manager.save(2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"into {manager.step_dir(2)}.tmp failed (OSError: [Errno 27] File too large); the last complete " \
           f"checkpoint is {manager.step_dir(1)}" in str(failed.value), str(failed.value)
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "latest_checkpointed_iteration.txt"]


def test_the_names_inside_a_checkpoint_are_synced_before_it_is_published(tmp_path, monkeypatch):
    """A power loss after a save could keep global_step_K (the run directory was synced) with names inside it
    that never reached the disk: the model's directory still `actor.tmp` (its rename from it), the trainer
    state or an RNG file missing. The pointer named K, and the resume stopped on it. Every directory of the
    step is now synced before the step is renamed into place."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name the synced directories")
    import trainer.checkpointing as checkpointing

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(checkpointing.os, "fsync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    counter = _Counter()
    manager = CheckpointManager(str(tmp_path), states={"trainer": counter}, models={"actor": (torch.nn.Linear(4, 4),
                                                                                            None)},
                                fingerprint={}, config=PPOConfig(), log=lambda s: None)
    counter.step = 1
    manager.save(1)
    tmp = manager.step_dir(1) + ".tmp"
    publish = synced.index(str(tmp_path))  # the root, synced once the step is renamed into place
    for folder in (tmp, os.path.join(tmp, "actor"), os.path.join(tmp, "rng")):
        assert folder in synced[:publish], (folder, synced)


def test_a_missing_rank_rng_file_is_refused_and_the_markers_are_synced(tmp_path, monkeypatch):
    """A checkpoint whose rng/ directory lacks this rank's file (a copy cut short, a lost file) resumed
    with the RNG seeded afresh and nothing said; it is now refused naming the file. And the files that
    make a checkpoint complete, the trainer state (its marker) and the pointer, are synced to the disk
    before the step is published (a power loss left a pointer to a step whose marker was empty)."""
    import trainer.checkpointing as checkpointing

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(checkpointing.os, "fsync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    manager, counter = _manager(tmp_path)
    counter.step = 1
    manager.save(1)
    root = manager.root
    if os.path.isdir("/proc/self/fd"):
        tmp = manager.step_dir(1) + ".tmp"
        assert synced.index(os.path.join(tmp, "rng", "rank_0.pt")) < synced.index(os.path.join(tmp, STATE_FILE))
        assert synced[-3:] == [root, os.path.join(root, LATEST + ".tmp"), root]
    os.remove(os.path.join(manager.step_dir(1), "rng", "rank_0.pt"))
    resumed, _ = _manager(tmp_path)
    with pytest.raises(UserError, match=r"checkpoint '.*global_step_1' is incomplete: it has no rng/rank_0.pt, rank "
                                        r"0's RNG state"):
        resumed.maybe_resume("auto")


def test_resuming_on_another_world_size_says_what_is_reseeded_and_what_changes(tmp_path):
    """A checkpoint of 2 ranks resumed on 1: the ranks' saved RNG states are left behind (the global
    Python / NumPy / torch streams keep their seeding). It said that "sampling differs from the
    uninterrupted run's", then that the mini-batch shuffles and the losses' draws were unaffected "so
    the run still reproduces"; but those generators are seeded per rank (each rank shuffles its own
    rows, clip_cov's stream is the data-parallel rank's, the hf rollout's the replica's): only the
    data order and the engine's rollout sampling (keyed by step and prompt) do not change."""
    counter = _Counter()
    said = []
    writer = CheckpointManager(str(tmp_path), states={"trainer": counter}, fingerprint={}, config=PPOConfig(),
                               world_size=2, log=said.append)
    counter.step = 1
    writer.save(1)
    resumed = CheckpointManager(str(tmp_path), states={"trainer": _Counter()}, fingerprint={}, config=PPOConfig(),
                                world_size=1, log=said.append)
    assert resumed.maybe_resume("auto") == resumed.step_dir(1)
    (line,) = [s for s in said if "resumed on 1" in s]
    assert "written by 2 ranks, resumed on 1: Python's, NumPy's and torch's global RNG streams" in line
    assert "seeded from trainer.seed, the step and the rank or replica, not from the saved states" in line
    assert "the engine's rollout sampling (keyed by step and prompt) do not depend on the world size" in line
    assert ("but the mini-batches (each rank shuffles its own rows), clip_cov's draws (per data-parallel rank), "
            "rollout.name=hf's sampling (per replica) and the order of the reductions do") in line
    assert "does not reproduce the uninterrupted one" in line and "unaffected" not in line and "\n" not in line
