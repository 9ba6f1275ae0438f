"""Rule-based GSM8K reward, with verl's semantics (`verl/utils/reward_score/gsm8k.py`).

`strict` rewards only answers in the format the prompt asks for (`#### 72`); `flexible`
takes the last number anywhere in the response. Deliberate differences from verl, each
only ever turning a verl 0 into a correct 1: a `$` after `#### ` is accepted
(`#### $18`), and `flexible` removes commas like `strict` does (the ground truth has
none) and a trailing full stop (`the answer is 4.`). Scores are returned as floats.
"""

from __future__ import annotations

import re

# Regexes over very long responses are slow and the final answer sits at the end, so
# only the tail is searched; 300 characters is verl's choice (about 300 tokens).
SOLUTION_CLIP_CHARS = 300

_STRICT = re.compile(r"#### \$?(-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in `solution_str` (commas and `$` removed), or None if there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    for candidate in reversed(_NUMBER.findall(tail)):
        # A sentence's full stop ("... is 4.") is not part of the number; lone punctuation
        # such as "." or "," is matched by the pattern but is no number at all.
        candidate = candidate.replace(",", "").rstrip(".")
        if candidate not in ("", "-"):
            return candidate
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if an answer
    was found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)
