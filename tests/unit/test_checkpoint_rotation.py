"""`trainer.max_actor_ckpt_to_keep`: how many checkpoint directories are on the disk while a save
writes, as in verl 0.9.1 (with N >= 2 the oldest goes before the new one is written)."""

import os
import re

import pytest

from trainer.checkpointing import CheckpointManager
from trainer.config import PPOConfig


class _DiskWatch:
    """A state the manager saves; its `state_dict`, called while the step's directory is being
    written, records the checkpoint directories on the disk then (complete ones and the `.tmp`)."""

    def __init__(self, root):
        self.root, self.seen = root, []

    def state_dict(self):
        self.seen.append(sorted(name for name in os.listdir(self.root) if re.fullmatch(r"global_step_\d+(\.tmp)?", name)))
        return {}

    def load_state_dict(self, state):
        """Nothing to restore: the watch only records what a save saw."""


def _saves(root, keep, steps):
    watch = _DiskWatch(root)
    manager = CheckpointManager(str(root), states={"watch": watch}, fingerprint={}, config=PPOConfig(), keep=keep,
                                log=lambda s: None)
    for step in steps:
        manager.save(step)
    return manager, watch.seen


def test_keep_n_needs_room_for_n_checkpoints_during_a_save(tmp_path):
    """With max_actor_ckpt_to_keep=2, saving step 3 wrote it next to steps 1 and 2 (three directories:
    a quota sized for verl's rotation filled up); now step 1 goes first, as in verl."""
    manager, seen = _saves(tmp_path, 2, [1, 2, 3, 4])
    assert seen == [["global_step_1.tmp"],
                    ["global_step_1", "global_step_2.tmp"],
                    ["global_step_2", "global_step_3.tmp"],
                    ["global_step_3", "global_step_4.tmp"]]
    assert manager.complete_steps() == [3, 4] and manager.latest() == manager.step_dir(4)
    _, seen = _saves(tmp_path / "three", 3, [1, 2, 3, 4, 5])
    assert [len(names) for names in seen] == [1, 2, 3, 3, 3] and seen[-1][-1] == "global_step_5.tmp"


def test_keep_one_keeps_the_only_checkpoint_until_the_new_one_is_in_place(tmp_path):
    """verl's exception: with one to keep, deleting it first would leave none if the save fails."""
    manager, seen = _saves(tmp_path, 1, [1, 2, 3])
    assert seen == [["global_step_1.tmp"], ["global_step_1", "global_step_2.tmp"],
                    ["global_step_2", "global_step_3.tmp"]]
    assert manager.complete_steps() == [3]


def test_checkpoints_of_later_steps_are_not_counted_nor_deleted_before_a_save(tmp_path):
    """A run resumed at step 2 of a directory holding 1, 2, 5, 6 (resume_path: a rewound run) saves
    step 3 with 2 to keep: of the earlier steps only 2 stays while 3 is written; 5 and 6 stay."""
    manager, _ = _saves(tmp_path, None, [1, 2, 5, 6])
    manager, seen = _saves(tmp_path, 2, [3])
    assert seen == [["global_step_2", "global_step_3.tmp", "global_step_5", "global_step_6"]]
    assert manager.complete_steps() == [2, 3, 5, 6]


def test_a_checkpoint_half_deleted_by_the_rotation_is_not_complete(tmp_path, monkeypatch):
    """A process killed while the rotation deletes an old checkpoint (its shards gone, its trainer state
    not yet) left a directory that counted as complete: a KL-guard rollback, a resume falling back from
    the pointer or a restarted launch could pick it and fail on its missing shards. Its trainer state
    (the completion marker) now goes first."""
    import shutil

    import trainer.checkpointing as checkpointing

    manager, _ = _saves(tmp_path, keep=None, steps=[1, 2])
    (tmp_path / "global_step_1" / "shard.distcp").write_bytes(b"x")

    class Killed(BaseException):
        """The process dying half-way through the deletion."""

    def killed_half_way(path, ignore_errors=False):
        os.remove(os.path.join(path, "shard.distcp"))
        raise Killed

    monkeypatch.setattr(checkpointing.shutil, "rmtree", killed_half_way)
    with pytest.raises(Killed):  # the deletion really started, and died half-way
        manager._rotate(2, 1)
    monkeypatch.setattr(checkpointing.shutil, "rmtree", shutil.rmtree)
    assert manager.complete_steps() == [2]
