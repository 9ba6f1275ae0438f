"""Splitting rollouts over ranks, mini-batches and micro-batches (on the host).

Every rank must run the same number of forward/backward passes (each FSDP forward is a
collective), so the helpers here return partitions whose counts are agreed on across
ranks (the caller's collectives); inside that constraint they balance verl 0.9.1's work
estimate of the rows (`seqlen_workload`) by Karmarkar-Karp, as verl does over ranks
(`balanced_equal_partitions`) and over micro-batches (`token_budget_partitions`). `Ragged`
holds a batch's token rows (ids, log-probs, masks) as one flat array with offsets.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Callable, NamedTuple

import numpy as np


def seqlen_workload(lengths: list[int]) -> list[int]:
    """verl 0.9.1's estimate of the work of a row of `s` tokens (prompt + response), which it balances
    over its data-parallel ranks: 24576 s + s², a dense block's matmuls (12 h² s) and attention
    (2 h s²) at h = 4096, divided by 2h. Exact integers."""
    return [24576 * s + s * s for s in lengths]


def balanced_equal_partitions(costs: list[int], k: int) -> list[list[int]]:
    """Split indices into `k` parts of equal size (len(costs) % k == 0), balancing total cost, as
    verl 0.9.1 balances a batch over its data-parallel ranks: the Karmarkar-Karp differencing
    method with equal sizes (`_karmarkar_karp`: the items, by increasing (cost, index), cut into
    runs of `k`, each run a state of `k` one-item parts). Its parts come heaviest first (the first
    goes to data-parallel rank 0, as in verl), each sorted by index."""
    n = len(costs)
    if k < 1 or n % k:
        raise ValueError(f"{n} items cannot be split into {k} equal parts")
    if n == 0:
        return [[] for _ in range(k)]
    ranked = [(c, 1, i, i) for c, i in sorted((c, i) for i, c in enumerate(costs))]
    return _karmarkar_karp([ranked[r:r + k] for r in range(0, n, k)], k, n)


def balanced_partitions(costs: list[int], k: int) -> list[list[int]]:
    """Split indices into `k` parts of any sizes, balancing total cost, as verl 0.9.1's
    `get_seqlen_balanced_partitions(..., equal_size=False)` (its dynamic micro-batches): the
    Karmarkar-Karp differencing method (`_karmarkar_karp`) from one state per item, by increasing
    (cost, index), of that item and `k - 1` empty parts. Parts heaviest first, each sorted by index.
    `k` may exceed the item count (verl refuses that): every item is then a part of its own and the
    other parts are empty. Costs are work estimates, at least 0 (an empty part is then the lightest
    of its state, which `_karmarkar_karp` relies on)."""
    if k < 1:
        raise ValueError(f"cannot split items into {k} parts (at least 1)")
    if costs and min(costs) < 0:
        raise ValueError(f"balanced_partitions: costs are work estimates, at least 0 (got {min(costs)})")
    if not costs:
        return [[] for _ in range(k)]
    return _karmarkar_karp([[(c, 1, i, i)] for c, i in sorted((c, i) for i, c in enumerate(costs))], k,
                           len(costs))


def _karmarkar_karp(states: list[list[tuple]], k: int, n: int) -> list[list[int]]:
    """The differencing method over `states` of `k` parts each (items `0 .. n - 1`): the two
    states of largest spread (heaviest minus lightest part; equal spreads: the one of the heavier
    heaviest part first) are merged, the heaviest part of the first with the lightest of the
    second and so on, until one state is left; its parts heaviest first, each sorted by index.

    A part is a tuple `(total, count, first item, last item)`; its items are a chain in `after`
    (item -> the next item of its part), so a join is one link (joining lists took quadratic time,
    and trees of tuples woke the garbage collector). Parts order by total, then count, then their
    items in the order they joined, which two parts of disjoint items decide at the first item: no
    two parts of a state tie, so the tuples compare without reaching the last item, and the order
    does not depend on how a tie would be broken.

    A state lists its parts with items only, lightest first. Its other parts are empty, each
    lighter than any part with items (costs are at least 0) and all alike, so the spread of a
    state with one is its heaviest total. Merging the first state `a` with `b`, the heaviest part
    of `a` goes with the lightest of `b`: where their parts with items number `t` more than `k`,
    the `t` lightest of `a` join the `t` lightest of `b` in reverse order, and the other parts of
    both pass unchanged (paired with empty ones). A merge so touches `t` parts and inserts the rest
    into a sorted list, at most n joins in all; sorting all `k` parts of every merged state made the
    method O(n k log k) (0.3 to 1 s for 4,096 items into 264 parts, once per count that
    `token_budget_partitions` tries)."""
    after = [0] * n
    heap = [_ranked(parts, k) for parts in states]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[-1]
        heapq.heapreplace(heap, _ranked(_merge(a, heap[0][-1], k, after), k))
    parts = heap[0][-1]
    return [sorted(_items(p, after)) for p in reversed(parts)] + [[] for _ in range(k - len(parts))]


def _ranked(parts: list[tuple], k: int) -> tuple:
    """A state's heap entry: the larger spread first, then the heavier heaviest part (by total,
    count, first item: parts of different states hold different items, so entries never tie)."""
    top = parts[-1]
    spread = top[0] - parts[0][0] if len(parts) == k else top[0]
    return -spread, -top[0], -top[1], -top[2], parts


def _merge(a: list[tuple], b: list[tuple], k: int, after: list[int]) -> list[tuple]:
    """The state of `a` and `b` (each lightest first, `a` the first popped), lightest first; the
    lists are consumed."""
    t = len(a) + len(b) - k
    joined = []
    if t > 0:
        for pa, pb in zip(a[:t], b[t - 1::-1]):
            after[pa[3]] = pb[2]
            joined.append((pa[0] + pb[0], pa[1] + pb[1], pa[2], pb[3]))
        del a[:t], b[:t]
    base, rest = (a, b) if len(a) >= len(b) else (b, a)
    rest += joined
    if len(rest) * 8 <= len(base):
        for p in rest:
            bisect.insort(base, p)
    else:
        base += rest
        base.sort()
    return base


def _items(part: tuple, after: list[int]) -> list[int]:
    out, i = [], part[2]
    for _ in range(part[1]):
        out.append(i)
        i = after[i]
    return out


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


def balanced_group_partitions(uids: list[int], costs: list[int], k: int) -> list[list[int]] | None:
    """`balanced_equal_partitions` of whole prompt groups (the rows of one `uids` value), as verl
    0.9.1's `get_group_balanced_partitions` (its legacy trainer's balance under the prefix grouper):
    `k` parts of equally many groups, a group's cost the sum of its rows' `costs`, each part's rows
    in the batch's order. None when the groups cannot give equal parts that way (groups of unequal
    sizes, or a group count that `k` does not divide; verl refuses the step)."""
    members: dict[int, list[int]] = {}
    for i, u in enumerate(uids):
        members.setdefault(u, []).append(i)
    rows = list(members.values())
    if len({len(m) for m in rows}) != 1 or len(rows) % k:
        return None
    group_costs = [sum(costs[i] for i in m) for m in rows]
    return [sorted(i for g in part for i in rows[g]) for part in balanced_equal_partitions(group_costs, k)]


def token_budget_partitions(tokens: list[list[int]], work: list[list[int]], max_tokens: int,
                            reduce: Callable[[list[float], str], list[float]] | None = None) -> list[list[list[int]]]:
    """Each batch's micro-batches under a token budget, as verl 0.9.1's dynamic micro-batches
    (`rearrange_micro_batches` as its FSDP engine calls it: the data-parallel group, the same count
    on every rank, balanced order, items one a group): `tokens[b][j]` and `work[b][j]` are item
    `j`'s tokens and work estimate (`seqlen_workload`) in batch `b`; a part lists item positions.

    The count starts at min(items, ceil(tokens / max_tokens)), the largest over the ranks; the
    items are balanced by work over that many parts (`balanced_partitions`), and while a part of
    some rank holds more than `max_tokens` tokens the count grows by one and they are balanced
    again. The parts are then ordered as verl's: by work (ties: the larger first position), heaviest
    first, then every other one from the heaviest reversed, then the rest (the light ones at both
    ends). `reduce(values, op)` all-reduces numbers over the ranks ("max", "min"; None: one rank),
    one call a round for every batch still growing.

    meshppo's additions, where verl stops: an item above the budget is a part of its own (the
    budget holds for every other part), and a rank with fewer items than the count gets empty parts
    (every rank runs as many forwards); a count is at least 1."""
    counts = [min(len(t), -(-sum(t) // max_tokens)) for t in tokens]
    if reduce is not None:
        counts = [int(c) for c in reduce(counts, "max")]
    counts = [max(c, 1) for c in counts]
    parts: list[list[list[int]] | None] = [None] * len(tokens)
    growing = list(range(len(tokens)))
    while growing:
        tries = {b: balanced_partitions(work[b], counts[b]) for b in growing}
        fits = [float(all(len(p) <= 1 or sum(tokens[b][i] for i in p) <= max_tokens for p in tries[b]))
                for b in growing]
        if reduce is not None:
            fits = reduce(fits, "min")
        for b, fit in zip(growing, fits):
            if fit:
                parts[b] = tries[b]
            else:
                counts[b] += 1
        growing = [b for b, fit in zip(growing, fits) if not fit]
    return [_balanced_order(p, w) for p, w in zip(parts, work)]


def _balanced_order(parts: list[list[int]], work: list[int]) -> list[list[int]]:
    """verl's order of a batch's micro-batches: by total work, heaviest first (equal work: the larger
    first item first, an empty part's 0), then the even places reversed and the odd ones after them,
    so that the lightest stand at both ends."""
    ranked = sorted(parts, key=lambda p: (sum(work[i] for i in p), p[0] if p else 0), reverse=True)
    return ranked[::2][::-1] + ranked[1::2]


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

    @classmethod
    def of_arrays(cls, rows: list[np.ndarray]) -> Ragged:
        """Rows of per-token arrays (`[len, ...]`, one dtype and trailing shape: a batch's routed experts) as a
        `Ragged` whose `flat` is `[tokens, ...]`."""
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        return cls(np.concatenate(rows), _offsets(lengths))

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
