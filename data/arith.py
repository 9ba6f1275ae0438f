"""Multi-digit addition with a forgetful demonstrator: the tasks of `bench/learn.py`.

Prompts are `"a+b="` with `a, b` drawn from `[0, 10**digits)` and written with `digits` digits
(`007+358=`; chat-formatted with the demo's character-level tokenizer,
`data.demo.build_demo_tokenizer`, whose characters are the digits, `+ - * =` and space). The
fixed widths put every column at the same position in every problem, which a model from scratch
learns far sooner than ragged numbers. Two answer formats (`TASKS`), each its own `data_source`:

`sum` (`meshppo/add_carry`): the sum written with `digits + 1` digits (`0365`), verified by exact
match (`rewards.arith`). Answers are `digits + 1` tokens: a step of RL on it is mostly per-step
fixed cost, and generation (where a fast engine wins) a small part of it.

`worked` (`meshppo/add_carry_worked`): a column-by-column derivation, then the sum. Each column,
units first, is written `x+y+c=ss`, its two digits, the carry into it and the column's sum with
two digits (the tens digit is the carry into the next column); the columns are separated by a
space and followed by `=` and the sum with `digits + 1` digits:

    4728+1196=  ->  8+6+0=14 2+9+1=12 7+1+1=09 4+1+0=05=05924

Every answer has `10 * digits + 1` characters (41 at 4 digits, 42 tokens with EOS). The format
exists for its length: answers of tens of tokens make generation, not per-step fixed cost, the
bulk of an RL step, where the sum's 5 tokens leave a fast rollout engine nothing to win
(`python bench/learn.py --task worked`, `python bench/learn_trl.py --task worked`). Only the
final field (after the last `=`) is scored, by exact match with the sum's `digits + 1` digits, as
verl's GSM8K scorer reads only the final answer: the work is what the model writes to get there,
not something graded (`rewards.arith`).

The supervised warm-up imitates a demonstrator who, on a share `slip` of the problems, forgets
every carry between columns. In the `sum` format each column is written as its digit sum mod 10,
and the leftmost column's sum whole, as a person who never carries writes it (`728+196` ->
`0814`; `512+634` -> `1146`, right, because no column but the leftmost carries). In the `worked`
format every carry into a column is written as 0, and the columns and the final sum follow from
that, consistently (`728+196` -> `8+6+0=14 2+9+0=11 7+1+0=08=0814`): the same wrong sum,
`forgotten_carries` (counting the fixed-width columns, leading zeros included, where the `sum`
format's demonstrator counts the operands' own: they differ on `06+08`, 0.5 % of 4-digit
problems). Forgetting changes the answer exactly when some column but the leftmost carries
(`has_forgotten_carry`): a column's two digits sum to 10 or more with probability 45/100, so a
problem is carry-free with probability 0.55 ** (digits - 1) (0.30 at 3 digits, 0.17 at 4, 0.09
at 5).

A model that imitates the demonstrator answers a carry problem with the slip when decoding
greedily (the slip is the likelier answer while `slip` > 0.5) and right with probability about
`1 - slip` when sampling: greedy accuracy starts at the carry-free share, whatever `slip` is above
0.5, and exact-match RL has something to fix on every carry problem. `slip` sets how often a
sample is right on one (0.3 at `slip` 0.7), the reward RL starts from.
"""

from __future__ import annotations

from typing import Any

from data.demo import make_demo_rows, operands

__all__ = ["DATA_SOURCE", "TASKS", "WORKED_DATA_SOURCE", "answer", "data_source", "forgotten_carries",
           "has_forgotten_carry", "make_rows", "operands", "problem", "response", "response_chars", "worked"]

DATA_SOURCE = "meshppo/add_carry"
WORKED_DATA_SOURCE = "meshppo/add_carry_worked"
TASKS = {"sum": DATA_SOURCE, "worked": WORKED_DATA_SOURCE}  # task -> data_source


