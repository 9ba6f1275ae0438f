"""Reward of the multi-digit addition tasks (`data.arith`), in verl's signature, so it loads as
`custom_reward_function.path=rewards/arith.py` and is called the same way by TRL's wrapper in
`bench/learn_trl.py`. The row's `data_source` names the answer format: `meshppo/add_carry` (the
sum alone) or `meshppo/add_carry_worked` (a worked derivation, then the sum)."""

from __future__ import annotations

from data.arith import DATA_SOURCE, WORKED_DATA_SOURCE
from rewards import demo


def final_answer(solution_str: str) -> str | None:
    """The final field of a worked answer: what follows its last `=`, surrounding whitespace
    stripped (`"... 4+1+0=05=05924"` -> `"05924"`); None when there is no `=`."""
    if "=" not in solution_str:
        return None
    return solution_str.rpartition("=")[2].strip()


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """`meshppo/add_carry`: 1.0 if the response is exactly the sum's digits (surrounding whitespace
    aside), else 0.0: a leading zero, a second number or a trailing `+` is wrong
    (`rewards.demo.compute_score`).

    `meshppo/add_carry_worked`: 1.0 if the field after the response's last `=` is exactly the
    sum's digits (surrounding whitespace aside), else 0.0. Only that final answer is scored, as
    verl's GSM8K scorer reads only the number after `####`: the column work before it is not
    checked, so `=05924` alone scores 1.0 for `4728+1196=`, while the demonstrator's slip (all
    carries written as 0, `...=05814`), a response with no `=`, or one with anything after the
    sum (`=05924 1`, `=05924=`) score 0.0."""
    if data_source == DATA_SOURCE:
        return demo.compute_score(solution_str, ground_truth)
    if data_source == WORKED_DATA_SOURCE:
        return 1.0 if final_answer(solution_str) == str(ground_truth) else 0.0
    raise ValueError(f"rewards/arith.py scores data_source {DATA_SOURCE!r} or {WORKED_DATA_SOURCE!r}, "
                     f"got {data_source!r}")
