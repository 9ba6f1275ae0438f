"""A step's data metrics, under verl's names and with verl's definitions (`compute_data_metrics`),
over every rank's rows.

Per response: `response_length` (every generated token), `prompt_length`, and `num_turns` (verl's
count: the assistant turns, the tool responses, plus one; 2 for a single-turn generation, as verl
0.9.1's agent loop counts it and logs it in every run; its default trainer logs the same figures again
as `training/num_turns/*`, and so does meshppo); per response
that is not empty (verl's non-aborted: an aborted request's response is empty): `critic/score`
(the reward function's score), `critic/rewards` (the summed token-level rewards, after any
KL-in-reward penalty) and `response_length_non_aborted`; `response/aborted_ratio` is the share of
empty responses; per token of `loss_mask` (the response tokens, without those rollout rejection
removed, as verl's `response_mask`): `critic/advantages`, `critic/returns` and, with a critic,
`critic/values`. Each has
`/mean`, `/max` and `/min`, NaN where there is none to count (every response empty, every token
rejected), as in verl. As in verl 0.9.1's legacy trainer (its default trainer compares with the
batch's longest row: docs/VERL.md), `response_length/clip_ratio` is the share of responses as
long as the rollout allows (an EOS sampled as the last allowed token counts),
`response_length_non_aborted/clip_ratio` that share among the non-empty ones, and
`prompt_length/clip_ratio` the share of prompts as long as `data.max_prompt_length`.
`critic/vf_explained_var` is `1 - Var(returns - values) / (Var(returns) + 1e-5)` over the same
tokens, with unbiased variances (NaN over fewer than two tokens, as verl's). Reward-function extras
are averaged over the samples that returned them (`reward_extra/<key>/mean`).

Three collectives at most, whatever the number of metrics: the sums, the extremes, and (with a
critic) the centred sums of squares. `variance_proxy_metrics` (verl's `variance_proxy/*`, with
`actor.calculate_sum_pi_squared`) adds one.
"""

from __future__ import annotations

import math

import torch

from ppo.core_algos import masked_mean, masked_sum
from sharding import comm
from trainer.rollout_batch import RolloutBatch


SINGLE_TURN = 2  # verl's num_turns of a single-turn generation: the prompt and the answer


def turn_counts(ro: RolloutBatch) -> list[int]:
    """Each row's verl `num_turns`: a multi-turn rollout's own count, else `SINGLE_TURN`."""
    return list(ro.num_turns) if ro.num_turns is not None else [SINGLE_TURN] * len(ro.responses)