def data_source(task: str) -> str:
    """The rows' `data_source` of a task (`sum` or `worked`)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: one of {sorted(TASKS)}")
    return TASKS[task]


def _digits(x: int) -> list[int]:
    return [int(c) for c in reversed(str(x))]


def forgotten_carries(a: int, b: int, digits: int | None = None) -> int:
    """`a + b` written without carrying: every column but the leftmost is its digit sum mod 10,
    the leftmost column its whole digit sum (`728+196` -> 814, `95+7` -> 92, `512+634` -> 1146).
    The columns are the operands' own (the `sum` format's demonstrator), or with `digits` the
    `digits` columns of the fixed-width problem, leading zeros included (the `worked` format's,
    who writes `0+0+0=00` in a column of leading zeros: `forgotten_carries(6, 8, 2)` is 4 where
    `forgotten_carries(6, 8)` is 14)."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    if digits is not None:
        _check_operands(a, b, digits)
    da, db = _digits(a), _digits(b)
    width = max(len(da), len(db), digits or 0)
    da, db = da + [0] * (width - len(da)), db + [0] * (width - len(db))
    low = sum(((x + y) % 10) * 10**i for i, (x, y) in enumerate(zip(da[:-1], db[:-1])))
    return low + (da[-1] + db[-1]) * 10 ** (width - 1)


def has_forgotten_carry(a: int, b: int, digits: int | None = None) -> bool:
    """Whether forgetting the carries changes the answer (some column but the leftmost carries;
    the columns as in `forgotten_carries`)."""
    return forgotten_carries(a, b, digits) != a + b


def problem(a: int, b: int, digits: int) -> str:
    """The prompt text: `007+358=` for `digits=3`."""
    return f"{a:0{digits}d}+{b:0{digits}d}="


def answer(value: int, digits: int) -> str:
    """A sum as the task writes it: `digits + 1` digits (`0365`)."""
    return f"{value:0{digits + 1}d}"


def _check_operands(a: int, b: int, digits: int) -> None:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not (0 <= a < 10**digits and 0 <= b < 10**digits):
        raise ValueError(f"operands must be in [0, 10**{digits}), got {a} and {b}")


def worked(a: int, b: int, digits: int, forget: bool = False) -> str:
    """The worked answer to `a+b=`: per column, units first, `x+y+c=ss` (digits, carry in, the
    column sum with two digits), space-separated, then `=` and the sum with `digits + 1` digits.
    `forget`: every carry in is written as 0, as the forgetful demonstrator writes it (the sum at
    the end is then `forgotten_carries(a, b, digits)`). `worked(4728, 1196, 4)` is
    `8+6+0=14 2+9+1=12 7+1+1=09 4+1+0=05=05924`."""
    _check_operands(a, b, digits)
    da, db = f"{a:0{digits}d}"[::-1], f"{b:0{digits}d}"[::-1]
    columns, low, carry = [], "", 0
    for x, y in zip(da, db):
        column = int(x) + int(y) + carry
        columns.append(f"{x}+{y}+{carry}={column:02d}")
        low = str(column % 10) + low
        carry = 0 if forget else column // 10
    return " ".join(columns) + f"={column // 10}{low}"


def response(a: int, b: int, digits: int, task: str = "sum", forget: bool = False) -> str:
    """What the demonstrator answers to `a+b=` in `task`'s format, forgetting every carry if
    `forget`: `answer(a + b)` (or `answer(forgotten_carries(a, b))`) for `sum`, `worked(...)`
    for `worked`."""
    data_source(task)
    if task == "worked":
        return worked(a, b, digits, forget)
    _check_operands(a, b, digits)
    return answer(forgotten_carries(a, b) if forget else a + b, digits)


def response_chars(digits: int, task: str = "sum") -> int:
    """The length of every answer of the task, in characters (= tokens of the demo's tokenizer):
    `digits + 1` for `sum`, `10 * digits + 1` for `worked` (8 per column, a space between
    columns, `=` and the `digits + 1` digits of the sum)."""
    data_source(task)
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return 10 * digits + 1 if task == "worked" else digits + 1


def make_rows(n: int, digits: int, seed: int, split: str = "train",
              exclude: set[tuple[int, int]] | None = None, task: str = "sum") -> list[dict[str, Any]]:
    """`n` problems with distinct `(a, b)` pairs from `[0, 10**digits)^2` in verl's row format
    (`data_source` of `task`, fixed-width prompt, the sum's `digits + 1` digits as ground truth:
    in both formats the sum is what is scored), none of them in `exclude`; deterministic in
    `seed`, and the same pairs for either task."""
    source = data_source(task)
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    rows = make_demo_rows(n, seed, 0, 10**digits - 1, split, exclude)
    for row in rows:
        a, b = operands(row)
        row.update(data_source=source, prompt=[{"role": "user", "content": problem(a, b, digits)}],
                   reward_model={"style": "rule", "ground_truth": answer(a + b, digits)})
    return rows
