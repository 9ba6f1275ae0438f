"""Host cost of planning micro-batches and rank balance (`trainer/batching.py`), on the CPU.

    python bench/microbatch_plan.py                                # rows 512/2048/4096/8192, 16/64/264 parts
    python bench/microbatch_plan.py --rows 4096 --parts 264 --repeats 5

Per rank `rows` rows of a 512-token prompt and a response of lognormal length (median 1000
tokens, sigma 1, capped at 8192: a long tail), drawn from `--seed`. For every `parts` target the
token budget is ceil(tokens / parts), and one JSON line gives the milliseconds of CPU time of the
process (median over `--repeats`; single-threaded Python, so on a shared machine more stable than
the wall time, which `token_budget_wall_ms` gives too) of

- `token_budget_ms`: `token_budget_partitions` of the rank's rows under that budget (one rank:
  its count rounds, each a `balanced_partitions`), with the count it reached (`count`, `rounds`);
- `balanced_ms`: one `balanced_partitions` of the rows' work into that count of parts;
- `equal_ms`: `balanced_equal_partitions` of the rows' work into `--ranks` parts (the rank
  balance of a batch of that many rows; rows rounded down to a multiple of the ranks).

Automatic garbage collection is off while a call is timed, as during a trainer step
(`trainer/gc_control.py`), and a collection runs between calls; `--gc` leaves it on (then a
collection of every generation that a call's allocations start scans all of the process's objects,
torch's among them, and lands in that call's time).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import emit  # noqa: E402
from trainer.batching import (balanced_equal_partitions, balanced_partitions, seqlen_workload,  # noqa: E402
                              token_budget_partitions)

PROMPT = 512
MAX_RESPONSE = 8192


def lengths(rows: int, seed: int) -> list[int]:
    """A rank's rows' tokens: the prompt and a lognormal response (median 1000, sigma 1, at most 8192)."""
    rng = np.random.default_rng(seed)
    response = np.minimum(np.rint(rng.lognormal(math.log(1000), 1.0, rows)), MAX_RESPONSE).astype(np.int64)
    return (PROMPT + np.maximum(response, 1)).tolist()


def timed(fn, repeats: int, collect: bool) -> tuple[float, float, object]:
    """Median CPU and wall milliseconds of `fn()` over `repeats` calls, and its result; automatic
    garbage collection off during each call unless `collect`."""
    out, cpu, wall = None, [], []
    for _ in range(repeats):
        gc.collect()
        if not collect:
            gc.disable()
        try:
            c0, t0 = time.process_time(), time.perf_counter()
            out = fn()
            cpu.append((time.process_time() - c0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        finally:
            gc.enable()
    return round(statistics.median(cpu), 2), round(statistics.median(wall), 2), out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="512,2048,4096,8192", help="rows per rank, comma-separated")
    p.add_argument("--parts", default="16,64,264", help="target micro-batch counts, comma-separated")
    p.add_argument("--ranks", type=int, default=8, help="parts of the equal-size (rank) balance")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gc", action="store_true", help="leave automatic garbage collection on while timing")
    args = p.parse_args(argv)
    for rows in (int(r) for r in args.rows.split(",")):
        tokens = lengths(rows, args.seed)
        work = seqlen_workload(tokens)
        even = work[:rows - rows % args.ranks]
        equal_ms, _, _ = timed(lambda: balanced_equal_partitions(even, args.ranks), args.repeats, args.gc)
        for target in (int(t) for t in args.parts.split(",")):
            budget = -(-sum(tokens) // target)
            budget_ms, budget_wall_ms, parts = timed(lambda: token_budget_partitions([tokens], [work], budget),
                                                     args.repeats, args.gc)
            count = len(parts[0])
            balanced_ms, _, _ = timed(lambda: balanced_partitions(work, count), args.repeats, args.gc)
            first = min(rows, -(-sum(tokens) // budget))
            emit("microbatch_plan", {"rows": rows, "parts_target": target, "max_tokens": budget,
                                     "tokens": sum(tokens), "ranks": args.ranks, "repeats": args.repeats,
                                     "seed": args.seed, "gc": args.gc},
                 count=count, rounds=count - first + 1, token_budget_ms=budget_ms,
                 token_budget_wall_ms=budget_wall_ms, balanced_ms=balanced_ms, equal_ms=equal_ms)


if __name__ == "__main__":
    main()
