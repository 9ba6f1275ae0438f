"""The launcher's and the ranks' guards against launches that cannot work: several nodes without a
shared rendezvous id, ranks without a rendezvous address, two runs in one run directory, and the
preemption deadline moved by a repeated signal."""

import os
import shutil
import signal
import socket
from types import SimpleNamespace

import pytest

from trainer import cli, launch
from trainer.configlib import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES",
              "SLURM_NTASKS")
TWO_NODES = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29500", "--config", DEMO,
             "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]


@pytest.fixture
def no_slurm(monkeypatch):
    for key in SLURM_VARS:
        monkeypatch.delenv(key, raising=False)


def test_several_nodes_without_a_rendezvous_id_outside_slurm_are_refused(no_slurm, capsys):
    """Each node's launcher made up its own --rdzv-id, so the nodes never met (torchrun's rendezvous
    timed out after 10 minutes without naming the flag)."""
    assert launch.main([*TWO_NODES, "--print-config"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["meshppo: config error: --nnodes 2 needs --rdzv-id ID, the same on every node (the job's id): "
                   "each node would otherwise make up its own, and the nodes would never meet"], err


def test_several_nodes_under_slurm_meet_under_the_jobs_id(no_slurm, monkeypatch, tmp_path):
    """Under SLURM every node's launcher sees the same SLURM_JOB_ID: torchrun gets it as --rdzv-id."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    commands = []
    monkeypatch.setattr(launch._Launch, "run", lambda self: commands.append((self.command(), self.launch_dir)) or 0)
    assert launch.main([*TWO_NODES, f"trainer.default_local_dir={tmp_path}/run"]) == 0
    (command, launch_dir), = commands
    shutil.rmtree(launch_dir)
    assert "--rdzv-id=4242" in command and "--rdzv-endpoint=node0:29500" in command, command
    # one node keeps an id of its own per launch (nothing to meet)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert launch.main(["--nproc-per-node", "1", "--config", DEMO, "trainer.n_gpus_per_node=1",
                        f"trainer.default_local_dir={tmp_path}/run"]) == 0
    (command, launch_dir), = commands[1:]
    shutil.rmtree(launch_dir)
    assert any(arg.startswith("--rdzv-id=meshppo-") for arg in command), command


@pytest.fixture
def no_store(monkeypatch):
    """This process as rank 1 of 2, with no store made yet."""
    import torch.distributed as dist

    # (tests/conftest.py fails whichever earlier test of this process leaves a group behind)
    assert not dist.is_initialized(), "a process group already exists in this process: these ranks have none yet"
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


def test_a_run_directory_is_held_by_one_run_at_a_time(tmp_path):
    """Rank 0 holds the run directory while it runs: another run's rank 0, and the launcher's check
    before any rank starts, are refused naming the directory and the holder; once it is released
    (the process ends, the run returns) the next run takes it."""
    run = str(tmp_path / "runs" / "a")
    refused = (rf"^trainer.default_local_dir={run} is in use by another run \(rank 0: pid {os.getpid()} on "
               rf"{socket.gethostname()}, which holds {run}/.lock\): let it end or stop it, or give this run another "
               r"trainer.default_local_dir")
    with launch.holding_run_dir(run):
        with pytest.raises(ConfigError, match=refused):
            launch.check_run_dir_free(run)
        with pytest.raises(ConfigError, match=refused):
            with launch.holding_run_dir(run):
                pytest.fail(f"{run} was held by two runs at once")
    launch.check_run_dir_free(run)
    with launch.holding_run_dir(run):
        with pytest.raises(ConfigError, match=refused):  # held again
            launch.check_run_dir_free(run)
    # the launchers of one launch on several nodes check at the same moment: they do not refuse each other
    held = launch._locked_run_dir(run, launch.fcntl.LOCK_SH)
    try:
        launch.check_run_dir_free(run)
    finally:
        held.close()


def test_a_one_node_launch_holds_its_run_directory_until_its_ranks_are_gone(no_slurm, monkeypatch, tmp_path):
    """The launcher only checked that no run held the directory, and its rank 0 locked it seconds later
    (torch imported, the config read): a second launch in between (a sweep started at once) passed the
    check, and both ran in the directory, each launcher showing the other's rank-0 log. Now a one-node
    launcher holds the lock from its check until its ranks are gone, and hands it to them."""
    run = str(tmp_path / "run")
    refused = (rf"^trainer.default_local_dir={run} is in use by another run \(the launcher: pid {os.getpid()} on "
               rf"{socket.gethostname()}, which holds {run}/.lock\)")
    seen = []

    def ranks(self):  # what the ranks' side sees while they run
        shutil.rmtree(self.launch_dir)
        with pytest.raises(ConfigError, match=refused):
            launch.check_run_dir_free(run)  # a second launch's check
        seen.append(self.environment()[launch.RUN_LOCK_ENV])
        # the hold torchrun shares (pass_fds), so that it outlives a launcher killed without its ranks
        assert self.run_dir_lock.name == os.path.join(run, ".lock")
        return 0

    monkeypatch.setattr(launch._Launch, "run", ranks)
    assert launch.main(["--nproc-per-node", "1", "--config", DEMO, "trainer.n_gpus_per_node=1",
                        f"trainer.default_local_dir={run}"]) == 0
    assert seen == [os.path.realpath(run)]
    launch.check_run_dir_free(run)  # released with the launch


def test_rank_0_under_a_launcher_holding_its_run_directory_runs(monkeypatch, tmp_path, capsys):
    """Rank 0 takes its launcher's hold as its own; a hold on another directory does not make it skip its
    own lock, so another run's launcher still refuses it."""
    import trainer.ppo_trainer

    run = str(tmp_path / "run")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", launch.LAUNCH_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(trainer.ppo_trainer, "run", lambda cfg: 0)
    args = ["--config", DEMO, "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={run}"]
    with launch.holding_run_dir(run, "the launcher"):
        monkeypatch.setenv(launch.RUN_LOCK_ENV, os.path.realpath(run))
        assert cli.main(args) == 0, capsys.readouterr().err
        monkeypatch.setenv(launch.RUN_LOCK_ENV, str(tmp_path / "other"))
        assert cli.main(args) == 2
        assert "is in use by another run (the launcher: pid" in capsys.readouterr().err


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
