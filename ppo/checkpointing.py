"""Trainer checkpoints: atomic, rotated, resumable on another world size.

Layout under `trainer.default_local_dir/checkpoints/`:

    global_step_K/
        actor/            model + optimizer, sharded (torch.distributed.checkpoint)
        critic/           the same, when there is a critic
        trainer_state.pt  step, data-loader position, LR schedulers, KL controller and guard,
                          the actor's shape (to refuse a checkpoint of another model)
        rng/rank_R.pt     every rank's RNG states
    latest_checkpointed_iteration.txt   (verl's name) the newest complete step

A checkpoint is written into `global_step_K.tmp/` and renamed once every rank has finished,
and only then does the `latest` file move (os.replace): a save interrupted at any point
leaves the previous checkpoint, and the pointer to it, intact.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ppo import faults
from sharding.checkpoint import gather_full_state_dict, load_checkpoint, save_checkpoint

LATEST = "latest_checkpointed_iteration.txt"


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    def __init__(self, trainer, root: str):
        self.trainer, self.root = trainer, root

    # --------------------------------------------------------------- discovery
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = re.fullmatch(r"global_step_(\d+)", name)
            if m and os.path.isfile(os.path.join(self.root, name, "trainer_state.pt")):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> str | None:
        pointer = os.path.join(self.root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer) as f:
                text = f.read().strip()
            if text.isdigit() and os.path.isfile(os.path.join(self.step_dir(int(text)), "trainer_state.pt")):
                return self.step_dir(int(text))
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # --------------------------------------------------------------- save
    def _fingerprint(self) -> dict:
        return dataclasses.asdict(self.trainer.models.actor_args) | {"extra_hf": None}

    def save(self) -> str:
        tr = self.trainer
        step = tr.global_step
        final, tmp = self.step_dir(step), self.step_dir(step) + ".tmp"
        if tr.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        _barrier()
        save_checkpoint(os.path.join(tmp, "actor"), tr.models.actor, tr.models.actor_optim)
        faults.crash_in_save(step, tr.ctx.rank)
        if tr.models.critic is not None:
            save_checkpoint(os.path.join(tmp, "critic"), tr.models.critic, tr.models.critic_optim)
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{tr.ctx.rank}.pt"))
        if tr.ctx.is_main:
            state = {
                "global_step": step,
                "loader": tr.loader.state_dict(),
                "actor_sched": tr.models.actor_sched.state_dict(),
                "critic_sched": tr.models.critic_sched.state_dict() if tr.models.critic_sched else None,
                "kl_ctrl": tr.kl_ctrl.state_dict(),
                "kl_guard": tr.guard.state_dict(),
                "kl_loss_coef": tr.kl_loss_coef,
                "nonfinite_streak": tr.nonfinite_streak,
                "world_size": tr.ctx.world_size,
                "model": self._fingerprint(),
            }
            # trainer_state.pt is written last: its presence marks a complete checkpoint.
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        _barrier()
        if tr.ctx.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer_tmp = os.path.join(self.root, LATEST + ".tmp")
            with open(pointer_tmp, "w") as f:
                f.write(str(step))
            os.replace(pointer_tmp, os.path.join(self.root, LATEST))
            self._rotate()
        _barrier()
        return final

    def _rotate(self):
        keep = self.trainer.cfg.trainer.max_actor_ckpt_to_keep
        if keep is None or keep <= 0:
            return
        for step in self.complete_steps()[:-keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    # --------------------------------------------------------------- load
    def load(self, path: str, keep_progress: bool = False) -> None:
        """Restore the run from checkpoint `path`. With `keep_progress` (a KL-guard rollback) only
        the learned state comes back (models, optimizers, schedulers, KL controller): the step
        counter, data position, guard and RNG move on, so the run continues on new data instead
        of replaying the batches that led to the rollback."""
        from ppo.trainer import UserError

        tr = self.trainer
        state_file = os.path.join(path, "trainer_state.pt")
        if not os.path.isfile(state_file):
            raise UserError(f"resume checkpoint {path!r} does not exist or is incomplete (no trainer_state.pt)")
        state = torch.load(state_file, weights_only=False)
        if state["model"] != self._fingerprint():
            diff = {k: (state["model"].get(k), v) for k, v in self._fingerprint().items() if state["model"].get(k) != v}
            raise UserError(f"checkpoint {path!r} belongs to a different model: (checkpoint, config) differ in {diff}")
        load_checkpoint(os.path.join(path, "actor"), tr.models.actor, tr.models.actor_optim)
        if tr.models.critic is not None:
            if not os.path.isdir(os.path.join(path, "critic")):
                raise UserError(f"checkpoint {path!r} has no critic but this run trains one (algorithm.adv_estimator)")
            load_checkpoint(os.path.join(path, "critic"), tr.models.critic, tr.models.critic_optim)
        tr.models.actor_sched.load_state_dict(state["actor_sched"])
        if tr.models.critic_sched is not None and state["critic_sched"] is not None:
            tr.models.critic_sched.load_state_dict(state["critic_sched"])
        tr.kl_ctrl.load_state_dict(state["kl_ctrl"])
        tr.kl_loss_coef = state["kl_loss_coef"]
        if keep_progress:
            return
        tr.global_step = state["global_step"]
        tr.loader.load_state_dict(state["loader"])
        tr.guard.load_state_dict(state["kl_guard"])
        tr.nonfinite_streak = state["nonfinite_streak"]
        rng_file = os.path.join(path, "rng", f"rank_{tr.ctx.rank}.pt")
        if os.path.isfile(rng_file) and state["world_size"] == tr.ctx.world_size:
            _set_rng_state(torch.load(rng_file, weights_only=False))

    def maybe_resume(self) -> None:
        from ppo.trainer import UserError

        t = self.trainer.cfg.trainer
        if t.resume_mode == "disable":
            return
        if t.resume_mode == "resume_path":
            if not os.path.isdir(t.resume_from_path):
                raise UserError(f"trainer.resume_from_path {t.resume_from_path!r} does not exist")
            path = t.resume_from_path
        else:
            path = self.latest()
            if path is None:
                return
        self.load(path)
        self.trainer.log(f"resumed from {path} at step {self.trainer.global_step}")

    def rollback(self) -> bool:
        path = self.latest()
        if path is None:
            return False
        self.load(path, keep_progress=True)
        self.trainer.log(f"rolled back the models to {path}; continuing at step {self.trainer.global_step + 1} "
                         "with new data")
        return True

    # --------------------------------------------------------------- export
    def export_hf(self, out_dir: str) -> None:
        """Write the actor as a Hugging Face directory (rank 0 writes; all ranks gather)."""
        tr = self.trainer
        full = gather_full_state_dict(tr.models.actor)
        if tr.ctx.is_main:
            from models import Transformer

            with torch.device("meta"):
                shell = Transformer(tr.models.actor_args)
            tmp = out_dir + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shell.save_pretrained(tmp, state_dict=full)
            tr.tokenizer.save_pretrained(tmp)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
        _barrier()
