"""The trainer's step runs without automatic garbage collection and collects at its end."""

import gc
import weakref

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
