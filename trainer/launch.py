"""Starting the SPMD program: the launcher around torchrun, each rank's side of it, and the
process group.

`python -m trainer.launch [--nnodes N ...] --config CONFIG [dotted.key=value ...]` is what
`launch/run_single_node.sh` and the SLURM templates run (`--print-config`: check the config
against this launch and print it with the start-up notes, starting nothing; this machine's GPUs
are checked only by a launch). Paths are relative to the working directory. Over plain torchrun it adds:

* a pre-flight in one process before any rank starts (`trainer.setup.preflight`: the config
  against the launch it describes and against this one, optional packages, GPUs; under `srun`,
  one launcher per node of the step, `check_slurm_step`): a config error is one line and exit
  code 2. The check imports torch and the config's modules only (no model, FSDP, engine or
  kernel: docs/ARCHITECTURE.md, import directions), so the line comes before those load;
* exit codes: a rank that stops on a user error (1 input, 2 config, 3 stopped by a guard)
  records the code in the launch directory and exits 0, so torchrun neither restarts the job
  (a restart cannot fix the input) nor prints its failure report; the launcher exits with the
  recorded code, adds the error lines of this node's other ranks that rank 0 did not print,
  and stops ranks still running `MESHPPO_PEER_GRACE_S` (30) seconds after such an exit (they
  would wait for the gone rank until `trainer.nccl_timeout`). A rank whose collective timed out
  or lost its peer (a hung or crashed rank, a lost node) is not such an exit: it exits
  `RESTART_EXIT`, and torchrun restarts the ranks (`--max-restarts`), which resume from the
  newest checkpoint;
* one launch per run directory: a lock on `<run dir>/.lock`, held by the launcher of a one-node
  launch from its check until its ranks are gone (restarts included; torchrun shares it, so it
  outlives a killed launcher; its rank 0 takes it as held: `RUN_LOCK_ENV`), by rank 0 on several nodes or under plain torchrun (the kernel releases it when
  the process ends, however it ends). A second launch into the directory is refused before any
  rank starts, naming the process holding it;
* signals: SIGTERM, SIGINT, SIGHUP and SIGUSR1 are the launcher's. It forwards SIGUSR1 as
  is and the others as SIGTERM to the ranks, which write a checkpoint and exit 0, and reports
  the preemption in one line. torchrun is started with them ignored: it would turn them into a
  `SignalException` traceback and exit 1. A second SIGINT (Ctrl-C) kills the ranks at once;
* output: each rank writes to `LOG_DIR/rank<R>.log`; the launcher copies rank 0's log to its
  stderr byte for byte (a progress bar redraws in place) and keeps torchrun's own output in
  `LOG_DIR/torchrun-<host>.log`, shown only when a rank or torchrun fails without a message.

Each rank calls `attach` first and exits with `finish(code)`; both do nothing without the
launcher's MESHPPO_LAUNCH_DIR (plain torchrun, a single process).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.errors import say

LAUNCH_DIR_ENV, LOG_DIR_ENV = "MESHPPO_LAUNCH_DIR", "MESHPPO_LOG_DIR"
# The run directory whose lock the launcher holds for its ranks (`holding_run_dir`, `run_dir_held_by_launcher`).
RUN_LOCK_ENV = "MESHPPO_RUN_LOCK_HELD"
# What the trainer reacts to (checkpoint and exit 0), and what the launcher takes from torchrun.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchrun's script by its absolute path: the launcher runs in the user's directory.
TRAIN_SCRIPT = os.path.join(REPO_ROOT, "train_ppo.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size_from_env() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size_from_env())))


def add_config_args(p: argparse.ArgumentParser) -> None:
    """`--config` and the dotted overrides, as train_ppo.py and the launcher take them. Parse with
    `parse_intermixed_args`: options may come after overrides. A relative `--config` is relative
    to the working directory; without one the overrides go over verl's defaults (which meshppo's
    options mirror), as verl's command line does."""
    p.add_argument("--config", default=None, help="YAML config file (default: none; the overrides go over verl's "
                                                  "defaults, as a verl command line's do; the demo is "
                                                  "configs/demo.yaml)")
    p.add_argument("--config-path", "-cp", default=None,
                   help="Hydra's config directory, as verl's scripts give it: --config-name's file is in it; relative "
                        "to the working directory (Hydra's is relative to verl's script)")
    p.add_argument("--config-name", "-cn", default=None,
                   help="Hydra's config name, as verl's scripts give it (with or without .yaml): the file NAME.yaml in "
                        "--config-path, instead of --config; verl's own names need no directory: ppo_trainer is "
                        "verl's defaults, which meshppo's options are (no file), and ppo_megatron_trainer is refused")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.total_training_steps=5 "
                                                "(Hydra's +key=value and ++key=value mean the same)")


