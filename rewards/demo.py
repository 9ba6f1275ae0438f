"""Reward for the built-in addition task (`data.demo`): exact match of the answer."""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response, stripped of surrounding whitespace, is exactly the ground truth.

    The trainer decodes responses with `skip_special_tokens=True`, so the EOS token is
    already gone; anything else after the number (a second number, a `+`) is wrong.
    """
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
