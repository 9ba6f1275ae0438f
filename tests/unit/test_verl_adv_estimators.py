"""verl's other outcome advantage estimators (`grpo_vectorized`, `gdpo`, `rloo_vectorized`, `grpo_passk`,
`opo`, `gpg`) against per-group loops written here from verl's definitions, in float64: random
scores with ties and zeros, groups of one to four, empty and holed responses."""

import math

import numpy as np
import pytest
import torch

from ppo import get_adv_estimator_fn

F64 = torch.float64
EPS = 1e-6


def _batch(seed: int, with_singletons: bool = True):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 2, 1] if with_singletons else [2, 3, 4, 2]
    index = np.array([f"u{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    b, t = len(index), 6
    # scores on a coarse grid: ties (also for the best of a group) and exact zeros happen
    scores = torch.randint(0, 4, (b,), generator=g).to(F64) / 2
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    mask[1, 0] = 0  # a hole
    rewards = torch.zeros(b, t, dtype=F64)
    rewards[torch.arange(b), (lengths - 1).clamp(min=0)] = scores
    return rewards, mask, index, scores.tolist(), mask.sum(-1).tolist()


def _groups(index):
    members = {}
    for i, u in enumerate(index):
        members.setdefault(u, []).append(i)
    return members


def _run(name, rewards, mask, index, norm=True):
    adv, ret = get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=index, values=None,
                                          gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=norm)
    assert ret is adv
    return adv


def _check(adv, expected, mask):
    want = torch.tensor(expected, dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized(seed, norm):
    rewards, mask, index, s, _ = _batch(seed)
    expected = [0.0] * len(s)
    for rows in _groups(index).values():
        xs = [s[i] for i in rows]
        if len(xs) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(xs) / len(xs)
            var = (sum(x * x for x in xs) - sum(xs) ** 2 / len(xs)) / (len(xs) - 1)
            std = math.sqrt(max(var, 0.0))  # verl 0.9.1's group_mean_std(eps=0.0): no variance floor
        for i in rows:
            expected[i] = (s[i] - mean) / (std + EPS) if norm else s[i] - mean
    _check(_run("grpo_vectorized", rewards, mask, index, norm), expected, mask)


def test_grpo_vectorized_does_not_floor_a_near_uniform_groups_std():
    """Scores 0.5, 0.5 + 1e-5, 0.5 - 1e-5, 0.5: the std sqrt(2e-10 / 3) = 8.2e-6 is used as it is
    (verl 0.9.1's group_mean_std with eps=0), so the advantages are 0, +-1e-5 / (std + 1e-6) =
    +-1.0911, 0, as grpo's; a floor of the variance at 1e-6 would give +-0.01."""
    rewards = torch.tensor([[0.5], [0.5 + 1e-5], [0.5 - 1e-5], [0.5]], dtype=F64)
    adv = _run("grpo_vectorized", rewards, torch.ones(4, 1), np.array([0, 0, 0, 0]))
    a = 1e-5 / (math.sqrt(2e-10 / 3) + EPS)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, a, -a, 0.0], dtype=F64), rtol=1e-6, atol=1e-9)
    assert a == pytest.approx(1.0911, abs=1e-4)
    torch.testing.assert_close(adv, _run("grpo", rewards, torch.ones(4, 1), np.array([0, 0, 0, 0])), rtol=1e-12,
                               atol=1e-12)


def _verl_gdpo(components, weights, mask, index):
    """verl 0.9.1's compute_gdpo_outcome_advantage as loops: per component grpo's group-normalised
    score (a group of one: mean 0, std 1), their weighted sum, whitened over the valid tokens
    (masked_whiten: unbiased variance, + 1e-8 under the root)."""
    b = len(index)
    combined = [0.0] * b
    for k, w in enumerate(weights):
        for rows in _groups(index).values():
            xs = [components[i][k] for i in rows]
            mean, std = (0.0, 1.0) if len(xs) == 1 else (sum(xs) / len(xs), _std(xs))
            for i in rows:
                combined[i] += w * (components[i][k] - mean) / (std + EPS)
    tokens = [combined[i] for i in range(b) for t in range(mask.shape[1]) if mask[i, t]]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(c - mean) / math.sqrt(var + 1e-8) for c in combined]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gdpo(seed):
    """Two components of different spread (one on a coarse grid with ties, one wide), weights 1 and
    0.5, ragged responses with an empty one and a hole, groups of one to four."""
    rewards, mask, index, _, _ = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    components = torch.stack([torch.randint(0, 2, (len(index),), generator=g).to(F64),
                              10 * torch.randn(len(index), generator=g, dtype=F64)], dim=1)
    adv, ret = get_adv_estimator_fn("gdpo")(token_level_rewards=rewards, response_mask=mask, index=index,
                                            reward_components=components, reward_weights=[1.0, 0.5])
    assert ret is adv
    _check(adv, _verl_gdpo(components.tolist(), [1.0, 0.5], mask, index), mask)
    # without components: the token rewards' sums as the one component (norm_adv_by_std_in_grpo is not read)
    plain = _run("gdpo", rewards, mask, index, norm=False)
    _check(plain, _verl_gdpo(rewards.sum(-1)[:, None].tolist(), [1.0], mask, index), mask)


