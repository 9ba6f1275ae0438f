"""The launcher's and the ranks' guards against launches that cannot work: several nodes without a
shared rendezvous id, ranks without a rendezvous address, two runs in one run directory, and the
preemption deadline moved by a repeated signal."""

import signal
from types import SimpleNamespace


def test_a_later_stop_signal_does_not_move_the_grace_deadline(monkeypatch):
    """USR1 a few minutes before the time limit, then the scheduler's TERM (or a repeated `scancel
    --signal`, which the launcher forwards again): the grace period runs from the first signal."""
    import trainer.ppo_trainer as ppo_trainer

    now = [100.0]
    monkeypatch.setattr(ppo_trainer.time, "monotonic", lambda: now[0])
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    trainer = SimpleNamespace(_stop_signal=None, _stop_time=0.0)
    try:
        ppo_trainer.PPOTrainer._install_signal_handlers(trainer)
        signal.raise_signal(signal.SIGUSR1)
        now[0] = 102.0
        signal.raise_signal(signal.SIGTERM)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert trainer._stop_time == 100.0 and trainer._stop_signal == signal.SIGUSR1