def config_file(args) -> str | None:
    """The config file `add_config_args`' arguments name: `--config`, or Hydra's `--config-name` in
    `--config-path` (None: verl's defaults). A leading `~` in either is the home directory, as in a
    path option (the shell leaves `--config=~/x.yaml` as it is). A ConfigError where they contradict
    each other."""
    from trainer.configlib import VERL_DEFAULTS, VERL_MEGATRON_CONFIG, ConfigError, expand_home, megatron_refusal

    config, config_path = expand_home(args.config, "--config"), expand_home(args.config_path, "--config-path")
    hydra = [(flag, value) for flag, value in (("--config-name", args.config_name), ("--config-path", config_path))
             if value is not None]
    if config is not None and hydra:
        flag, value = hydra[0]
        raise ConfigError(f"--config {config} and {flag} {value} both name the config file: give one")
    if args.config_name is None:
        if config_path is not None:
            raise ConfigError(f"--config-path {config_path} needs --config-name: the config file in it")
        return config
    name = args.config_name.removesuffix(".yaml")
    if name == VERL_MEGATRON_CONFIG:
        raise megatron_refusal(f"--config-name={args.config_name}")
    if name == VERL_DEFAULTS:  # verl's scripts name it with --config-path=config: verl's own directory
        return None
    return os.path.join(config_path, f"{name}.yaml") if config_path else f"{name}.yaml"


# ---------------------------------------------------------------------- a rank's side
def _write(directory: str, name: str, text: str) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, name))


