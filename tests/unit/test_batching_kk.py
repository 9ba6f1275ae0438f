"""Karmarkar-Karp partitions (`balanced_partitions`, `balanced_equal_partitions`) against the
differencing method written plainly, and the cost of the planner (parts compared per item)."""

import random

import pytest

from trainer.batching import balanced_equal_partitions, balanced_partitions, seqlen_workload


def _ldm_reference(costs, k, equal=False):
    """The largest differencing method written plainly, as the tests' independent reference. Items
    by increasing (cost, index); unequal sizes: one state per item, of that item and k - 1 empty
    parts; equal sizes: the items in runs of k, each a state of k one-item parts. A part is (total,
    items in the order they joined) and orders by total, item count, then items; a state keeps its k
    parts heaviest first. The state of largest spread (heaviest minus lightest part; equal spreads:
    the heavier heaviest part) merges with the next one, heaviest part with lightest, until one
    state is left; its parts, each sorted by index."""
    def order(part):
        return part[0], len(part[1]), part[1]

    def rank(state):
        return state[0][0] - state[-1][0], order(state[0])

    ranked = [(c, [(i, c)]) for c, i in sorted((c, i) for i, c in enumerate(costs))]
    if not ranked:
        return [[] for _ in range(k)]
    if equal:
        states = [sorted(ranked[r:r + k], key=order, reverse=True) for r in range(0, len(ranked), k)]
    else:
        states = [[part] + [(0, [])] * (k - 1) for part in ranked]
    while len(states) > 1:
        a = max(states, key=rank)
        states.remove(a)
        b = max(states, key=rank)
        states.remove(b)
        merged = [(pa[0] + pb[0], pa[1] + pb[1]) for pa, pb in zip(a, reversed(b))]
        states.append(sorted(merged, key=order, reverse=True))
    return [sorted(i for i, _ in part[1]) for part in states[0]]


def _costs(rng, n, case):
    kind = case % 5
    if kind == 0:  # few distinct costs, zeros among them: ties of totals and of counts
        return [rng.randint(0, 4) for _ in range(n)]
    if kind == 1:  # verl's work estimates of rows up to 2,000 tokens
        return seqlen_workload([rng.randint(1, 2000) for _ in range(n)])
    if kind == 2:  # all alike
        return [7] * n
    if kind == 3:  # a long tail
        return [rng.choice([1, 1, 2, 3, 50, 1000]) for _ in range(n)]
    return [rng.randint(1, 10 ** 9) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_balanced_partitions_equal_a_plain_differencing(seed):
    rng = random.Random(seed)
    for case in range(750):  # 3,000 cases over the seeds
        n = rng.randint(0, 20)
        # k = 1, k up to n, and k > n (more parts than items: some stay empty)
        k = 1 if case % 7 == 0 else rng.randint(1, n + 3)
        costs = _costs(rng, n, case)
        assert balanced_partitions(costs, k) == _ldm_reference(costs, k), (costs, k)


@pytest.mark.parametrize("seed", range(2))
def test_balanced_equal_partitions_equal_a_plain_differencing(seed):
    rng = random.Random(100 + seed)
    for case in range(750):
        n = rng.randint(0, 24)
        k = rng.choice([d for d in range(1, n + 1) if n % d == 0]) if n else rng.randint(1, 4)
        costs = _costs(rng, n, case)
        assert balanced_equal_partitions(costs, k) == _ldm_reference(costs, k, equal=True), (costs, k)


def test_large_partitions_equal_a_plain_differencing():
    rng = random.Random(7)
    lengths = [512 + min(int(rng.lognormvariate(6.9, 1.0)), 8192) for _ in range(768)]
    work = seqlen_workload(lengths)
    for k in (3, 90, 500):
        assert balanced_partitions(work, k) == _ldm_reference(work, k), k
    for k in (8, 96):
        assert balanced_equal_partitions(work, k) == _ldm_reference(work, k, equal=True), k


def test_bad_costs_and_counts_are_refused():
    with pytest.raises(ValueError, match="at least 0"):
        balanced_partitions([3, -1, 2], 2)
    with pytest.raises(ValueError, match="at least 1"):
        balanced_partitions([3, 1], 0)
    with pytest.raises(ValueError, match="equal parts"):
        balanced_equal_partitions([3, 1], 0)


class _Counted(int):
    """An int whose comparisons are counted (sums stay counted)."""

    calls = 0
    __hash__ = int.__hash__

    def __add__(self, other):
        return _Counted(int(self) + int(other))

    __radd__ = __add__


for _op in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    def _counted(self, other, _cmp=getattr(int, _op)):
        _Counted.calls += 1
        return _cmp(self, other)

    setattr(_Counted, _op, _counted)


def test_the_planner_compares_a_few_dozen_costs_per_item_whatever_the_part_count():
    """Sorting all k parts of every merged state compared about 2 k costs per item (455 per item for
    1,024 items into 256 parts, a second for 4,096 rows into 264 micro-batches); keeping only the parts
    with items, in order, leaves the initial sort and a binary insertion per merge: under 64 (39)."""
    rng = random.Random(0)
    costs = [_Counted(rng.randint(1, 10 ** 6)) for _ in range(1024)]
    for k in (8, 256):
        _Counted.calls = 0
        parts = balanced_partitions(costs, k)
        assert _Counted.calls < 64 * len(costs), (k, _Counted.calls)
        assert sorted(i for p in parts for i in p) == list(range(len(costs)))
