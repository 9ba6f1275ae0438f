"""Reward of the multi-digit addition task (`data.arith`), in verl's signature, so it loads as
`custom_reward_function.path=rewards/arith.py` and is called the same way by TRL's wrapper in
`bench/learn_trl.py`."""

from __future__ import annotations

from data.arith import DATA_SOURCE
from rewards import demo


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the response is exactly the sum's digits (surrounding whitespace aside), else 0.0:
    a leading zero, a second number or a trailing `+` is wrong (`rewards.demo.compute_score`)."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"rewards/arith.py scores data_source {DATA_SOURCE!r}, got {data_source!r}")
    return demo.compute_score(solution_str, ground_truth)