def attach() -> None:
    """Under the launcher: send this rank's output to its log file, register its pid (for the
    launcher's signals) and take back the signals torchrun was told to ignore."""
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    if not launch_dir:
        return
    rank = rank_from_env()
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(os.environ[LOG_DIR_ENV], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(launch_dir, f"rank{rank}.exit"))  # left by a restarted attempt
    _write(launch_dir, f"rank{rank}.pid", str(os.getpid()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _hold_stop_signals()


def _hold_stop_signals() -> None:
    """A stop signal that arrives before the trainer installs its handlers (at the start of
    training) is held and delivered again once they are in place: a preemption during start-up
    then stops the run at the first step boundary, with a checkpoint, instead of being lost."""
    held: list[int] = []

    def hold(signum, frame):
        held.append(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, hold)

    def redeliver():
        while any(signal.getsignal(s) is hold for s in STOP_SIGNALS):
            time.sleep(0.5)
        for s in dict.fromkeys(held):
            os.kill(os.getpid(), s)

    threading.Thread(target=redeliver, name="meshppo-held-signals", daemon=True).start()


def finish(code: int) -> int:
    """The rank's exit code. Under the launcher a deliberate exit (0 finished or preempted,
    1 input error, 2 config error, 3 stopped) is recorded for it, and the rank exits 0;
    `RESTART_EXIT` is not recorded: the rank exits with it, so torchrun restarts the ranks."""
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    if not launch_dir or code == RESTART_EXIT:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    _write(launch_dir, f"rank{rank_from_env()}.exit", str(code))
    return 0


# A rank whose collective failed while no rank had stopped on an error of its own (a peer hung or crashed,
# a node was lost): a restart can fix that, so the rank exits non-zero and torchrun restarts the ranks
# (--max-restarts), which resume from the newest checkpoint.
RESTART_EXIT = 4
_STOPPED_ON_ERROR = "stopped_on_error"  # the key in the attempt's store: how many ranks did


def stopping_on_error(code: int) -> int:
    """`code` (1-3: this rank stops on an error of its own), once the ranks' store counts it: a peer
    whose collective then fails (this rank leaves it) reads it there and stops without a restart
    (`collective_failure_exit`), as a restart would meet the same error."""
    if world_size_from_env() > 1:
        with contextlib.suppress(dist.DistError):  # no store left to tell (rank 0 hosted it and is gone)
            _attempt_store().add(_STOPPED_ON_ERROR, 1)
    return code


def collective_failure_exit() -> int:
    """The exit code of a rank whose collective timed out or lost its peer: 1 (an error, no restart)
    where another rank stopped on an error of its own (`stopping_on_error`), else `RESTART_EXIT`."""
    if world_size_from_env() == 1:
        return RESTART_EXIT
    try:
        stopped = _attempt_store().add(_STOPPED_ON_ERROR, 0) > 0  # (adding 0 reads it without waiting)
    except dist.DistError:  # the store went with its host (rank 0, outside torchrun): nobody to ask
        stopped = False
    return 1 if stopped else RESTART_EXIT


RUN_LOCK = ".lock"  # in the run directory: held by the run's rank 0 (`holding_run_dir`)


def _locked_run_dir(run_dir: str, how: int):
    """`run_dir`'s lock file, open and locked `how` (fcntl.LOCK_EX or LOCK_SH) without waiting; None
    where the file system has no locks. A ConfigError naming the directory and the process holding it
    where another launch's rank 0 does."""
    from trainer.configlib import ConfigError

    os.makedirs(run_dir, exist_ok=True)
    f = open(os.path.join(run_dir, RUN_LOCK), "a+")  # (not truncated: the holder's name is in it)
    try:
        fcntl.flock(f, how | fcntl.LOCK_NB)
        return f
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its name yet"
        f.close()
        raise ConfigError(f"trainer.default_local_dir={run_dir} is in use by another run ({holder}, which holds "
                          f"{os.path.join(run_dir, RUN_LOCK)}): let it end or stop it, or give this run another "
                          "trainer.default_local_dir (or trainer.experiment_name)") from None
    except OSError:  # ENOLCK, EOPNOTSUPP: a file system mounted without locks
        f.close()
        return None


@contextlib.contextmanager
def holding_run_dir(run_dir: str, holder: str = "rank 0"):
    """The hold on `run_dir` for the run of `holder` (rank 0, or a one-node launch's launcher, whose
    ranks start seconds later: held from its check on, a second launch in between is refused before
    it touches the directory). The lock goes with the process however it ends, so a torchrun restart
    or a requeued job takes it again; a ConfigError where another run holds it."""
    f = _locked_run_dir(run_dir, fcntl.LOCK_EX)
    if f is None:
        say(f"meshppo: note: {os.path.join(run_dir, RUN_LOCK)} cannot be locked on this file system: a second "
            "launch into this run directory would not be refused")
        yield None
        return
    with f:
        f.truncate(0)
        f.write(f"{holder}: pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield f


def run_dir_held_by_launcher(run_dir: str) -> bool:
    """Whether this rank's launcher holds `run_dir`'s lock (a one-node launch): rank 0 then takes no lock
    of its own, which the launcher's would refuse."""
    held = os.environ.get(RUN_LOCK_ENV)
    return bool(held) and os.path.realpath(held) == os.path.realpath(run_dir)


def check_run_dir_free(run_dir: str) -> None:
    """The launcher's check, before any rank starts (and before its logs go into `run_dir`), that no run
    holds `run_dir` (a ConfigError naming it and the holder). A shared lock taken and dropped at once:
    the launchers of one multi-node launch, checking at the same moment, do not refuse each other."""
    f = _locked_run_dir(run_dir, fcntl.LOCK_SH)
    if f is not None:
        f.close()


# ---------------------------------------------------------------------- the launcher
class _Launch:
    """One torchrun on this node, its ranks' signals and output, and the report at the end."""

    def __init__(self, cfg, args, nproc: int, run_dir_lock=None):
        self.cfg, self.args, self.nproc = cfg, args, nproc
        # this launcher's hold on the run directory for its ranks (`holding_run_dir`'s file), which torchrun
        # shares, so that it outlives a launcher killed without its ranks
        self.run_dir_lock = run_dir_lock
        self.log_dir = os.path.abspath(args.log_dir or os.path.join(cfg.trainer.default_local_dir, "logs"))
        self.launch_dir = tempfile.mkdtemp(prefix="meshppo-launch-")
        self.torchrun_log = os.path.join(self.log_dir, f"torchrun-{socket.gethostname()}.log")
        self.stop_signal: int | None = None
        self.notice: int | None = None  # a first stop signal not yet announced
        self.aborted = False  # a second Ctrl-C killed everything
        self.stopped_early = False  # a stop signal came before any rank of this node started
        self.error_seen: float | None = None  # when a rank first recorded an error exit
        self.cut_short: tuple[int, list[int]] | None = None  # (the failed rank, the ranks stopped after it)
        self.signalled: set[int] = set()  # rank pids the stop signal has reached
        self.proc: subprocess.Popen | None = None
        self.launch_id = f"meshppo-{uuid.uuid4().hex[:12]}"  # the ranks' TORCHELASTIC_RUN_ID

    def command(self) -> list[str]:
        a = self.args
        # An explicit c10d rendezvous rather than --standalone: restarted workers
        # (--max-restarts) hang in init_process_group under --standalone (torch 2.13).
        endpoint = a.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={a.nnodes}",
                f"--nproc-per-node={self.nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={a.rdzv_id or self.launch_id}", f"--max-restarts={a.max_restarts}", TRAIN_SCRIPT,
                *(["--config", a.config] if a.config else []), *a.overrides]

    def environment(self) -> dict[str, str]:
        """torchrun's and its ranks' environment."""
        env = dict(os.environ, **{LAUNCH_DIR_ENV: self.launch_dir, LOG_DIR_ENV: self.log_dir},
                   PYTHONUNBUFFERED="1",
                   # torchrun handles only SIGQUIT: the ignored signals below stay ignored in it.
                   PET_SIGNALS_TO_HANDLE="SIGQUIT")
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
        env.pop(RUN_LOCK_ENV, None)
        if self.run_dir_lock is not None:
            env[RUN_LOCK_ENV] = os.path.realpath(self.cfg.trainer.default_local_dir)
        return env

    def run(self) -> int:
        os.makedirs(self.log_dir, exist_ok=True)
        rank0_log = os.path.join(self.log_dir, "rank0.log")
        self.offset = os.path.getsize(rank0_log) if os.path.exists(rank0_log) else 0
        env = self.environment()
        with open(self.torchrun_log, "ab") as out:
            # Ignored dispositions are inherited through fork and exec, so torchrun starts with them.
            previous = {s: signal.signal(s, signal.SIG_IGN) for s in LAUNCHER_SIGNALS}
            try:
                self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env,
                                             pass_fds=(self.run_dir_lock.fileno(),) if self.run_dir_lock else ())
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        for s in LAUNCHER_SIGNALS:
            signal.signal(s, self._on_signal)
        try:
            while self.proc.poll() is None:
                self._pump()
                time.sleep(0.2)
            self._pump()
            return self._report(self.proc.returncode)
        finally:
            shutil.rmtree(self.launch_dir, ignore_errors=True)

    def _rank_pids(self) -> dict[int, int]:
        pids = {}
        for name in os.listdir(self.launch_dir):
            # `_write` renames complete files into place (its temporaries start with "."), so a
            # listed pid file is whole.
            if name.startswith("rank") and name.endswith(".pid"):
                with open(os.path.join(self.launch_dir, name)) as f:
                    pids[int(name[4:-4])] = int(f.read())
        return pids

    def _on_signal(self, signum, frame):
        # No output here: the handler may interrupt a write to stderr in `_pump` (a reentrant
        # write raises); `_pump` prints the notice.
        if signum == signal.SIGINT and self.stop_signal == signal.SIGINT:
            self.aborted = True
            for pid in [*self._rank_pids().values(), self.proc.pid]:
                _kill(pid, signal.SIGKILL)
            return
        if self.stop_signal is None:
            self.notice = signum
        self.stop_signal = signum
        self.signalled.clear()  # (again) to every rank

    def _pump(self) -> None:
        """Forward a pending stop signal to ranks it has not reached (started late or restarted),
        and copy what rank 0 wrote since the last call to our stderr."""
        pids = self._rank_pids()
        if self.stop_signal is not None and not pids and not (self.aborted or self.stopped_early):
            # No rank of this node has started (torchrun is in its rendezvous or starting them): there is
            # nothing to checkpoint, and torchrun ignores SIGTERM, so stop it and what it started now.
            for pid in [*_descendants(self.proc.pid), self.proc.pid]:
                _kill(pid, signal.SIGKILL)
            self.stopped_early, self.notice = True, None
            print(f"meshppo: {signal.Signals(self.stop_signal).name}: stopped before any rank of this node started",
                  file=sys.stderr, flush=True)
            return
        if self.notice is not None:
            again = "; Ctrl-C again to stop at once" if self.notice == signal.SIGINT else ""
            print(f"\nmeshppo: {signal.Signals(self.notice).name} received: the ranks write a checkpoint and "
                  f"exit{again}", file=sys.stderr, flush=True)
            self.notice = None
        if self.stop_signal is not None:
            sig = signal.SIGUSR1 if self.stop_signal == signal.SIGUSR1 else signal.SIGTERM
            for pid in pids.values():
                if pid not in self.signalled:
                    _kill(pid, sig)
                    self.signalled.add(pid)
        self._stop_after_a_rank_error(pids)
        if 0 not in pids:  # rank 0 runs on another node, or has not started
            return
        with open(os.path.join(self.log_dir, "rank0.log"), "rb") as f:
            f.seek(self.offset)
            while chunk := f.read(1 << 16):
                self.offset += len(chunk)
                sys.stderr.buffer.write(chunk)
        sys.stderr.flush()

    def _exit_codes(self, pids: dict[int, int]) -> dict[int, int]:
        """The exit codes the ranks recorded so far (`finish`)."""
        codes = {}
        for r in pids:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(self.launch_dir, f"rank{r}.exit")) as f:
                codes[r] = int(f.read())
        return codes

    def _stop_after_a_rank_error(self, pids: dict[int, int]) -> None:
        """A rank that stopped on an error (a recorded exit code 1-3) leaves the others waiting in
        their next collective until `trainer.nccl_timeout` (10 minutes by default) for a peer that
        is gone. `PEER_GRACE_S` after the first such exit (time for the others to meet the same
        error or their failed collective), the ranks still running are stopped, torchrun first so
        that it restarts nothing."""
        if self.cut_short is not None or self.stop_signal is not None:
            return
        codes = self._exit_codes(pids)
        errors = sorted(r for r, c in codes.items() if c)
        if not errors:  # none, or a restarted rank removed its predecessor's record
            self.error_seen = None
            return
        if self.error_seen is None:
            self.error_seen = time.monotonic()
        if time.monotonic() - self.error_seen < peer_grace_s():
            return
        # still alive: a crashed group's ranks that torchrun is about to restart are not
        running = sorted(r for r in pids if r not in codes and _alive(pids[r]))
        if running:
            self.cut_short = (errors[0], running)
            _kill(self.proc.pid, signal.SIGKILL)
            for r in running:
                _kill(pids[r], signal.SIGKILL)

    def _report(self, returncode: int) -> int:
        if self.stopped_early:
            return 128 + self.stop_signal
        if self.aborted:
            print(f"meshppo: stopped at once by a second Ctrl-C; the last checkpoint is "
                  f"{self._latest_checkpoint() or 'none'}", file=sys.stderr)
            return 128 + signal.SIGINT
        pids = self._rank_pids()
        codes = self._exit_codes(pids)
        if self.cut_short is not None:
            first, running = self.cut_short
            self._show_other_ranks_errors(codes)
            print(f"meshppo: rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} still ran "
                  f"{peer_grace_s():g} s after rank {first}'s error (waiting for it in a collective): the launcher "
                  "stopped them", file=sys.stderr)
            return codes[first]
        failed = sorted(set(pids) - set(codes))
        if returncode != 0 or failed or not pids:
            # A crash, not a user error: show what there is. Rank 0's output is already shown.
            for r in failed:
                if r != 0:
                    _print_tail(os.path.join(self.log_dir, f"rank{r}.log"), f"rank {r}")
            _print_tail(self.torchrun_log, "torchrun")
            who = (f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} crashed" if failed
                   else "torchrun failed")
            print(f"meshppo: {who} (torchrun exit code {returncode}); logs: {self.log_dir}/rank<R>.log and "
                  f"{self.torchrun_log}", file=sys.stderr)
            return returncode or 1
        # A config error first: a peer of the rank that found it has only its failed collective to say.
        code = 2 if 2 in codes.values() else next((codes[r] for r in sorted(codes) if codes[r]), 0)
        if code:
            self._show_other_ranks_errors(codes)
        if code == 0 and self.stop_signal is not None:
            latest = self._latest_checkpoint()
            where = f"checkpoint at {latest}" if latest else "no checkpoint was written"
            how = "preempted" if self.stop_signal in STOP_SIGNALS else "stopped"
            print(f"meshppo: {how} by {signal.Signals(self.stop_signal).name}, {where}; the same command "
                  "resumes it (trainer.resume_mode=auto)", file=sys.stderr)
        return code


    def _show_other_ranks_errors(self, codes: dict[int, int]) -> None:
        """The error lines of this node's other failed ranks that rank 0 did not print: only rank 0's
        log was copied to stderr, and an error of one rank alone (its own checkpoint file) leaves
        rank 0 with nothing but a failed collective to say."""
        seen = {message for _, message in _error_messages(os.path.join(self.log_dir, "rank0.log"))}
        for r in sorted(codes):
            if r == 0 or not codes[r]:
                continue
            for kind, message in _error_messages(os.path.join(self.log_dir, f"rank{r}.log")):
                if message not in seen:
                    seen.add(message)
                    print(f"meshppo: {kind} (rank {r}): {message}", file=sys.stderr)

    def _latest_checkpoint(self) -> str | None:
        from trainer.checkpointing import CheckpointManager

        return CheckpointManager(os.path.join(self.cfg.trainer.default_local_dir, "checkpoints")).latest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (children first), from /proc; empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the rank has already exited
        os.kill(pid, sig)