def test_gdpo_normalises_each_component_on_its_own():
    """One group, a 0/1 component and one a hundred times wider: summed first (grpo), the wide one
    decides the order; normalised apart (gdpo), the 0/1 component weighs as much."""
    mask, index = torch.ones(4, 2), np.array([0, 0, 0, 0])
    components = torch.tensor([[1.0, 0.0], [0.0, 100.0], [1.0, 50.0], [0.0, 50.0]], dtype=F64)
    adv = get_adv_estimator_fn("gdpo")(token_level_rewards=torch.zeros(4, 2), response_mask=mask, index=index,
                                       reward_components=components)[0][:, 0]
    summed = _run("grpo", components.sum(-1, keepdim=True).expand(4, 2) / 2, mask, index)[:, 0]
    assert summed[1] > summed[2] > summed[0]  # the wide component's order
    assert adv[2] > adv[0] and adv[2] > adv[1]  # row 2 does well on both: first under gdpo
    with pytest.raises(ValueError, match="2 reward_weights for 1 reward components"):
        get_adv_estimator_fn("gdpo")(token_level_rewards=torch.zeros(4, 2), response_mask=mask, index=index,
                                     reward_components=components[:, :1], reward_weights=[1.0, 2.0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_vectorized(seed):
    rewards, mask, index, s, _ = _batch(seed)
    expected = [0.0] * len(s)
    for rows in _groups(index).values():
        n = len(rows)
        for i in rows:  # a group of one: 0 (plain rloo keeps the raw score)
            expected[i] = (n * s[i] - sum(s[j] for j in rows)) / (n - 1) if n > 1 else 0.0
    _check(_run("rloo_vectorized", rewards, mask, index), expected, mask)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(seed, norm):
    rewards, mask, index, s, _ = _batch(seed, with_singletons=False)
    expected = [0.0] * len(s)
    for rows in _groups(index).values():
        ranked = sorted(rows, key=lambda i: -s[i])
        best, second = ranked[0], ranked[1]
        gap = s[best] - s[second]
        expected[best] = gap / (_std([s[i] for i in rows]) + EPS) if norm else gap
    _check(_run("grpo_passk", rewards, mask, index, norm), expected, mask)


def test_grpo_passk_hand_values_and_singletons():
    # scores [0.5, 2, 1]: only the best (row 1) learns, by 2 - 1 = 1
    rewards = torch.tensor([[0.5], [2.0], [1.0]], dtype=F64)
    adv = _run("grpo_passk", rewards, torch.ones(3, 1), np.array(["p", "p", "p"]), norm=False)
    assert adv[:, 0].tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="at least 2 responses"):
        _run("grpo_passk", rewards, torch.ones(3, 1), np.array(["p", "p", "q"]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo(seed):
    rewards, mask, index, s, lengths = _batch(seed)
    expected = [0.0] * len(s)
    for rows in _groups(index).values():
        total = sum(lengths[i] for i in rows)
        baseline = sum(lengths[i] * s[i] for i in rows) / total if len(rows) > 1 and total > 0 else 0.0
        for i in rows:
            expected[i] = s[i] - baseline
    _check(_run("opo", rewards, mask, index), expected, mask)


def test_opo_hand_values():
    # scores [1, 0] with 1 and 3 tokens: baseline (1 * 1 + 3 * 0) / 4 = 0.25
    rewards = torch.tensor([[1.0, 0, 0], [0, 0, 0]], dtype=F64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = _run("opo", rewards, mask, np.array([0, 0]))
    assert adv.tolist() == [[0.75, 0, 0], [-0.25, -0.25, -0.25]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg(seed):
    rewards, mask, index, s, _ = _batch(seed)
    alpha = len(s) / max(sum(1 for x in s if x != 0), 1)
    expected = [0.0] * len(s)
    for rows in _groups(index).values():
        mean = sum(s[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            expected[i] = alpha * (s[i] - mean)
    assert any(x == 0 for x in s) and alpha > 1  # the batch rescaling is exercised
    _check(_run("gpg", rewards, mask, index), expected, mask)


def test_remax_hand_values():
    # response 0: rewards [0.1, -0.2, 1.0] (a KL penalty on each token, the score on the last), greedy score 0.5;
    # response 1: a hole at t=1 (its reward is outside the mask and not counted), greedy score 1
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 7.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    adv, ret = get_adv_estimator_fn("remax")(token_level_rewards=rewards, response_mask=mask, index=None,
                                             values=None, gamma=0.9, lam=0.5, norm_adv_by_std_in_grpo=True,
                                             reward_baselines=torch.tensor([0.5, 1.0], dtype=F64))
    # undiscounted returns-to-go over the masked rewards (gamma and lam do not apply), zero outside the mask
    torch.testing.assert_close(ret, torch.tensor([[0.9, 0.8, 1.0], [2.0, 0.0, 2.0]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.3, 0.5], [1.0, 0.0, 1.0]], dtype=F64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="needs reward_baselines"):
        get_adv_estimator_fn("remax")(token_level_rewards=rewards, response_mask=mask, index=None, values=None,
                                      gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, reward_baselines=None)
