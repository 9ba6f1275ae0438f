"""Worker processes that call a reward function, each call with a time limit (the pool of verl's
`prime` reward manager).

The workers are spawned (fresh interpreters: a fork would copy the trainer's threads' locks in
whatever state they are), and each loads the reward function itself from the file or module the
config names, so a function defined in a file needs no pickling. A call that runs past the limit
has its worker killed (with any process it started) and replaced; a worker that dies (a crash in
native code, `os._exit`) takes only its own call with it. The workers start at the first call
and live until `close`; on Linux each also dies with the trainer, however the trainer ends.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from rewards.registry import REWARD_FN_ARGS, RewardError, call_failure, describe_fn, get_reward_fn


@dataclass(frozen=True)
class Outcome:
    """One call's end: `ok` (`value`: what the function returned), `raised` (`value`: the message
    naming the function, sample and line), `timeout` or `crashed` (`value`: the worker's exit code)."""

    kind: str
    value: Any = None


@dataclass(frozen=True)
class FnSpec:
    """Where a worker loads the reward function from: `get_reward_fn`'s arguments (no path: the
    built-in `default_compute_score`)."""

    path: str | None
    name: str
    reward_kwargs: dict


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it (the trainer's main thread) ends
    (PR_SET_PDEATHSIG), or now if that has already happened."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        if os.getppid() != multiprocessing.parent_process().pid:
            os._exit(1)


def _serve(conn, spec: FnSpec) -> None:
    """A worker: load the function, say `ready`, then answer each `(where, args)` with `fn(*args)`'s outcome."""
    os.setpgrp()  # its own process group: a kill on timeout reaches whatever the function started
    _die_with_parent()
    try:
        fn = get_reward_fn(spec.path, spec.name, spec.reward_kwargs, args=REWARD_FN_ARGS, keywords=())
    except Exception as err:
        conn.send(("load_error", f"{type(err).__name__}: {err}"))
        return
    name, path = describe_fn(fn)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        where, args = task
        try:
            result = fn(*args)
        except Exception as err:
            conn.send(("raised", call_failure(name, where, err, path)))
            continue
        try:
            conn.send(("ok", result))
        except Exception as err:  # pickled whole before anything is written: the pipe stays clean
            conn.send(("raised", f"reward function {name} returned {type(result).__name__} on {where}, which "
                                 f"cannot be sent back from its worker process ({type(err).__name__}: {err})"))


class _Worker:
    def __init__(self, ctx, spec: FnSpec):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec), daemon=True, name="meshppo-reward")
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.row: int | None = None  # the row of the call in flight
        self.deadline = 0.0

    def receive(self) -> tuple[str, Any] | None:
        """The worker's next message if one has come; None if none has, or the worker has closed its end (died)."""
        if self.conn.closed or not self.conn.poll():
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.kill()  # on its way out (or its pipe broken): reaped now, for its exit code
            return None
        except (pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError, RuntimeError) as err:
            # a result read whole that cannot be rebuilt here: that call's failure
            return ("raised", f"a reward function's result from a worker process cannot be read in the trainer "
                              f"({type(err).__name__}: {err}); return numbers, or dicts of them")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # not yet in its own group, or already gone
            self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardPool:
    """Up to `processes` workers calling the function of `spec` positionally, as verl's prime manager
    calls it; `timeout_s` per call, counted from its dispatch to an idle worker, and
    `start_timeout_s` for a worker to load the function."""

    def __init__(self, spec: FnSpec, processes: int, timeout_s: float, start_timeout_s: float = 300.0):
        self.spec, self.processes = spec, processes
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def map(self, calls: list[tuple[str, tuple]]) -> list[Outcome]:
        """The outcome of `fn(*args)` for each `(where, args)` of `calls` (`where`: the sample, for
        messages), in order. Raises `RewardError` if a worker cannot load the function."""
        try:
            return self._map(calls)
        except BaseException:
            self.close()  # calls may be in flight: no worker is left holding one
            raise

    def _map(self, calls: list[tuple[str, tuple]]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(calls)
        todo = collections.deque(range(len(calls)))
        while len(self._workers) < min(self.processes, len(calls)):
            self._workers.append(_Worker(self._ctx, self.spec))
        while todo or any(w.row is not None for w in self._workers):
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.ready and w.row is None and todo:
                    try:
                        w.conn.send(calls[todo[0]])
                    except OSError:  # it died idle: its replacement takes the call
                        self._workers[k] = self._replace(w)
                        continue
                    w.row, w.deadline = todo.popleft(), now + self.timeout_s
            # every worker still loading or calling has a deadline, and one of them is
            deadline = min(w.deadline if w.ready else w.started + self.start_timeout_s
                           for w in self._workers if w.row is not None or not w.ready)
            multiprocessing.connection.wait([h for w in self._workers for h in (w.conn, w.proc.sentinel)],
                                            timeout=max(0.0, deadline - now))
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                message = w.receive()
                if message is not None:
                    kind, value = message
                    if kind == "load_error":
                        raise RewardError(f"a reward worker process could not load the reward function: {value}")
                    if kind == "ready":
                        w.ready = True
                    else:
                        out[w.row], w.row = Outcome(kind, value), None
                elif w.conn.closed or not w.proc.is_alive():
                    if not w.ready:
                        raise RewardError(f"a reward worker process exited with code {w.proc.exitcode} while loading "
                                          "the reward function")
                    if w.row is not None:
                        out[w.row] = Outcome("crashed", w.proc.exitcode)
                    self._workers[k] = self._replace(w)
                elif w.row is not None and now >= w.deadline:
                    out[w.row] = Outcome("timeout")
                    self._workers[k] = self._replace(w)
                elif not w.ready and now >= w.started + self.start_timeout_s:
                    raise RewardError(f"a reward worker process did not load the reward function within "
                                      f"{self.start_timeout_s:g} s")
        return out

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        return _Worker(self._ctx, self.spec)

    def close(self) -> None:
        """Stop every worker (killed: a call may still be running); the next `map` starts new ones."""
        for w in self._workers:
            w.kill()
        self._workers = []
