"""PPOTrainer.train's control flow around validation, with the work faked: which validations run,
at which step they are logged, and whether any step, checkpoint or export follows."""

from types import SimpleNamespace as NS

import pytest
import torch

from kl import KLGuard
from trainer import ppo_trainer
from trainer.config import PPOConfig, validate
from trainer.configlib import ConfigError, load_config
from trainer.ppo_trainer import PPOTrainer
from trainer.errors import StopTraining
from trainer.profiling import StepProfiler
from trainer.tracking import Timer

BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=[t.jsonl]", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.export_hf_at_end=false"]
VAL = {"val/meshppo/demo_add/score": 0.5, "timing_s/testing": 0.1}


class FakeTrainer:
    """What train() reads of a PPOTrainer; `resume_at` is the step a checkpoint resumes (None: a fresh run)."""

    train, _validate_apart = PPOTrainer.train, PPOTrainer._validate_apart
    _save_checkpoint, _publish_checkpoint = PPOTrainer._save_checkpoint, PPOTrainer._publish_checkpoint
    _agreed_log, _begin_logs, _log_row = PPOTrainer._agreed_log, PPOTrainer._begin_logs, PPOTrainer._log_row

    def __init__(self, cfg, resume_at=None, total_steps=2):
        self.cfg, self.total_steps, self.global_step = cfg, total_steps, 0
        self.logged, self.saved, self.lines, self.closed, self.manager_closed = [], [], [], False, False
        self.events = []  # ("write" | "row" | "publish", step), in order
        self.val_ds = object() if cfg.data.val_files else None

        def maybe_resume(mode, path):
            if resume_at is None:
                return None
            self.global_step = resume_at
            return f"global_step_{resume_at}"

        def publish(step):
            self.events.append(("publish", step))
            self.saved.append(step)
            self.ckpt.saved_step = step

        def log(metrics, step):
            self.events.append(("row", step))
            self.logged.append((step, dict(metrics)))

        self.ckpt = NS(maybe_resume=maybe_resume, write=lambda step: self.events.append(("write", step)),
                       publish=publish, saved_step=None, complete_steps=lambda: [])
        self.guard = KLGuard(cfg.algorithm.kl_guard)  # (its record of the checkpoints: a resume's, a save's)
        self.timer = Timer(torch.device("cpu"))
        self.tracking = NS(begin=lambda *a: None, log=log, close=lambda: setattr(self, "closed", True))
        self.reward_manager = NS(close=lambda: setattr(self, "manager_closed", True))  # train() closes it at the end
        self.profiler = StepProfiler(None, 0, "cpu", total_steps)  # nothing profiled
        self.loader = self.kl = NS(state_dict=lambda: {}, load_state_dict=lambda s: None, batch_epoch=0)
        self.ctx = NS(world_size=1, local_world_size=1, rank=0)
        self.device, self.run_dir, self.nonfinite_streak = "cpu", "/run", 0
        self.models = NS(dims=None, ulysses_sizes=lambda: {})

    # No signals reach a fake and its KL never moves: installing handlers and the guard do nothing.
    _install_signal_handlers = _apply_guard = staticmethod(lambda *args: None)

    def _agreed_stop_signal(self):
        return False

    def log(self, text):
        self.lines.append(text)

    def validate(self):
        return dict(VAL)

    def step(self):
        self.global_step += 1
        return {"actor/pg_loss": 0.0}


@pytest.fixture(autouse=True)
def _no_run_info(monkeypatch):
    monkeypatch.setattr(ppo_trainer, "run_info", lambda *a: {})
    monkeypatch.setattr(ppo_trainer, "to_commented_yaml", lambda cfg: "")


def _cfg(*overrides):
    cfg = load_config(PPOConfig, None, [*BASE, *overrides])
    validate(cfg)
    return cfg


def test_val_only_validates_once_and_trains_nothing():
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]", "trainer.val_only=true"))
    assert t.train() == 0
    assert t.logged == [(0, VAL)]  # logged as the start-up validation is, at step 0
    assert t.global_step == 0 and t.saved == [] and t.closed and t.manager_closed
    # verl ignores val_only without val_before_train; meshppo still only validates
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]", "trainer.val_only=true", "trainer.val_before_train=false"))
    assert t.train() == 0 and t.logged == [(0, VAL)] and t.global_step == 0


