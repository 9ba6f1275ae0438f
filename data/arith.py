"""Multi-digit addition with a forgetful demonstrator: the task of `bench/learn.py`.

Prompts are `"a+b="` with `a, b` drawn from `[0, 10**digits)` and written with `digits` digits
(`007+358=`; chat-formatted with the demo's character-level tokenizer,
`data.demo.build_demo_tokenizer`); the answer is the sum written with `digits + 1` digits
(`0365`), verified by exact match (`rewards.arith`). The fixed widths put every column at the
same position in every problem, which a model from scratch learns far sooner than ragged
numbers. The supervised warm-up imitates a demonstrator who,
on a share `slip` of the problems, forgets every carry between columns: each column is written
as its digit sum mod 10, and the leftmost column's sum whole, as a person who never carries
writes it (`728+196` -> `0814`; `512+634` -> `1146`, right, because no column but the leftmost
carries). A model that imitates them answers a problem with such a carry (70 % of the 3-digit
problems) wrongly when decoding greedily, while the right answer stays among its samples:
exact-match RL has something to fix on most problems, more headroom than the demo's 2-digit
task (where only a carry out of the units column is forgotten).
"""

from __future__ import annotations

from typing import Any

from data.demo import make_demo_rows, operands

__all__ = ["DATA_SOURCE", "answer", "forgotten_carries", "has_forgotten_carry", "make_rows", "operands", "problem"]

DATA_SOURCE = "meshppo/add_carry"


def _digits(x: int) -> list[int]:
    return [int(c) for c in reversed(str(x))]


def forgotten_carries(a: int, b: int) -> int:
    """`a + b` written without carrying: every column but the leftmost is its digit sum mod 10,
    the leftmost column its whole digit sum (`728+196` -> 814, `95+7` -> 92, `512+634` -> 1146)."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    da, db = _digits(a), _digits(b)
    width = max(len(da), len(db))
    da, db = da + [0] * (width - len(da)), db + [0] * (width - len(db))
    low = sum(((x + y) % 10) * 10**i for i, (x, y) in enumerate(zip(da[:-1], db[:-1])))
    return low + (da[-1] + db[-1]) * 10 ** (width - 1)


def has_forgotten_carry(a: int, b: int) -> bool:
    """Whether forgetting the carries changes the answer (some column but the leftmost carries)."""
    return forgotten_carries(a, b) != a + b


def problem(a: int, b: int, digits: int) -> str:
    """The prompt text: `007+358=` for `digits=3`."""
    return f"{a:0{digits}d}+{b:0{digits}d}="


def answer(value: int, digits: int) -> str:
    """An answer as the task writes it: `digits + 1` digits (`0365`)."""
    return f"{value:0{digits + 1}d}"


def make_rows(n: int, digits: int, seed: int, split: str = "train",
              exclude: set[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """`n` problems with distinct `(a, b)` pairs from `[0, 10**digits)^2` in verl's row format
    (`data_source` `meshppo/add_carry`, fixed-width prompt and ground truth), none of them in
    `exclude`; deterministic in `seed`."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    rows = make_demo_rows(n, seed, 0, 10**digits - 1, split, exclude)
    for row in rows:
        a, b = operands(row)
        row.update(data_source=DATA_SOURCE, prompt=[{"role": "user", "content": problem(a, b, digits)}],
                   reward_model={"style": "rule", "ground_truth": answer(a + b, digits)})
    return rows