def data_metrics(ro: RolloutBatch, scores: torch.Tensor, extras: dict[str, list[float]], *,
                 max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """The metrics above for this rank's rows `ro` (every rank calls it, with the same extra keys
    in the same order); `scores` is `[N]`, one per response."""
    mask = ro.loss_mask.bool()  # as verl's batch response_mask: without rollout rejection's tokens
    # verl's: from the attention mask, all tokens (a multi-turn response's tool tokens too)
    response_length = torch.tensor(ro.responses.lengths(), dtype=torch.float64, device=mask.device)
    prompt_length = torch.tensor(ro.prompts.lengths(), dtype=torch.float64, device=mask.device)
    kept = response_length > 0  # verl's non-aborted responses: an aborted request's is empty
    # each statistic with the index in `sums` of its count: the rows, the tokens, the non-aborted rows
    per_row = {"response_length": response_length, "prompt_length": prompt_length}
    per_row["num_turns"] = torch.tensor(turn_counts(ro), dtype=torch.float64, device=mask.device)
    non_aborted = {"critic/score": scores.double().reshape(-1)[kept],
                   "critic/rewards": ro.token_level_rewards.double().sum(-1)[kept],
                   "response_length_non_aborted": response_length[kept]}
    per_token = {"critic/advantages": ro.advantages, "critic/returns": ro.returns}
    if ro.values is not None:
        per_token["critic/values"] = ro.values
    per_token = {k: v.double()[mask] for k, v in per_token.items()}
    stats = {**per_row, **non_aborted, **per_token}
    count_of = {**dict.fromkeys(per_row, 0), **dict.fromkeys(non_aborted, 2), **dict.fromkeys(per_token, 1)}

    extra_values = [torch.tensor(v, dtype=torch.float64) for v in extras.values()]
    extra_values = [v[~torch.isnan(v)] for v in extra_values]
    clipped = [response_length == max_response_length, prompt_length == max_prompt_length,
               non_aborted["response_length_non_aborted"] == max_response_length]
    sums = comm.all_reduce_values(
        [float(len(ro)), float(mask.sum()), float(kept.sum())]
        + [float(x.sum()) for x in stats.values()]
        + [float(c.sum()) for c in clipped]
        + [y for v in extra_values for y in (float(v.sum()), float(v.numel()))])
    extremes = comm.all_reduce_values(
        [y for x in stats.values() for y in ((float(x.max()), -float(x.min())) if x.numel() else (-math.inf, -math.inf))],
        "max")

    rows, tokens, kept_rows = sums[:3]
    m = {}
    for i, name in enumerate(stats):
        count = sums[count_of[name]]
        # none to count (every response aborted, every token rejected): NaN, as verl's
        m[f"{name}/mean"] = sums[3 + i] / count if count else math.nan
        m[f"{name}/max"], m[f"{name}/min"] = (extremes[2 * i], -extremes[2 * i + 1]) if count else (math.nan, math.nan)
    clipped_responses, clipped_prompts, clipped_kept = sums[3 + len(stats):6 + len(stats)]
    m["response_length/clip_ratio"] = clipped_responses / max(rows, 1.0)
    m["prompt_length/clip_ratio"] = clipped_prompts / max(rows, 1.0)
    m["response_length_non_aborted/clip_ratio"] = clipped_kept / kept_rows if kept_rows else math.nan
    m["response/aborted_ratio"] = (rows - kept_rows) / max(rows, 1.0)
    # verl 0.9.1's default trainer logs the turn counts under both names (`compute_data_metrics`'s and its own)
    m.update({f"training/num_turns/{s}": m[f"num_turns/{s}"] for s in ("mean", "max", "min")})
    extra_sums = sums[6 + len(stats):]
    for j, key in enumerate(extras):
        m[f"reward_extra/{key}/mean"] = extra_sums[2 * j] / max(extra_sums[2 * j + 1], 1.0)

    if ro.values is not None:
        ret, diff = per_token["critic/returns"], per_token["critic/returns"] - per_token["critic/values"]
        mean_ret = m["critic/returns/mean"]
        mean_diff = mean_ret - m["critic/values/mean"]
        ss_ret, ss_diff = comm.all_reduce_values([float(((ret - mean_ret) ** 2).sum()),
                                                  float(((diff - mean_diff) ** 2).sum())])
        # fewer than two tokens have no unbiased variance: NaN, as verl's `torch.var` gives
        m["critic/vf_explained_var"] = (1.0 - (ss_diff / (tokens - 1.0)) / (ss_ret / (tokens - 1.0) + 1e-5)
                                        if tokens >= 2 else math.nan)
    return m


def trajectory_version_metrics() -> dict[str, float]:
    """verl 0.9.1's default trainer's `training/off_policy/*`, logged at every step: per response, the
    weight versions its generation ran across (`trajectory_spans`: 1 for one version) and how many
    versions the trained policy is ahead of the newest (`trajectory_staleness`) and the oldest
    (`trajectory_staleness_worst`) of them, each `/mean`, `/max`, `/min`. meshppo generates each
    step's responses, every turn and generation round, with the weights the step starts from and
    trains on them in that step, as verl's synchronous trainer does: one version, none behind."""
    figures = {"trajectory_spans": 1.0, "trajectory_staleness": 0.0, "trajectory_staleness_worst": 0.0}
    return {f"training/off_policy/{name}/{s}": v for name, v in figures.items() for s in ("mean", "max", "min")}


__all__ = ["data_metrics", "trajectory_version_metrics"]


def variance_proxy_metrics(ro: RolloutBatch, grad_norm: float | None) -> dict[str, float]:
    """verl's `variance_proxy/*` (`compute_variance_proxy_metrics`), logged whenever the old-log-prob
    pass computed the sums of squared probabilities (`actor.calculate_sum_pi_squared`), over every
    rank's rows. Per response, over `loss_mask`: A its mean advantage and W = sum_t w_t, the score-
    norm proxy w_t = 1 - 2 pi_t + sum pi^2_t (times the squared rollout importance weight when
    there are some). `expected_a_squared` and `expected_w` are the means of A^2 and W over the batch,
    `proxy2_total_power` the mean of A^2 max(W, 0) (with weights: of rho^2 A^2 max(W / rho^2, 0),
    rho the response's mean weight and W / rho^2 summed per token), `proxy1_signal_strength` the
    actor's `grad_norm` squared and `proxy3_pure_noise` max(0, (proxy2 - proxy1) / (N - 1)); both 0
    on a step without an actor update."""
    mask = ro.loss_mask
    w = 1 - 2 * ro.old_log_probs.double().exp() + ro.sum_pi_squared.double()
    adv = masked_mean(ro.advantages.double(), mask, axis=-1)
    weights = ro.rollout_is_weights
    if weights is None:
        power = adv ** 2 * masked_sum(w, mask, axis=-1).clamp(min=0)
    else:
        sq = weights.double() ** 2
        w = w * sq
        power = masked_mean(weights.double(), mask, axis=-1) ** 2 * adv ** 2 * masked_sum(
            w / sq.clamp(min=1e-10), mask, axis=-1).clamp(min=0)
    rows, a2, w_sum, power = comm.all_reduce_values(
        [float(len(ro)), float((adv ** 2).sum()), float(masked_sum(w, mask, axis=-1).sum()), float(power.sum())])
    proxy2 = power / max(rows, 1.0)
    proxy1 = grad_norm ** 2 if grad_norm is not None else None
    proxy3 = max(0.0, (proxy2 - proxy1) / (rows - 1)) if proxy1 is not None and rows > 1 else 0.0
    return {"variance_proxy/proxy1_signal_strength": proxy1 if proxy1 is not None else 0.0,
            "variance_proxy/proxy2_total_power": proxy2, "variance_proxy/proxy3_pure_noise": proxy3,
            "variance_proxy/expected_a_squared": a2 / max(rows, 1.0),
            "variance_proxy/expected_w": w_sum / max(rows, 1.0)}
