"""A step's data metrics, under verl's names and with verl's definitions (`compute_data_metrics`),
over every rank's rows.

Per response: `critic/score` (the reward function's score), `critic/rewards` (the summed
token-level rewards, after any KL-in-reward penalty), `response_length` (every generated token),
`prompt_length`; per token of `loss_mask` (the response tokens, without those rollout rejection
removed, as verl's `response_mask`): `critic/advantages`, `critic/returns` and, with a critic,
`critic/values`. Each has
`/mean`, `/max` and `/min`. As in verl, `response_length/clip_ratio` is the share of responses as
long as the rollout allows (an EOS sampled as the last allowed token counts), and
`prompt_length/clip_ratio` the share of prompts as long as `data.max_prompt_length`.
`critic/vf_explained_var` is `1 - Var(returns - values) / (Var(returns) + 1e-5)` over the same
tokens, with unbiased variances. Reward-function extras are averaged over the samples that
returned them (`reward_extra/<key>/mean`).

Three collectives at most, whatever the number of metrics: the sums, the extremes, and (with a
critic) the centred sums of squares.
"""

from __future__ import annotations

import math

import torch

from sharding import comm
from trainer.rollout_batch import RolloutBatch


def data_metrics(ro: RolloutBatch, scores: torch.Tensor, extras: dict[str, list[float]], *,
                 max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """The metrics above for this rank's rows `ro` (every rank calls it, with the same extra keys
    in the same order); `scores` is `[N]`, one per response."""
    mask = ro.loss_mask.bool()  # as verl's batch response_mask: without rollout rejection's tokens
    response_length = ro.response_mask.sum(-1).double()  # verl's: from the attention mask, all tokens
    prompt_length = torch.tensor([float(len(p)) for p in ro.prompts], dtype=torch.float64, device=mask.device)
    per_row = {"critic/score": scores.double().reshape(-1),
               "critic/rewards": ro.token_level_rewards.double().sum(-1),
               "response_length": response_length, "prompt_length": prompt_length}
    per_token = {"critic/advantages": ro.advantages, "critic/returns": ro.returns}
    if ro.values is not None:
        per_token["critic/values"] = ro.values
    per_token = {k: v.double()[mask] for k, v in per_token.items()}
    stats = {**per_row, **per_token}

    extra_values = [torch.tensor(v, dtype=torch.float64) for v in extras.values()]
    extra_values = [v[~torch.isnan(v)] for v in extra_values]
    sums = comm.all_reduce_values(
        [float(len(ro)), float(mask.sum())]
        + [float(x.sum()) for x in stats.values()]
        + [float((response_length == max_response_length).sum()), float((prompt_length == max_prompt_length).sum())]
        + [y for v in extra_values for y in (float(v.sum()), float(v.numel()))])
    extremes = comm.all_reduce_values(
        [y for x in stats.values() for y in ((float(x.max()), -float(x.min())) if x.numel() else (-math.inf, -math.inf))],
        "max")

    rows, tokens = sums[0], sums[1]
    m = {}
    for i, (name, x) in enumerate(stats.items()):
        count = rows if name in per_row else tokens
        m[f"{name}/mean"] = sums[2 + i] / max(count, 1.0)
        m[f"{name}/max"], m[f"{name}/min"] = extremes[2 * i], -extremes[2 * i + 1]
    clipped_responses, clipped_prompts = sums[2 + len(stats):4 + len(stats)]
    m["response_length/clip_ratio"] = clipped_responses / max(rows, 1.0)
    m["prompt_length/clip_ratio"] = clipped_prompts / max(rows, 1.0)
    extra_sums = sums[4 + len(stats):]
    for j, key in enumerate(extras):
        m[f"reward_extra/{key}/mean"] = extra_sums[2 * j] / max(extra_sums[2 * j + 1], 1.0)

    if ro.values is not None:
        ret, diff = per_token["critic/returns"], per_token["critic/returns"] - per_token["critic/values"]
        mean_ret = m["critic/returns/mean"]
        mean_diff = mean_ret - m["critic/values/mean"]
        ss_ret, ss_diff = comm.all_reduce_values([float(((ret - mean_ret) ** 2).sum()),
                                                  float(((diff - mean_diff) ** 2).sum())])
        dof = max(tokens - 1.0, 1.0)
        m["critic/vf_explained_var"] = 1.0 - (ss_diff / dof) / (ss_ret / dof + 1e-5)
    return m


__all__ = ["data_metrics"]
