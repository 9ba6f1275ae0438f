"""verl 0.9.1's aborted-response metrics (`compute_data_metrics`): an aborted request's response is
empty; `response/aborted_ratio` is the share of empty responses, `response_length_non_aborted/*` the
lengths of the others, and `critic/score/*`, `critic/rewards/*` count the non-aborted responses only.
On 2 gloo ranks (both hold an empty response), values worked out by hand in the docstrings."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_distributed

MAX_RESPONSE = 4
# verl 0.9.1's compute_data_metrics keys for a batch without a critic, single-turn (its `metrics` dict)
VERL_KEYS = {f"{name}/{stat}" for name in ("critic/score", "critic/rewards", "critic/advantages", "critic/returns")
             for stat in ("mean", "max", "min")}
VERL_KEYS |= {f"{name}/{stat}" for name in ("response_length", "response_length_non_aborted", "prompt_length")
              for stat in ("mean", "max", "min", "clip_ratio")}
VERL_KEYS |= {"response/aborted_ratio"} | {f"{pre}num_turns/{stat}" for pre in ("", "training/")
                                            for stat in ("mean", "max", "min")}


def _metrics(lengths: list[int], scores: list[float]) -> dict:
    """`data_metrics` of rows with these response lengths (prompts of 2 tokens); each row's score is
    its token-level reward on its last token (an empty row has none), advantages and returns 1."""
    from trainer.metrics import data_metrics
    from trainer.rollout_batch import RolloutBatch

    n = len(lengths)
    ro = RolloutBatch([[7, 8]] * n, [[5] * m for m in lengths], list(range(n)), ["d"] * n, ["g"] * n, [{}] * n,
                      ["stop"] * n, [[0.0] * m for m in lengths], MAX_RESPONSE, torch.device("cpu"))
    ro.token_level_rewards = torch.zeros(n, MAX_RESPONSE)
    for i, m in enumerate(lengths):
        if m:
            ro.token_level_rewards[i, m - 1] = scores[i]
    ro.advantages = ro.returns = ro.response_mask.clone()
    return data_metrics(ro, torch.tensor(scores), {}, max_prompt_length=2, max_response_length=MAX_RESPONSE)


def _body(rank, world):
    """Rank 0: lengths 3, 0, 4 with scores 1, 7, 0.5; rank 1: lengths 0, 2 with scores -3, 2. The
    non-aborted rows: lengths 3, 4, 2, scores and rewards 1, 0.5, 2: mean 3.5 / 3, max 2, min 0.5
    (over every row the scores' mean would be 7.5 / 5 = 1.5, max 7, min -3); lengths: mean 9 / 3 = 3,
    max 4, min 2, 1 of 3 as long as allowed; 2 of 5 aborted; every row's lengths: mean 9 / 5, min 0,
    clip ratio 1 / 5."""
    lengths, scores = ([3, 0, 4], [1.0, 7.0, 0.5]) if rank == 0 else ([0, 2], [-3.0, 2.0])
    m = _metrics(lengths, scores)
    assert set(m) == VERL_KEYS, set(m) ^ VERL_KEYS
    expected = {"critic/score/mean": 3.5 / 3, "critic/score/max": 2.0, "critic/score/min": 0.5,
                "critic/rewards/mean": 3.5 / 3, "critic/rewards/max": 2.0, "critic/rewards/min": 0.5,
                "response_length_non_aborted/mean": 3.0, "response_length_non_aborted/max": 4.0,
                "response_length_non_aborted/min": 2.0, "response_length_non_aborted/clip_ratio": 1 / 3,
                "response/aborted_ratio": 0.4, "response_length/mean": 1.8, "response_length/max": 4.0,
                "response_length/min": 0.0, "response_length/clip_ratio": 0.2}
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-9), (key, m[key], value)

    # every response aborted: no score, reward, length or token to count: NaN, as verl's; all aborted
    m = _metrics([0, 0], [1.0, 0.0])
    assert m["response/aborted_ratio"] == 1.0
    for name in ("critic/score", "critic/rewards", "response_length_non_aborted", "critic/advantages"):
        assert all(math.isnan(m[f"{name}/{stat}"]) for stat in ("mean", "max", "min")), (name, m)
    assert math.isnan(m["response_length_non_aborted/clip_ratio"])


def test_aborted_responses_over_two_ranks():
    run_distributed(_body, 2, timeout=120)
