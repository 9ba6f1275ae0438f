"""Rule-based GSM8K reward, verl's (`verl/utils/reward_score/gsm8k.py`) to the letter.

`strict` rewards only answers in the format the prompt asks for (`#### 72`, no `$`); `flexible`
takes the last match of the number pattern anywhere in the response, skipping only `""` and
`"."`, as verl does: it is not cleaned (`1,234` stays `1,234`, `4.` stays `4.`), and when every
match is punctuation the first one is the answer. The extracted string is compared with the
ground truth as it is, without conversion: an integer ground truth 72 never equals the answer
"72" (a format score), as in verl; the trainer refuses such a row at load instead (`RLHFDataset`'s
`data_sources`, `rewards.registry.builtin_ground_truth_problem`). Scores are returned as floats.
"""

from __future__ import annotations

import re
from typing import Any

# Regexes over very long responses are slow and the final answer sits at the end, so
# only the tail is searched; 300 characters is verl's choice (about 300 tokens).
SOLUTION_CLIP_CHARS = 300

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in `solution_str` (`strict`: commas removed), or None if there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    matches = _NUMBER.findall(tail)
    # verl's loop: the last match that is not "" or "."; when all are, the loop ends on the first
    for candidate in reversed(matches):
        if candidate not in ("", "."):
            return candidate
    return matches[0] if matches else None


def compute_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if an answer
    was found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