def test_val_only_validates_the_checkpoint_it_resumes():
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]", "trainer.val_only=true"), resume_at=5, total_steps=9)
    assert t.train() == 0
    assert t.logged == [(5, VAL)] and t.global_step == 5 and t.saved == []


def test_a_normal_run_validates_before_training_then_trains():
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]"))
    assert t.train() == 0
    assert [step for step, _ in t.logged] == [0, 1, 2] and t.logged[0] == (0, VAL)
    assert t.saved == [2]
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]"), resume_at=1)  # not on resume
    assert t.train() == 0 and [step for step, _ in t.logged] == [2]


def test_val_only_needs_val_files():
    with pytest.raises(ConfigError, match="trainer.val_only=true validates and exits, but data.val_files is empty"):
        _cfg("trainer.val_only=true")


class PromptTokenizer:
    """Decodes prompt ids [i] to "p{i}"."""

    def decode(self, ids, skip_special_tokens=False):
        return f"p{ids[0]}"


def test_logged_validation_samples_spread_over_the_prompts():
    """log_val_generations: 3 of 4 prompts x 4 samples, picked as verl does (sorted, then shuffled with
    seed 42), not the first prompt's samples in order; the same at every validation, whatever order
    the prompts came in, and no more than there are."""
    from trainer.ppo_trainer import val_samples_to_log

    samples = [([i], f"r{i}{j}", float(j)) for i in range(4) for j in range(4)]
    shown = {(f"p{ids[0]}", f"p{ids[0]}", response, score) for ids, response, score in samples}
    picked = val_samples_to_log(PromptTokenizer(), samples, 3)
    assert len(picked) == 3 and set(picked) <= shown
    assert len({prompt for prompt, _, _, _ in picked}) > 1, picked
    prompts_reversed = [x for i in reversed(range(4)) for x in samples[4 * i:4 * i + 4]]
    assert val_samples_to_log(PromptTokenizer(), prompts_reversed, 3) == picked
    assert set(val_samples_to_log(PromptTokenizer(), samples, 100)) == shown