PEER_GRACE_ENV = "MESHPPO_PEER_GRACE_S"


def peer_grace_s() -> float:
    """Seconds the launcher lets the other ranks run after one stopped on an error (default 30)."""
    from trainer.configlib import ConfigError

    raw = os.environ.get(PEER_GRACE_ENV, "30")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        raise ConfigError(f"{PEER_GRACE_ENV}={raw!r}: give the seconds as a number >= 0")
    return value


def shared_rdzv_id(nnodes: int) -> str:
    """The default --rdzv-id of a launch on several nodes: each node's launcher must give the same, and
    one made up per launcher would never meet the others' (torchrun's rendezvous then times out after
    10 minutes without naming it). The SLURM job's id; a ConfigError outside SLURM."""
    from trainer.configlib import ConfigError

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-id ID, the same on every node (the job's id): each node "
                          "would otherwise make up its own, and the nodes would never meet")
    return job


def check_slurm_step(nnodes: int) -> None:
    """Under `srun` (a SLURM step): one launcher per node, on no more nodes than --nnodes. Each
    launcher starts all of its node's ranks, so more step nodes than --nnodes (single_node.sbatch
    submitted with --nodes=2) or several launcher tasks per node would each run their own copy of
    the training into the same run directory (interleaved metrics, racing checkpoints). Raises
    ConfigError; nothing outside a step (no SLURM_STEP_ID / SLURM_STEP_NUM_NODES)."""
    from trainer.configlib import ConfigError

    env = os.environ
    if "SLURM_STEP_ID" not in env and "SLURM_STEP_NUM_NODES" not in env:
        return

    def number(*names: str) -> int | None:
        for name in names:
            if env.get(name, "").isdigit():
                return int(env[name])
        return None

    nodes = number("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    tasks = number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nodes is not None and nodes > nnodes:
        raise ConfigError(f"this SLURM step runs on {nodes} nodes but --nnodes={nnodes}: each node would run its own "
                          "copy of the training into the same run directory; submit with --nodes="
                          f"{nnodes}, or use launch/slurm/multi_node.sbatch (--nnodes from SLURM_NNODES)")
    if nodes is not None and tasks is not None and tasks > nodes:
        raise ConfigError(f"this SLURM step runs {tasks} tasks on {nodes} node{'s' if nodes > 1 else ''}: the "
                          "launcher starts all of a node's ranks itself, so each extra task would run another copy "
                          "of the training; run one task per node (--ntasks-per-node=1)")


# a rank's error line, and the message in it; a message another rank found first (a reward function's
# `(on rank R)`, another engine replica's rollout, the engine's first TP rank's tools:
# agent.loop.FIRST_TP_RANK) is that rank's
_ERROR_LINE = re.compile(r"meshppo: ((?:config )?error)(?: \(ranks? [\d, ]+\))?: (?:\(on (?:rank \d+|engine replica \d+|"
                         r"the engine's first TP rank, which runs the tools and interactions)\) )?(.*)$")


def _error_messages(path: str) -> list[tuple[str, str]]:
    """The kind ("error", "config error") and message of a rank log's `meshppo: error (rank R): ...`
    lines (a message relayed from another rank counted as that rank's own)."""
    try:
        with open(path, errors="replace") as f:
            # (a line may begin with the end of a progress bar's redraw: searched, not matched)
            return [m.groups() for line in f if (m := _ERROR_LINE.search(line.rstrip("\n")))]
    except FileNotFoundError:
        return []


def _print_tail(path: str, what: str, lines: int = 30) -> None:
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except FileNotFoundError:
        return
    if not tail:
        return
    print(f"meshppo: the end of {what}'s log ({path}):", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.launch",
                                description="meshppo's launcher: torchrun with a pre-flight check of the config, "
                                            "one-line errors with their exit codes, clean preemption, rank 0's "
                                            "output on the terminal (trainer/launch.py explains each)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this node; default: the config's trainer.n_gpus_per_node (checked against it)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (checked against trainer.nnodes)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT of the c10d rendezvous (several nodes); default: a free local port")
    p.add_argument("--rdzv-id", default=None,
                   help="rendezvous id (several nodes: the job id, the same on every node); default: one node: one of "
                        "its own per launch, several nodes: SLURM_JOB_ID (outside SLURM give it); a restart keeps it: "
                        "the checkpoints tell the launch's own by it")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all ranks after a crash this many times (they resume from the last checkpoint)")
    p.add_argument("--log-dir", default=None, help="rank and torchrun logs; default: <trainer.default_local_dir>/logs")
    p.add_argument("--print-config", action="store_true",
                   help="check the config against this launch (--nnodes, --nproc-per-node; on any machine: this "
                        "one's GPUs are checked at launch), print the resolved config and the start-up notes and "
                        "exit (starts no rank)")
    add_config_args(p)
    args = p.parse_intermixed_args(argv)
    from trainer.versions import check_versions

    if code := check_versions():  # before any rank starts
        return code

    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, expand_home, load_config
    from trainer.setup import check_output_dir, preflight

    held, lock = contextlib.ExitStack(), None  # a one-node launch's hold on the run directory, until its ranks are gone
    try:
        for flag, value, least in (("--nproc-per-node", args.nproc_per_node, 1), ("--nnodes", args.nnodes, 1),
                                   ("--max-restarts", args.max_restarts, 0)):
            if value is not None and value < least:
                raise ConfigError(f"{flag} must be at least {least}, got {value}")
        if args.nnodes > 1 and not args.rdzv_endpoint:
            raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the first node's address, the "
                              "same on every node): the default, a free local port, is reachable from this node only")
        if args.nnodes > 1 and not args.rdzv_id:
            args.rdzv_id = shared_rdzv_id(args.nnodes)
        check_slurm_step(args.nnodes)
        peer_grace_s()  # MESHPPO_PEER_GRACE_S is read when a rank fails: check it now
        args.config = config_file(args)  # the ranks get it as --config
        args.log_dir = expand_home(args.log_dir, "--log-dir")
        cfg = load_config(PPOConfig, args.config, args.overrides)
        nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.trainer.n_gpus_per_node
        preflight(cfg, args.nnodes * nproc, nproc, devices=not args.print_config)
        check_output_dir("--log-dir (LOG_DIR)", args.log_dir)
        if not args.print_config and args.nnodes == 1:
            # held before the logs go there, until the ranks are gone: a check alone let a second launch in
            # during the seconds before rank 0 took the lock (both then wrote into the directory)
            lock = held.enter_context(holding_run_dir(cfg.trainer.default_local_dir, "the launcher"))
        elif not args.print_config:  # the launchers of one launch check together; its rank 0 takes the lock
            check_run_dir_free(cfg.trainer.default_local_dir)
    except ConfigError as e:
        held.close()
        print(f"meshppo: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print_config(cfg)
        return 0
    with held:
        return _Launch(cfg, args, nproc, run_dir_lock=lock).run()


def say_start_up_notes(cfg) -> None:
    """The start-up notes on stderr: what the config alone tells (`config_notes`: options without effect,
    values that differ from verl's, ...) and what the actor's model directory does (`model_notes`). Rank 0
    says them at the start of a run, and `--print-config` (`print_config`)."""
    from trainer.config import config_notes
    from trainer.setup import model_notes

    for note in config_notes(cfg) + model_notes(cfg):
        print(f"meshppo: {note}", file=sys.stderr)


def print_config(cfg) -> None:
    """`--print-config`'s output, train_ppo.py's and the launcher's: the resolved config on stdout, a
    comment per option, then the start-up notes (`say_start_up_notes`)."""
    from trainer.configlib import to_commented_yaml

    print(to_commented_yaml(cfg))
    say_start_up_notes(cfg)


# ---------------------------------------------------------------------- the process group
@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_STORE: list = []  # this process's store of the ranks' rendezvous (`_attempt_store`), once made
_CONFIG_ROUNDS: list = []  # the calls of `agreed_config_errors` so far


def _attempt_store():
    """The store the ranks meet in (torchrun's, or rank 0's at MASTER_ADDR:MASTER_PORT; the default
    group's where one exists), made once per process and shared by the config check and the process
    group. torchrun keeps one store across restarts (--max-restarts): keys written by a killed attempt
    (a dead rank's gloo address) would be read by the new one, so each attempt has its own prefix."""
    if not _STORE:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if dist.is_initialized():  # a process group made outside `init_distributed` (tests, embedding code)
            base = dist.distributed_c10d._get_default_store()
        else:
            check_rendezvous_env()
            base, _, _ = next(dist.rendezvous("env://", rank_from_env(), world_size_from_env()))
        _STORE.append(dist.PrefixStore(f"meshppo/attempt_{attempt}", base))
    return _STORE[0]


def check_rendezvous_env() -> None:
    """Several ranks meet at rank 0's MASTER_ADDR:MASTER_PORT, which torchrun sets: a ConfigError
    naming them where they are missing (each rank left on its own would wait for the others until
    torch's 30-minute timeout; a default port would be each rank's own)."""
    from trainer.configlib import ConfigError

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world_size_from_env()} but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: the ranks meet at rank 0's "
                          "MASTER_ADDR:MASTER_PORT, the same on every rank; launch with torchrun or python -m "
                          "trainer.launch, which set them, or set them yourself")


