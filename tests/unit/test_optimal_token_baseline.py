"""verl's optimal-token-baseline estimators (`optimal_token_baseline`, `tir_optimal_token_baseline`)
against per-group loops written here from verl's definitions, in float64: dense rewards, groups of
one to four, empty responses, a hole inside a response, ties for the longest response, with and
without rollout importance weights and the zero tail."""

import numpy as np
import pytest
import torch

from ppo import get_adv_estimator_fn

F64 = torch.float64
EPS = 1e-8


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 2, 3]
    index = np.array([f"u{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    b, t = len(index), 7
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = 4  # the group of one
    lengths[1], lengths[3] = 0, 0  # an empty response in a group of two, one in a group of three
    lengths[6:10] = torch.tensor([5, 7, 7, 2])  # with row 7's hole, row 8 is the single longest by tokens
    lengths[10:12] = torch.tensor([6, 3])  # a single longest
    lengths[12:15] = torch.tensor([4, 4, 3])  # a tie for the longest: no zero tail in that group
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    mask[7, 2] = mask[14, 0] = 0  # holes (tokens rollout rejection removed)
    rewards = torch.randn(b, t, generator=g, dtype=F64) * mask  # dense, as with KL in the reward
    logits = 3 * torch.randn(b, t, 11, generator=g, dtype=F64)
    probs = torch.softmax(logits, -1)
    sampled = torch.randint(0, 11, (b, t), generator=g)
    old_log_probs = probs.gather(-1, sampled[..., None]).squeeze(-1).log()
    sum_pi_squared = (probs ** 2).sum(-1)
    weights = torch.rand(b, t, generator=g, dtype=F64) * 2
    return rewards, mask, index, old_log_probs, sum_pi_squared, weights


def _reference(rewards, mask, index, old_log_probs, sum_pi_squared, weights, handle_zero_tail, tir):
    """verl's loops: per row the returns-to-go and cumulative W over its timesteps (its columns; with
    `tir` its valid tokens in order), per group and timestep B = sum G W m / (sum W m + eps)."""
    b, t = mask.shape
    steps, G, W = [], [], []
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        g_row = [sum(rewards[i, k].item() for k in valid if k >= j) for j in range(t)]
        w_row, acc = [], 0.0
        for j in range(t):
            if mask[i, j]:
                w = 1 - 2 * old_log_probs[i, j].exp().item() + sum_pi_squared[i, j].item()
                acc += w * (weights[i, j].item() ** 2 if weights is not None else 1.0)
            w_row.append(acc)
        cols = valid if tir else list(range(t))
        steps.append(cols)
        G.append([g_row[j] for j in cols] + [0.0] * (t - len(cols)))
        W.append([w_row[j] for j in cols] + [0.0] * (t - len(cols)))
    m = [[1.0] * len(steps[i]) + [0.0] * (t - len(steps[i])) if tir else mask[i].tolist() for i in range(b)]
    groups = {}
    for i in range(b):
        if not tir or mask[i].sum() > 0:
            groups.setdefault(index[i], []).append(i)
    base = [[0.0] * t for _ in range(b)]
    for rows in groups.values():
        if len(rows) == 1:
            continue
        for k in range(t):
            num = sum(G[i][k] * W[i][k] * m[i][k] for i in rows)
            den = sum(W[i][k] * m[i][k] for i in rows) + EPS
            for i in rows:
                base[i][k] = num / den
        if handle_zero_tail:
            lengths = sorted(int(mask[i].sum()) for i in rows)
            longest = [i for i in rows if int(mask[i].sum()) == lengths[-1]]
            if len(longest) == 1 and lengths[-1] > lengths[-2]:
                for k in range(lengths[-2], t):
                    base[longest[0]][k] = 0.0
    adv = torch.zeros(b, t, dtype=F64)
    for i in range(b):
        for k, j in enumerate(steps[i]):
            if mask[i, j]:
                adv[i, j] = G[i][k] - base[i][k]
    returns = torch.tensor([[sum(rewards[i, k].item() for k in range(j, t) if mask[i, k]) if mask[i, j] else 0.0
                             for j in range(t)] for i in range(b)], dtype=F64)
    return adv, returns


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("handle_zero_tail", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_verl_loops(name, with_weights, handle_zero_tail, seed):
    rewards, mask, index, old_lp, sps, weights = _batch(seed)
    weights = weights if with_weights else None
    adv, ret = get_adv_estimator_fn(name)(
        token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old_lp, sum_pi_squared=sps,
        rollout_is_weights=weights, handle_zero_tail=handle_zero_tail)
    ref_adv, ref_ret = _reference(rewards, mask, index, old_lp, sps, weights, handle_zero_tail,
                                  tir=name.startswith("tir"))
    torch.testing.assert_close(adv, ref_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-9, atol=1e-9)
    assert adv[0].abs().sum() > 0 and torch.equal(adv[0], ret[0]), "a group of one keeps its returns"


def test_defaults_and_how_the_two_differ():
    rewards, mask, index, old_lp, sps, _ = _batch(0)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old_lp, sum_pi_squared=sps)
    otb, tir = get_adv_estimator_fn("optimal_token_baseline"), get_adv_estimator_fn("tir_optimal_token_baseline")
    # verl 0.9.1's defaults: the zero tail for both (its trainer passes no handle_zero_tail)
    torch.testing.assert_close(otb(**kw)[0], _reference(rewards, mask, index, old_lp, sps, None, True, False)[0])
    torch.testing.assert_close(tir(**kw)[0], _reference(rewards, mask, index, old_lp, sps, None, True, True)[0])
    # the single longest response (row 10) keeps its whole return past the others' length with the zero tail
    torch.testing.assert_close(tir(**kw)[0][10, 3:6], otb(**kw)[1][10, 3:6])
    torch.testing.assert_close(otb(**kw)[0][10, 3:6], otb(**kw)[1][10, 3:6])
    # an empty response's group-mate (row 2): its own group of one under tir (A = G); under
    # optimal_token_baseline the single longest of a group of two, the other of length 0, so the
    # zero tail leaves it A = G too; without the zero tail its only weight is its own (A about 0)
    torch.testing.assert_close(tir(**kw)[0][2], otb(**kw)[1][2])
    torch.testing.assert_close(otb(**kw)[0][2], otb(**kw)[1][2])
    assert otb(**kw, handle_zero_tail=False)[0][2].abs().max() < 1e-6 < otb(**kw)[1][2].abs().max()
    # prefix masks and no empty response: the same advantages
    full = (torch.arange(7)[None, :] < torch.tensor([3, 5, 7, 7, 2, 6, 4, 4])[:, None]).long()
    idx = np.array([0, 0, 1, 1, 1, 2, 2, 2])
    kw = dict(token_level_rewards=rewards[:8] * full, response_mask=full, index=idx, old_log_probs=old_lp[:8],
              sum_pi_squared=sps[:8])
    torch.testing.assert_close(tir(**kw)[0], otb(**kw)[0], rtol=1e-12, atol=1e-12)


def test_zero_tail_by_default_by_hand():
    """One group of lengths 6, 3, 2, outcome rewards 1, 0, 1 and the same w at every token, so B_t is
    the mean return of the rows still running: 2/3 over the first two columns, 1/2 at the third,
    then row 0's own 1, which the zero tail replaces by 0 from column 3 (the second-longest length)
    on: row 0's advantages 1/3, 1/3, 1/2, 1, 1, 1 (0 there without the zero tail)."""
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 2])[:, None]).long()
    rewards = torch.zeros(3, 6, dtype=F64)
    rewards[0, 5], rewards[2, 1] = 1.0, 1.0
    same_w = dict(old_log_probs=torch.full((3, 6), -0.7, dtype=F64), sum_pi_squared=torch.full((3, 6), 0.3, dtype=F64))
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, _ = get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0, 0]),
                                            **same_w)
        torch.testing.assert_close(adv[0], torch.tensor([1 / 3, 1 / 3, 1 / 2, 1, 1, 1], dtype=F64), rtol=1e-7,
                                   atol=1e-7)


def test_equal_path_variance_gives_the_group_mean_of_the_returns():
    """With the same w at every token and equal lengths, B_t is the group's mean return-to-go:
    outcome rewards give A = s - mean(s), GRPO without the std."""
    mask = torch.ones(4, 3, dtype=torch.long)
    rewards = torch.zeros(4, 3, dtype=F64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 2.0])
    old_lp = torch.full((4, 3), -0.7, dtype=F64)
    sps = torch.full((4, 3), 0.3, dtype=F64)
    adv, _ = get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0, 1, 1]), old_log_probs=old_lp,
        sum_pi_squared=sps)
    want = torch.tensor([0.5, -0.5, -0.75, 0.75], dtype=F64)[:, None].expand(4, 3)
    torch.testing.assert_close(adv, want, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_needs_sum_pi_squared(name):
    rewards, mask, index, old_lp, sps, _ = _batch(0)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=index,
                                   old_log_probs=old_lp, sum_pi_squared=None)
