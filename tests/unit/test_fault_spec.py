"""MESHPPO_FAULTS (trainer/faults.py), the reliability tests' fault injection: what it arms, and the
specs it refuses instead of arming nothing."""

import pytest

from trainer import faults


def _armed(monkeypatch, spec, name, step, rank):
    monkeypatch.setattr(faults, "FAULTS", faults._parse(spec))
    return faults.armed(name, step, rank)


def test_a_fault_listed_twice_arms_both(monkeypatch):
    """`sigkill@2:0,sigkill@3:1` kills rank 0 at step 2 and rank 1 at step 3; the second item replaced
    the first, so rank 0 was never killed."""
    spec = "sigkill@2:0,sigkill@3:1,crash_in_save@4"
    assert _armed(monkeypatch, spec, "sigkill", 2, 0) and _armed(monkeypatch, spec, "sigkill", 3, 1)
    assert not _armed(monkeypatch, spec, "sigkill", 2, 1) and not _armed(monkeypatch, spec, "sigkill", 3, 0)
    assert _armed(monkeypatch, spec, "crash_in_save", 4, 0) and _armed(monkeypatch, spec, "crash_in_save", 4, 5)
    assert not _armed(monkeypatch, spec, "hang", 2, 0)


@pytest.mark.parametrize("spec,message", [
    ("sigkil@3", "MESHPPO_FAULTS item 'sigkil@3': unknown fault 'sigkil'; known: nan_grad, sigkill, sigterm, "
                 "crash_in_save, crash_before_publish, crash_after_publish, hang"),
    ("crash_in_save@3:x", "MESHPPO_FAULTS item 'crash_in_save@3:x' must look like name@step[:rank]"),
    ("sigterm@3:", "MESHPPO_FAULTS item 'sigterm@3:' must look like name@step[:rank]"),
    ("sigterm", "MESHPPO_FAULTS item 'sigterm' must look like name@step[:rank]"),
])
def test_a_spec_that_would_arm_nothing_is_refused(spec, message):
    """A misspelt name armed nothing (a test of a kill then passed without one), and a rank that is not a
    number was a bare `invalid literal for int()`."""
    with pytest.raises(ValueError) as e:
        faults._parse(spec)
    assert str(e.value).startswith(message), str(e.value)