def agreed_config_errors(error: str | None) -> list[tuple[str, list[int]]]:
    """Every rank's config error (`error`: this rank's, None when its check passed), agreed through
    the ranks' store before any process group: the distinct messages with the ranks that found them,
    in rank order, the same list on every rank (empty: every rank may start). A config error can be
    one rank's alone (a `${oc.env:...}` value, a node's disk, packages or GPUs), and under plain
    torchrun nobody printed a non-zero rank's. Rank 0 reads each rank's report, then writes the verdict."""
    world = world_size_from_env()
    if world == 1:
        return [(error, [0])] if error is not None else []
    _CONFIG_ROUNDS.append(None)  # each call its own keys (the store lives as long as the process)
    store, rank = dist.PrefixStore(f"config{len(_CONFIG_ROUNDS)}", _attempt_store()), rank_from_env()
    store.set(f"rank{rank}", error or "")
    if rank == 0:
        found: dict[str, list[int]] = {}
        for r in range(world):  # (get waits for the key)
            message = store.get(f"rank{r}").decode()
            if message:
                found.setdefault(message, []).append(r)
        store.set("verdict", json.dumps(list(found.items())))
    return [(message, ranks) for message, ranks in json.loads(store.get("verdict").decode())]


def config_error_lines(errors: list[tuple[str, list[int]]], world: int) -> list[str]:
    """`agreed_config_errors`' list as rank 0 says it: one line, as a single process would, when every
    rank found the same error; else each error with the ranks that found it."""
    if len(errors) == 1 and len(errors[0][1]) == world:
        return [f"meshppo: config error: {errors[0][0]}"]
    return [f"meshppo: config error (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): {message}"
            for message, ranks in errors]


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistContext:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) from torchrun's env.

    A single process without torchrun's variables still gets a (world size 1) group, so the
    rest of the code has one path: FSDP2 and DTensor need a process group. `timeout_s`
    (`trainer.nccl_timeout`) bounds how long a collective waits for the other ranks.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available on this machine")
    rank, world = rank_from_env(), world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = local_world_size_from_env()
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        kwargs = {"device_id": dev} if device == "cuda" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        # One rank meets nobody: an in-memory store, no socket (a port inherited from an
        # earlier run in the same environment may still be taken).
        store = dist.HashStore() if world == 1 else dist.PrefixStore("group", _attempt_store())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        # No rank goes on before every rank has finished connecting: a rank that then stops at
        # once (bad data) would otherwise close its sockets under a peer still inside gloo's
        # connectFullMesh, which fails with a traceback instead of the one-line error.
        dist.barrier()
        owns = True
    return DistContext(rank, world, local_rank, local_world, dev, owns)


if __name__ == "__main__":
    sys.exit(main())
