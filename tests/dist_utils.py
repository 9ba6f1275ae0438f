"""Run a function on N CPU processes with the gloo backend (multi-rank tests).

    def _body(rank, world_size, tmp):      # module-level so it pickles
        ...assertions...

    def test_something(tmp_path):
        run_distributed(_body, 2, str(tmp_path))

Each process gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set and a
default process group initialised; a failure on any rank fails the test with that rank's
traceback.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports anyway, imported once in the fork server: a rank then starts in well
# under a second instead of importing these anew (torch about 3 s of a 2-core machine's time a rank;
# torch._dynamo, which meshppo's models import through `torch.compiler.disable`, and transformers
# about 1.5 s each). Nothing that reads the environment at import time beyond torch itself, and
# nothing of meshppo's: triton reads TRITON_INTERPRET when a kernel is decorated (`@triton.jit`, at
# the import of meshppo's kernel modules), so the ranks import those after `_worker` set their
# environment. torch._dynamo imports triton itself, whose own `@triton.jit` helpers are then compiled
# ones: a rank that runs kernels under the interpreter (TRITON_INTERPRET=1) needs a process that has
# not imported triton yet, `run_distributed(..., triton_interpret=True)`.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch._dynamo", "transformers"]


def _adopt(parent: int, cwd: str, environ: dict) -> None:
    """Give a rank forked from the server what a spawned one inherits from the test process now: its
    environment, working directory, and stdout / stderr (which pytest points at each test's capture;
    the server kept the ones of the test during which it started). Outputs are reopened through
    /proc in append mode; without /proc the rank keeps the server's."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd in (1, 2):
        try:
            new = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(new, fd)
        os.close(new)


def _worker(rank, world_size, port, fn, args, errors, parent, preloaded):
    _adopt(*parent)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if not preloaded and os.environ.get("TRITON_INTERPRET") == "1":
        from tests.interpreter import patch_language_once_a_launch

        patch_language_once_a_launch()
    # A rank that dies in native code (a signal, an abort) leaves no traceback in the queue; its
    # Python stacks then go to stderr, which the test captures.
    faulthandler.enable(all_threads=True)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        # No rank tears gloo down while a peer is still inside its last collective: that can
        # abort the process ("terminate called without an active exception") after a pass.
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    except BaseException:
        tb = traceback.format_exc()
        if preloaded and os.environ.get("TRITON_INTERPRET") == "1":
            tb += ("\n(TRITON_INTERPRET=1 was set in a rank forked with triton already imported, where it does not "
                   "take: pass triton_interpret=True to run_distributed)")
        errors.put((rank, tb))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A passed rank leaves without the interpreter's teardown: destroying gloo's (and subgroups')
    # background threads at exit can still abort the process ("terminate called without an
    # active exception", exit -6) after every assertion passed, on a loaded machine.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, triton_interpret: bool = False):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo processes; re-raise the first failure.
    `triton_interpret`: the ranks run Triton kernels under the interpreter (TRITON_INTERPRET=1 in their
    environment), each started afresh (spawned, importing torch itself: a few seconds) since the fork
    server's ranks have triton imported already (PRELOAD); they import triton with the interpreter set,
    and have it patch `triton.language` once a launch (tests/interpreter.py: patch_language_once_a_launch)."""
    if triton_interpret:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    errors = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ, TRITON_INTERPRET="1") if triton_interpret else dict(os.environ)
    parent = (os.getpid(), os.getcwd(), environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors, parent, not triton_interpret))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failures = _collect(procs, errors, timeout)
    # Every rank's exit: a rank killed by a signal (exit code -N) shows here even when only its
    # peer's failed collective ("Connection reset by peer") reached the queue.
    codes = ", ".join(f"rank {i}: {_exit_name(p.exitcode)}" for i, p in enumerate(procs))
    if failures:
        rank, tb = failures[0]
        raise AssertionError(f"rank {rank} failed first ({codes}):\n{tb}")
    if any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"processes exited abnormally ({codes})")


# How long the other ranks get, once one has failed, to stop by themselves (a peer of a failed rank
# usually fails at its next collective, as the failed rank's sockets close) before they are killed.
FAILURE_GRACE_S = 20.0


def _collect(procs, errors, timeout: float) -> list[tuple[int, str]]:
    """Wait for the ranks, reading their tracebacks from `errors` as they come: a traceback larger than
    the pipe's buffer (64 KiB) blocks its rank in `put` until it is read, so reading only after the
    ranks ended would wait out the timeout and then block on the half-read message. Ranks still running
    `timeout` seconds after the start, or `FAILURE_GRACE_S` after the first failure, are killed (a timeout used
    to be `timeout` a rank, waited for one after the other).
    The failures in the order they arrived: the first is the likeliest cause."""
    failures = []
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_alive()]
        while not errors.empty():
            failures.append(errors.get())
        if not alive:
            break
        if failures:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if time.monotonic() >= deadline:
            for p in alive:
                p.kill()
            for p in alive:
                p.join()
            break  # not read again: a rank killed inside `put` left half a message
        wait([p.sentinel for p in alive], timeout=0.05)
    for p in procs:
        p.join()
    return failures


def _exit_name(code: int | None) -> str:
    """`multiprocessing`'s exit code in words: None (still running), N, or -N (killed by signal N)."""
    if code is None:
        return "still running (killed after the timeout)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"
