"""A checkpoint write that fails on one rank fails the save on every rank. Rank 0 alone writes the
trainer state and moves the `latest` pointer, every rank its own RNG file: a full disk there raised
on that rank while the others waited in the save's next barrier until the collective timeout (30
minutes by default). Now every rank raises one UserError, the failed rank with its cause and the
others naming that rank, and the checkpoint before stays the latest."""

from __future__ import annotations

import json
import os

import pytest

from tests.dist_utils import run_distributed
from tests.unit.test_checkpoint_state import _Counter


def _full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _safetensors_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")


def _body(rank, world, root):
    import trainer.checkpointing as checkpointing
    from sharding import comm
    from trainer.config import PPOConfig
    from trainer.errors import UserError

    counter = _Counter()
    manager = checkpointing.CheckpointManager(root, states={"trainer": counter}, fingerprint={}, config=PPOConfig(),
                                              rank=rank, world_size=world, log=lambda s: None)
    counter.step = 1
    manager.save(1)
    first = manager.step_dir(1)
    pointer_tmp = os.path.join(root, checkpointing.LATEST + ".tmp")

    def fail_rng_on_rank_1():
        if rank == 1:
            checkpointing._rng_state = _full

    def fail_state_on_rank_0():
        if rank == 0:
            checkpointing.json = type("FullDisk", (), {"dump": staticmethod(_full)})

    def fail_safetensors_on_rank_0():  # safetensors' own error (the Hugging Face export, the adapter): no OSError
        if rank == 0:
            checkpointing.json = type("FullDisk", (), {"dump": staticmethod(_safetensors_full)})

    def fail_pointer_on_rank_0():  # the pointer's temporary name taken by a directory
        if rank == 0:
            os.makedirs(pointer_tmp)

    full = r"OSError: \[Errno 28\] No space left on device"
    rng_state, json_module = checkpointing._rng_state, checkpointing.json
    for step, (fail, failed_rank, what, cause) in enumerate([
            (fail_rng_on_rank_1, 1, r"writing the checkpoint of step 2 into .*global_step_2\.tmp", full),
            (fail_state_on_rank_0, 0, r"writing the checkpoint of step 3 into .*global_step_3\.tmp", full),
            (fail_safetensors_on_rank_0, 0, r"writing the checkpoint of step 4 into .*global_step_4\.tmp",
             r"SafetensorError: Error while serializing: I/O error"),
            (fail_pointer_on_rank_0, 0, r"putting the checkpoint of step 5 in place \(.*global_step_5\)",
             "IsADirectoryError: ")], start=2):
        fail()
        counter.step = step
        own = cause if rank == failed_rank else rf"on rank {failed_rank}, whose log says why"
        with pytest.raises(UserError, match=rf"{what} failed \({own}.*\); the last complete checkpoint is "
                                            rf".*global_step_1; free space in"):
            manager.save(step)
        checkpointing._rng_state, checkpointing.json = rng_state, json_module
        # every rank came out of the failed save: they meet in this collective, and agree on what is left
        assert comm.all_reduce_values([1.0], "sum")[0] == world
        assert manager.latest() == first
        with open(os.path.join(first, checkpointing.STATE_FILE)) as f:
            assert json.load(f)["trainer"]["step"] == 1
        assert not os.path.exists(manager.step_dir(step) + ".tmp")
    if rank == 0:
        os.rmdir(pointer_tmp)
    comm.all_reduce_values([1.0], "sum")
    counter.step = 6  # the disk has room again: the next save succeeds
    assert manager.save(6) == manager.step_dir(6) and manager.latest() == manager.step_dir(6)


def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ckpt"), timeout=120)


