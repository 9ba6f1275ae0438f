"""Splitting rollouts over ranks, mini-batches and micro-batches (pure Python).

Every rank must run the same number of forward/backward passes (each FSDP forward is a
collective), so the helpers here return partitions whose counts are agreed on across
ranks by the caller; they balance the work (token counts, ~ attention and matmul cost)
inside that constraint.
"""

from __future__ import annotations

import heapq


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


def token_budget_partitions(costs: list[int], max_tokens: int, min_parts: int = 1) -> list[list[int]]:
    """Group indices into as few parts as fit under `max_tokens` each (at least `min_parts`),
    then rebalance into exactly that many parts by cost.

    A single item above the budget gets a part of its own (it cannot be split). The number of
    parts is what the caller all-reduces (max) across ranks before calling again with
    `min_parts` set, so every rank runs the same number of micro-batches.
    """
    if not costs:
        return [[] for _ in range(min_parts)]
    # first-fit decreasing gives the count
    bins: list[int] = []
    for c in sorted(costs, reverse=True):
        for b, load in enumerate(bins):
            if load + c <= max_tokens:
                bins[b] += c
                break
        else:
            bins.append(c)
    k = max(len(bins), min_parts)  # parts may be empty when a rank has fewer items than k
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    heap = [(0, p) for p in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + costs[i], p))
    return [sorted(p) for p in parts]
