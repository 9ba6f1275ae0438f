"""The trainer's step runs without automatic garbage collection and collects at its end."""

import contextlib
import gc
import weakref

import pytest

from trainer import gc_control


class _Node:
    """A plain object that can sit in a reference cycle (and be weakly referenced)."""


def test_no_automatic_collection_inside_and_cycles_collected_after():
    assert gc.isenabled()
    with gc_control.collect_after(step=1):
        assert not gc.isenabled()
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a reference cycle: only the collector frees it
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None
    assert ref() is None  # collected at the end of the block
    assert gc.isenabled()


def test_previous_setting_restored_and_full_collection_on_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    gc.disable()
    try:
        for step in (1, gc_control.FULL_EVERY, gc_control.FULL_EVERY + 1):
            with gc_control.collect_after(step):
                assert not gc.isenabled()
            assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
    assert calls == [1, 2, 1]


def test_the_steps_collection_is_inside_timing_s_step(monkeypatch):
    """`PPOTrainer.step`'s end-of-step collection (tens to hundreds of milliseconds in a process that holds
    compiled graphs) is part of `timing_s/step`, hence of perf/time_per_step and perf/throughput: it runs
    while the step's timer is open, not after it closed."""
    from types import SimpleNamespace

    import torch

    import trainer.ppo_trainer as pt
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.tracking import Timer

    class Stop(Exception):
        """Ends the step in its first phase: the end-of-step collection still runs, inside the step's timer."""

    events = []

    @contextlib.contextmanager
    def around(name):
        events.append(f"enter {name}")
        try:
            yield
        finally:
            events.append(f"exit {name}")

    def generate_all(*args, **kwargs):
        raise Stop  # the step's first phase: nothing else of the step is needed here

    trainer = object.__new__(pt.PPOTrainer)
    trainer.cfg, trainer.global_step = load_config(PPOConfig, None, []), 0
    trainer.ctx = SimpleNamespace(rank=0, world_size=1)
    trainer.timer = Timer(torch.device("cpu"))
    trainer.timer.around = around
    trainer.loader = SimpleNamespace(next_batch=lambda: [])
    trainer._generate_all = generate_all
    monkeypatch.setattr(gc, "collect", lambda generation=2: events.append(f"collect {generation}"))
    with pytest.raises(Stop):
        trainer.step()
    assert events == ["enter step", "enter gen", "exit gen", "collect 1", "exit step"]