def _sharded_body(rank, world, root):
    """The same inside `sharding.checkpoint.save_checkpoint`: rank 0 alone writes `extra.json` and
    renames the directory, between barriers the other ranks waited in."""
    from pathlib import Path

    import torch.distributed as dist

    import sharding.checkpoint as checkpoint
    from models import ModelArgs
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model, comm, load_checkpoint, save_checkpoint

    args = ModelArgs(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    model = build_fsdp_model(args, ParallelDims(dist.get_world_size()).build_meshes("cpu").train,
                             FSDPConfig(mixed_precision={"param_dtype": "fp32"}), seed=0)
    path = Path(root) / "actor"
    save_checkpoint(path, model, extra={"step": 1})
    json_module = checkpoint.json
    if rank == 0:
        checkpoint.json = type("FullDisk", (), {"dump": staticmethod(_full)})
    with pytest.raises(comm.RankFailed) as e:
        save_checkpoint(path, model, extra={"step": 2})
    checkpoint.json = json_module
    assert e.value.rank == 0 and (e.value.error is not None) == (rank == 0)
    assert str(e.value) == ("OSError: [Errno 28] No space left on device" if rank == 0 else "rank 0 failed")
    assert load_checkpoint(path, model) == {"step": 1}  # the earlier checkpoint, whole
    save_checkpoint(path, model, extra={"step": 3})
    assert load_checkpoint(path, model) == {"step": 3}


def test_a_shard_directory_write_failing_on_rank_0_fails_on_every_rank(tmp_path):
    run_distributed(_sharded_body, 2, str(tmp_path), timeout=120)


def _exports_body(rank, world, run_dir):
    """resume_mode=disable's deletion of the earlier run's exports (rank 0 alone deletes) is agreed too."""
    import shutil
    from types import SimpleNamespace

    import trainer.ppo_trainer as ppo_trainer
    from trainer.config import PPOConfig
    from trainer.errors import UserError

    if rank == 0:
        os.makedirs(os.path.join(run_dir, "hf_actor"))
    fake = SimpleNamespace(ctx=SimpleNamespace(is_main=rank == 0), run_dir=run_dir, cfg=PPOConfig(),
                           log=lambda s: None)
    real = shutil.rmtree

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    ppo_trainer.shutil.rmtree = refuse
    try:
        with pytest.raises(UserError, match=r"deleting the earlier run's exports in .* failed \("
                                            + ("PermissionError: \\[Errno 13\\] Permission denied: '.*hf_actor'"
                                               if rank == 0 else "on rank 0, whose log says why") + r"\)"):
            ppo_trainer.PPOTrainer._delete_earlier_exports(fake)
    finally:
        ppo_trainer.shutil.rmtree = real
    ppo_trainer.PPOTrainer._delete_earlier_exports(fake)
    assert not os.path.exists(os.path.join(run_dir, "hf_actor"))


def test_deleting_the_earlier_exports_fails_on_every_rank(tmp_path):
    run_distributed(_exports_body, 2, str(tmp_path), timeout=120)


def _rng_load_body(rank, world, root):
    import trainer.checkpointing as checkpointing
    from sharding import comm
    from trainer.config import PPOConfig
    from trainer.errors import UserError

    counter = _Counter()
    manager = checkpointing.CheckpointManager(root, states={"trainer": counter}, fingerprint={}, config=PPOConfig(),
                                              rank=rank, world_size=world, log=lambda s: None)
    counter.step = 1
    path = manager.save(1)
    if rank == 0:
        os.remove(os.path.join(path, "rng", "rank_1.pt"))  # a copy of the run directory cut short
    comm.all_reduce_values([1.0], "sum")
    own = r"is incomplete: it has no rng/rank_1.pt, rank 1's RNG state"
    with pytest.raises(UserError, match=own if rank == 1 else r"rank 1's RNG state is missing or unreadable"):
        manager.load(path)
    assert comm.all_reduce_values([1.0], "sum")[0] == world  # both came out of the load


def test_a_rank_missing_its_rng_file_fails_the_resume_on_every_rank(tmp_path):
    """Each rank reads its own RNG file on resume: a rank whose file was missing or unreadable raised alone,
    before the models' load (a collective) that the other ranks entered."""
    run_distributed(_rng_load_body, 2, str(tmp_path / "ckpt"), timeout=120)
