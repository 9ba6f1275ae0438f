"""Python's garbage collector, kept out of the step's hot loops.

A full collection in a process that holds compiled graphs scans millions of objects and takes
tens to hundreds of milliseconds. Left automatic, it starts whenever allocations cross a
threshold: on one rank at a time, in the middle of an update, and every other rank then waits
for that one at the next gradient all-reduce (on two H200s, strong scaling, the 0.5b update's
all-reduces spent 4-12x their transfer time waiting). torchtitan's trainer handles it the same
way: no automatic collection, explicit ones at a point every rank reaches together.
"""

from __future__ import annotations

import contextlib
import gc

FULL_EVERY = 50  # steps between collections of every generation


@contextlib.contextmanager
def collect_after(step: int):
    """Automatic collection off for the block; afterwards the young generations are collected
    (all of them every `FULL_EVERY` steps) and the previous setting is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(2 if step % FULL_EVERY == 0 else 1)
        if enabled:
            gc.enable()
