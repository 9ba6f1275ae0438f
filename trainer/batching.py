"""Splitting rollouts over ranks, mini-batches and micro-batches (on the host).

Every rank must run the same number of forward/backward passes (each FSDP forward is a
collective), so the helpers here return partitions whose counts are agreed on across
ranks by the caller; they balance the work (token counts, ~ attention and matmul cost)
inside that constraint. `Ragged` holds a batch's token rows (ids, log-probs, masks) as one flat
array with offsets.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import numpy as np


def balanced_equal_partitions(costs: list[int], k: int) -> list[list[int]]:
    """Split indices into `k` parts of equal size (len(costs) % k == 0), balancing total cost.

    Longest-processing-time greedy with a size cap: take items by decreasing cost and give
    each to the lightest part that still has room. Parts come back sorted by index so a
    part keeps the original order of its items.
    """
    n = len(costs)
    if n % k:
        raise ValueError(f"{n} items cannot be split into {k} equal parts")
    cap = n // k
    order = sorted(range(n), key=lambda i: -costs[i])
    heap = [(0, p) for p in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < cap:  # a full part leaves the heap for good
            heapq.heappush(heap, (load + costs[i], p))
    return [sorted(p) for p in parts]


def prompt_groups(prompts: list[list[int]]) -> np.ndarray:
    """Each row's group under prefix sharing: the index of the first row with the same prompt
    tokens (rows with an empty prompt share nothing: their own index)."""
    first: dict[tuple[int, ...], int] = {}
    return np.fromiter((first.setdefault(tuple(p), i) if p else i for i, p in enumerate(prompts)), dtype=np.int64,
                       count=len(prompts))


class PrefixGroups(NamedTuple):
    """Rows' prompt groups for prefix sharing (`RolloutBatch.prefix_groups`): each row's group
    (`prompt_groups`), and the rows' prompt and response lengths."""

    leaders: np.ndarray
    prompt_lengths: list[int]
    response_lengths: list[int]


def shared_prefix_items(indices: list[int], leaders: np.ndarray, prompt_lengths: list[int],
                        response_lengths: list[int], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """`indices` cut into items for token-budget packing when rows with one prompt share it: the
    rows of a group (same `leaders` entry), in order, as few items as keep `prompt + responses`
    under `max_tokens` (a row above it alone), and each item's tokens, its prompt counted once.
    Items come in the order of their groups' first rows."""
    items: list[list[int]] = []
    costs: list[int] = []
    open_item: dict[int, int] = {}  # group -> its item still being filled
    for i in indices:
        g, lp, lr = int(leaders[i]), prompt_lengths[i], response_lengths[i]
        k = open_item.get(g)
        if k is not None and costs[k] + lr <= max_tokens:
            items[k].append(i)
            costs[k] += lr
            continue
        open_item[g] = len(items)
        items.append([i])
        costs.append(lp + lr)
    return items, costs


def balanced_group_partitions(groups: PrefixGroups, k: int) -> list[list[int]] | None:
    """`balanced_equal_partitions` of whole prompt groups: `k` parts of equally many rows, each
    group's rows in one part, balancing the tokens a part runs with each prompt once. None when the
    groups cannot give equal parts that way (groups of unequal sizes, or a group count that `k`
    does not divide)."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.leaders.tolist()):
        members.setdefault(g, []).append(i)
    rows = list(members.values())
    if len({len(m) for m in rows}) != 1 or len(rows) % k:
        return None
    costs = [groups.prompt_lengths[m[0]] + sum(groups.response_lengths[i] for i in m) for m in rows]
    return [sorted(i for g in part for i in rows[g]) for part in balanced_equal_partitions(costs, k)]


def token_budget_partitions(costs: list[int], max_tokens: int, min_parts: int = 1) -> list[list[int]]:
    """Group indices into as few parts as fit under `max_tokens` each (at least `min_parts`),
    balancing the parts' costs without ever exceeding the budget.

    The budget is a memory promise: a part's total cost never exceeds `max_tokens`, except a
    part made of a single item above the budget (it cannot be split). The number of parts is
    what the caller all-reduces (max) across ranks before calling again with `min_parts` set,
    so every rank runs the same number of micro-batches; the result always has exactly
    `max(first-fit-decreasing count, min_parts)` parts (some may be empty).
    """
    if not costs:
        return [[] for _ in range(min_parts)]
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    # First-fit decreasing gives the count, and a packing that keeps the budget.
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + costs[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += costs[i]
                break
        else:
            bins.append([i])
            loads.append(costs[i])
    k = max(len(bins), min_parts)
    balanced = _balanced_under_budget(costs, order, max_tokens, k)
    parts = balanced if balanced is not None else bins + [[] for _ in range(k - len(bins))]
    return [sorted(p) for p in parts]


def _balanced_under_budget(costs: list[int], order: list[int], max_tokens: int, k: int) -> list[list[int]] | None:
    """Longest-first: each item (in `order`, by decreasing cost) goes to the lightest of the `k`
    parts that it fits in; an item above the budget takes an empty part. None when some item
    fits nowhere (greedy can fail where first-fit decreasing succeeded)."""
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        c = costs[i]
        fits = [p for p in range(k) if (loads[p] + c <= max_tokens) or (c > max_tokens and not parts[p])]
        if not fits:
            return None
        p = min(fits, key=lambda q: (loads[q], q))
        parts[p].append(i)
        loads[p] += c
    return parts


class Ragged:
    """Rows of different lengths in one flat NumPy array (`flat`; row i is `flat[offsets[i]:offsets[i + 1]]`):
    a batch's token ids, log-probs and turn masks, held compactly on the host (4 bytes a token id or
    log-prob, where a list of Python ints cost 36 bytes a token above id 256 and of floats 32) and pickled
    as raw buffers. A row reads as a list (`ragged[i]`, iteration); `take` and `concat` work on the arrays."""

    __slots__ = ("flat", "offsets")
    __hash__ = None

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def of(cls, rows, dtype) -> Ragged:
        """`rows` (a `Ragged`, kept as it is, or sequences of numbers) as a `Ragged` of `dtype`."""
        if isinstance(rows, Ragged):
            return rows
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
        return cls(flat, _offsets(lengths))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        i = range(len(self))[i]  # (a negative index counted from the end; out of range raises IndexError)
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()

    def __iter__(self):
        bounds = self.offsets.tolist()
        return (self.flat[a:b].tolist() for a, b in zip(bounds, bounds[1:]))

    def __eq__(self, other) -> bool:  # row by row, as lists (a test's expected rows)
        return len(self) == len(other) and all(a == list(b) for a, b in zip(self, other))

    def take(self, idx) -> Ragged:
        """The rows `idx`, in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        starts, lengths = self.offsets[idx], self.lengths()[idx]
        offsets = _offsets(lengths)
        positions = np.arange(int(offsets[-1])) + np.repeat(starts - offsets[:-1], lengths)
        return Ragged(self.flat[positions], offsets)

    @staticmethod
    def concat(parts: list[Ragged]) -> Ragged:
        if not parts:
            return Ragged(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))
        return Ragged(np.concatenate([p.flat for p in parts]), _offsets(np.concatenate([p.lengths() for p in parts])))

    def padded(self, width: int) -> np.ndarray:
        """`[rows, width]` float32, each row's values first, zeros after."""
        out = np.zeros((len(self), width), dtype=np.float32)
        out[np.arange(width) < self.lengths()[:, None]] = self.flat
        return out


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
