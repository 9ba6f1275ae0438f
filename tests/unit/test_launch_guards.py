"""The launcher's and the ranks' guards against launches that cannot work: several nodes without a
shared rendezvous id, ranks without a rendezvous address, two runs in one run directory, and the
preemption deadline moved by a repeated signal."""

import os
import signal
from types import SimpleNamespace

import pytest

from trainer import cli, launch
from trainer.configlib import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


@pytest.fixture
def no_store(monkeypatch):
    """This process as rank 1 of 2, with no store made yet."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    monkeypatch.setattr(launch, "_STORE", [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT", launch.LAUNCH_DIR_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("given", [{}, {"MASTER_ADDR": "127.0.0.1"}])
def test_ranks_without_a_rendezvous_address_stop_at_once(no_store, monkeypatch, given):
    """RANK / WORLD_SIZE without MASTER_PORT (a launch by hand, an srun that maps SLURM_PROCID to RANK):
    each rank picked a free port of its own and waited 30 minutes for the others there."""
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    missing = "MASTER_PORT is" if given else "MASTER_ADDR and MASTER_PORT are"
    with pytest.raises(ConfigError, match=f"^WORLD_SIZE=2 but {missing} not set: the ranks meet at rank 0's "
                                          "MASTER_ADDR:MASTER_PORT"):
        launch._attempt_store()


def test_a_rank_without_a_rendezvous_address_is_a_config_error(no_store, capsys, tmp_path):
    code = cli.main(["--config", DEMO, "trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path}/run"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("meshppo: config error: WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"), err


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
