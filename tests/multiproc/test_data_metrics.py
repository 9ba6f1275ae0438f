"""The step's data metrics (`trainer.metrics.data_metrics`) on 2 gloo ranks against verl's
definitions computed here with NumPy on the concatenation of both ranks' rows: means, maxima and
minima of scores, rewards, advantages, returns, values and lengths, the two clip ratios (an EOS
sampled as the last allowed token counts as clipped, as in verl) and the explained variance (unbiased
variances, epsilon 1e-5). Rank 1's rows hold the global extremes, so a rank-0-only reduction fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed

MAX_PROMPT, MAX_RESPONSE = 6, 5


def _rows(rank: int):
    """Rank `rank`'s rows as plain arrays (responses' lengths, prompts' lengths, per-token arrays)."""
    g = np.random.default_rng(11 + rank)
    resp = [MAX_RESPONSE, 2, 4] if rank == 0 else [MAX_RESPONSE, 1, 3, MAX_RESPONSE]
    prompt = [3, 5, 3] if rank == 0 else [2, MAX_PROMPT, 4, MAX_PROMPT]
    n = len(resp)
    scale = 1.0 if rank == 0 else 10.0  # rank 1 holds the extremes
    tok = {k: scale * g.normal(size=(n, MAX_RESPONSE)) for k in ("rewards", "advantages", "returns", "values")}
    scores = scale * g.normal(size=n)
    return resp, prompt, tok, scores


def _batch(rank: int):
    from trainer.rollout_batch import RolloutBatch

    resp, prompt, tok, scores = _rows(rank)
    n = len(resp)
    ro = RolloutBatch(prompts=[[7] * p for p in prompt], responses=[[9] * r for r in resp], uids=list(range(n)),
                      data_sources=[None] * n, ground_truths=[None] * n, extra_infos=[{}] * n,
                      # the full-length response of rank 0 ended with an EOS on its last allowed token
                      finish_reasons=["stop"] * n, engine_log_probs=[[0.0] * r for r in resp],
                      width=MAX_RESPONSE, device=torch.device("cpu"))
    mask = ro.response_mask
    ro.token_level_rewards, ro.advantages, ro.returns, ro.values = (
        torch.tensor(tok[k], dtype=torch.float32) * mask for k in ("rewards", "advantages", "returns", "values"))
    return ro, torch.tensor(scores, dtype=torch.float32)


def _verl_reference(world: int) -> dict:
    """verl's `compute_data_metrics`, restated with NumPy over every rank's rows."""
    parts = [_rows(r) for r in range(world)]
    resp = np.concatenate([np.array(p[0], dtype=np.float64) for p in parts])
    prompt = np.concatenate([np.array(p[1], dtype=np.float64) for p in parts])
    mask = np.arange(MAX_RESPONSE)[None, :] < resp[:, None]
    tok = {k: np.concatenate([p[2][k].astype(np.float32).astype(np.float64) for p in parts]) * mask
           for k in ("rewards", "advantages", "returns", "values")}
    scores = np.concatenate([p[3].astype(np.float32).astype(np.float64) for p in parts])
    sel = {k: tok[k][mask] for k in ("advantages", "returns", "values")}
    kept = resp > 0  # verl's non-aborted responses (an aborted one is empty)
    ref = {}
    for name, x in (("critic/score", scores[kept]), ("critic/rewards", tok["rewards"].sum(-1)[kept]),
                    ("critic/advantages", sel["advantages"]), ("critic/returns", sel["returns"]),
                    ("critic/values", sel["values"]), ("response_length", resp), ("prompt_length", prompt),
                    ("response_length_non_aborted", resp[kept])):
        ref.update({f"{name}/mean": x.mean(), f"{name}/max": x.max(), f"{name}/min": x.min()})
    ref["response_length/clip_ratio"] = np.mean(resp == MAX_RESPONSE)
    ref["response_length_non_aborted/clip_ratio"] = np.mean(resp[kept] == MAX_RESPONSE)
    ref["response/aborted_ratio"] = np.mean(~kept)
    ref["prompt_length/clip_ratio"] = np.mean(prompt == MAX_PROMPT)
    # single-turn rows: verl 0.9.1's agent loop counts 2 turns each and logs them in every run
    # verl 0.9.1's default trainer logs them again as training/num_turns/*
    ref.update({f"{pre}num_turns/{s}": 2.0 for pre in ("", "training/") for s in ("mean", "max", "min")})
    ref["critic/vf_explained_var"] = 1 - np.var(sel["returns"] - sel["values"], ddof=1) / (
        np.var(sel["returns"], ddof=1) + 1e-5)
    return ref


def _body(rank, world):
    from trainer.metrics import data_metrics

    ro, scores = _batch(rank)
    extras = {"acc": [1.0, float("nan"), 0.0] + ([1.0] if rank else [])}
    m = data_metrics(ro, scores, extras, max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE)
    ref = _verl_reference(world)
    assert set(ref) | {"reward_extra/acc/mean"} == set(m), set(m) ^ set(ref)
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-9), (k, m[k], v)
    # the extra's mean skips the samples that did not return it: (1 + 0 [+ 1 + 0 + 1]) / (2 [+ 3])
    assert m["reward_extra/acc/mean"] == pytest.approx(0.5 if world == 1 else 3 / 5)
    # hand values: full-length responses 1 of 3 (world 1), 3 of 7 (world 2); full prompts 0 of 3, 2 of 7
    clipped = (1 / 3, 0.0) if world == 1 else (3 / 7, 2 / 7)
    assert (m["response_length/clip_ratio"], m["prompt_length/clip_ratio"]) == pytest.approx(clipped)


def _turns_body(rank, world):
    from trainer.metrics import data_metrics

    ro, scores = _batch(rank)
    ro.num_turns = [2, 4, 6] if rank == 0 else [3, 8, 2, 2]
    m = data_metrics(ro, scores, {}, max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE)
    # hand values over both ranks' 7 rows: (12 + 15) / 7, 8, 2
    for pre in ("", "training/"):
        assert (m[f"{pre}num_turns/mean"], m[f"{pre}num_turns/max"], m[f"{pre}num_turns/min"]) == \
            pytest.approx((27 / 7, 8.0, 2.0), rel=1e-12), pre


def test_multi_turn_counts_under_both_of_verls_names():
    """verl 0.9.1's default trainer logs the rows' turn counts as `num_turns/*` (compute_data_metrics)
    and again as `training/num_turns/*` (its `_compute_metrics`): both names, the same figures."""
    run_distributed(_turns_body, 2)


def test_data_metrics_on_one_rank():
    run_distributed(_body, 1)


def test_data_metrics_over_two_ranks():
    run_distributed(_body, 2)