def test_logged_validation_samples_are_sorted_on_the_prompt_without_special_tokens():
    """verl sorts on `decode(ids, skip_special_tokens=True)`. With the chat template's tokens kept, a
    question's end token ('<' after "What is 2") sorts it after the longer question it begins ('+' <
    '<'). Without them: "What is 2\\n" < "What is 2+2\\n" < "What is 3\\n" < "What is 3*3\\n" (q0..q3);
    RandomState(42) permutes 4 items to [1, 3, 0, 2], so the first 2 are q1's and q3's (with the
    tokens the order was q1, q0, q3, q2 and the picks q0's and q2's). Shown with the tokens."""
    from tests.byte_chat import build_byte_tokenizer
    from trainer.ppo_trainer import val_samples_to_log

    tok = build_byte_tokenizer()
    questions = ["What is 2", "What is 2+2", "What is 3", "What is 3*3"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    picked = val_samples_to_log(tok, [(p, f"r{i}", float(i)) for i, p in enumerate(prompts)], 2)
    assert [response for _, _, response, _ in picked] == ["r1", "r3"]
    # the loggers get verl's text (no special tokens), the console the prompt as the model read it
    assert picked[0][1].endswith("<|im_start|>user\nWhat is 2+2<|im_end|>\n<|im_start|>assistant\n"), picked
    assert picked[0][0] == tok.decode(prompts[1], skip_special_tokens=True) and "<|im_start|>" not in picked[0][0]


def test_a_due_checkpoint_is_written_before_the_validation_and_survives_its_failure():
    """A validation can fail where training does not (its own data and reward, a larger val_kwargs.n
    out of memory) or be killed (a watchdog, the OOM killer). It ran before the checkpoint and the
    metrics row: with save_freq -1 a failed last validation lost the whole run, and any failure the
    step's metrics. The checkpoint (timed as verl's timing_s/save_checkpoint) and the step's training
    row now come first, and the validation's metrics are a row of their own at the same step."""

    class Broken(FakeTrainer):
        def validate(self):
            assert self.saved[-1:] == [self.global_step], "validated before the checkpoint"
            assert self.logged[-1][0] == self.global_step, "validated before the step's row was logged"
            if self.global_step == 2:
                raise RuntimeError("reward of the validation data failed")
            return dict(VAL)

    t = Broken(_cfg("data.val_files=[v.jsonl]", "trainer.test_freq=1", "trainer.save_freq=1",
                    "trainer.val_before_train=false"), total_steps=3)
    with pytest.raises(RuntimeError, match="reward of the validation data failed"):
        t.train()
    assert t.saved == [1, 2]
    assert [step for step, _ in t.logged] == [1, 1, 2]
    (_, first), (_, validation), (_, second) = t.logged
    assert validation == {**VAL, "training/global_step": 1, "training/epoch": 0}
    assert first["timing_s/save_checkpoint"] >= 0
    assert "actor/pg_loss" in first and "actor/pg_loss" in second
    assert not any(k.startswith("val") for k in first) and not any(k.startswith("val") for k in second)
    # with no checkpoint due: the same rows, the checkpoint at the end
    t = FakeTrainer(_cfg("data.val_files=[v.jsonl]", "trainer.test_freq=1", "trainer.val_before_train=false"),
                    total_steps=3)
    assert t.train() == 0 and t.saved == [3]
    assert [step for step, _ in t.logged] == [1, 1, 2, 2, 3, 3]
    assert [m for _, m in t.logged][1::2] == [{**VAL, "training/global_step": step, "training/epoch": 0}
                                              for step in (1, 2, 3)]
    assert "timing_s/save_checkpoint" in t.logged[4][1]


def test_the_step_that_stops_the_run_is_logged():
    """The non-finite counter's (and a KL guard's) stop raised before the step's metrics were logged,
    so the row that shows why (grad_norm, nonfinite_skipped, kl_guard/*) was lost."""

    class NaNs(FakeTrainer):
        def step(self):
            self.global_step += 1
            return {"actor/pg_loss": float("nan"), "actor/nonfinite_skipped": float(self.global_step >= 2)}

    t = NaNs(_cfg("trainer.max_nonfinite_steps=2"), total_steps=5)
    with pytest.raises(StopTraining, match="2 consecutive steps had a non-finite loss"):
        t.train()
    assert [(step, m["actor/nonfinite_skipped"]) for step, m in t.logged] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert t.saved == []


def test_validations_leave_the_training_draws_as_they_were():
    """The checkpoint is written before a validation, so the RNG states it holds are those from before
    the validation: a resumed run draws the same only if the validation's draws do not reach the
    training's. validate() runs with every RNG set aside (torch's, NumPy's, Python's)."""
    import random

    import numpy as np

    class Drawing(FakeTrainer):
        draws = []

        def validate(self):
            torch.rand(3), np.random.rand(3), random.random()
            return dict(VAL)

        def step(self):
            self.global_step += 1
            self.draws.append((torch.rand(2).tolist(), float(np.random.rand()), random.random()))
            return {"actor/pg_loss": 0.0}

    runs = []
    for val in ("trainer.test_freq=-1", "trainer.test_freq=1"):
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        t = Drawing(_cfg("data.val_files=[v.jsonl]", val), total_steps=3)
        t.draws = []
        assert t.train() == 0
        runs.append(t.draws)
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_without_a_validation_set_no_validation_row_is_logged():
    """trainer.test_freq due (the last step always is) without data.val_files: no validation runs and
    no row of its own is logged, one row per step."""
    t = FakeTrainer(_cfg("trainer.test_freq=1"), total_steps=3)
    assert t.val_ds is None and t.train() == 0
    assert [step for step, _ in t.logged] == [1, 2, 3] and t.saved == [3]


def test_a_saving_steps_row_is_logged_after_its_checkpoint_is_written_and_before_it_is_in_place():
    """A process killed at any point then resumes with every step up to its checkpoint's logged: the row
    comes after the checkpoint's files (a failed write logs no row of a step the run redoes) and before
    the `latest` pointer names it (after it, a kill in between lost the row for good)."""
    t = FakeTrainer(_cfg("trainer.save_freq=2"), total_steps=3)
    assert t.train() == 0
    assert t.events == [("row", 1), ("write", 2), ("row", 2), ("publish", 2), ("write", 3), ("row", 3),
                        ("publish", 3)]
    assert all("timing_s/save_checkpoint" in metrics for step, metrics in t.logged if step in (2, 3))
