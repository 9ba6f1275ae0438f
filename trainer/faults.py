"""Fault injection for the reliability tests, driven by the MESHPPO_FAULTS environment variable.

    MESHPPO_FAULTS="nan_grad@2,sigkill@3:1,sigterm@3,crash_in_save@4"

`name@step[:rank]` (rank defaults to every rank); a fault may be listed more than once (at other
steps or ranks), and a name or an item meshppo does not know is refused naming it:

* `nan_grad@K`   — the actor's gradients are NaN in step K (the optimizer step must be skipped)
* `sigkill@K:R`  — rank R kills itself with SIGKILL at the start of step K, on the first launch
                   only (torchrun's restarts see TORCHELASTIC_RESTART_COUNT > 0)
* `sigterm@K:R`  — rank R sends itself SIGTERM at the start of step K (preemption)
* `crash_in_save@K` — the process dies half-way through writing the checkpoint of step K
* `crash_before_publish@K` — the process dies once the checkpoint of step K is written, before it
                   is put in place (the `latest` pointer still names the one before)
* `crash_after_publish@K` — the process dies right after the checkpoint of step K is put in place
* `hang@K:R`     — rank R stops for 120 s at the start of step K (the others' collectives time out),
                   on the first launch only

Step 0 is the run's start, before its first collective (the agreed start of its logs).

Unset in normal runs: every hook is then a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import os
import signal
import time


NAMES = ("nan_grad", "sigkill", "sigterm", "crash_in_save", "crash_before_publish", "crash_after_publish", "hang")


def _parse(spec: str) -> dict[str, list[tuple[int, int | None]]]:
    faults: dict[str, list[tuple[int, int | None]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, where = item.partition("@")
        step, colon, rank = where.partition(":")
        if not name or not step.isdigit() or colon and not rank.isdigit():
            raise ValueError(f"MESHPPO_FAULTS item {item!r} must look like name@step[:rank] (step and rank: "
                             "non-negative integers)")
        if name not in NAMES:
            raise ValueError(f"MESHPPO_FAULTS item {item!r}: unknown fault {name!r}; known: {', '.join(NAMES)}")
        faults.setdefault(name, []).append((int(step), int(rank) if rank else None))
    return faults


FAULTS = _parse(os.environ.get("MESHPPO_FAULTS", ""))


def armed(name: str, step: int, rank: int) -> bool:
    return any(at == step and (who is None or who == rank) for at, who in FAULTS.get(name, ()))


def at_step_start(step: int, rank: int) -> None:
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if armed("sigkill", step, rank) and first_launch:
        os.kill(os.getpid(), signal.SIGKILL)
    if armed("sigterm", step, rank):
        os.kill(os.getpid(), signal.SIGTERM)
    if armed("hang", step, rank) and first_launch:
        time.sleep(120)


def poison_grads(model, step: int, rank: int) -> None:
    if armed("nan_grad", step, rank):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
                return


def crash(name: str, step: int, rank: int) -> None:
    """The process dies (exit code 17) where fault `name` (`crash_in_save`, `crash_before_publish`,
    `crash_after_publish`) is armed for this step and rank."""
    if armed(name, step, rank):
        os._exit(17)
