"""ppo.core_algos against float64 references written out as plain loops, and hand values."""

import math

import numpy as np
import pytest
import torch

from ppo import core_algos
from ppo import (
    ADV_ESTIMATOR_INPUTS,
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    count_loss_units,
    get_adv_estimator_fn,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    register_adv_est,
    register_policy_loss,
)

F64 = torch.float64


def make_mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# Rows: empty, full, right-padded (two lengths), and a multi-turn row with an interior hole.
MASK = make_mask(
    [
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 0],
    ]
)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def valid_positions(mask_row):
    return [t for t, m in enumerate(mask_row.tolist()) if m]


def ref_mean_var(values, mask):
    xs = [values[i][t] for i in range(len(values)) for t in valid_positions(mask[i])]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, var


def ref_whiten(values, mask):
    mean, var = ref_mean_var(values, mask)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def test_masked_reductions_match_reference():
    values = rand(*MASK.shape)
    values_l = values.tolist()
    total = sum(values_l[i][t] for i in range(6) for t in valid_positions(MASK[i]))
    count = int(MASK.sum())
    assert masked_sum(values, MASK).item() == pytest.approx(total, rel=1e-12)
    assert masked_mean(values, MASK).item() == pytest.approx(total / count, rel=1e-12)
    mean, var = ref_mean_var(values_l, MASK)
    assert masked_var(values, MASK).item() == pytest.approx(var, rel=1e-12)
    assert masked_var(values, MASK, unbiased=False).item() == pytest.approx(var * (count - 1) / count, rel=1e-12)

    row_means = masked_mean(values, MASK, axis=-1)
    for i in range(6):
        pos = valid_positions(MASK[i])
        expected = sum(values_l[i][t] for t in pos) / len(pos) if pos else 0.0
        assert row_means[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)

    white = masked_whiten(values, MASK)
    expected = ref_whiten(values_l, MASK)
    for i in range(6):
        for t in valid_positions(MASK[i]):
            assert white[i, t].item() == pytest.approx(expected[i][t], rel=1e-9)
    unshifted = masked_whiten(values, MASK, shift_mean=False)
    torch.testing.assert_close(unshifted, white + mean)


def test_masked_mean_ignores_nan_padding_and_empty_mask_is_zero():
    values = rand(*MASK.shape).requires_grad_(True)
    poisoned = values.masked_fill(MASK == 0, float("nan"))
    out = masked_mean(poisoned, MASK)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(values.grad).all()
    torch.testing.assert_close(values.grad, MASK.to(F64) / MASK.sum())

    empty = torch.zeros_like(MASK)
    values.grad = None
    out = masked_mean(values, empty)
    out.backward()
    assert out.item() == 0.0
    assert (values.grad == 0).all()


def test_masked_var_needs_two_elements():
    values = rand(2, 3)
    with pytest.raises(ValueError, match="empty"):
        masked_var(values, torch.zeros(2, 3))
    one = torch.zeros(2, 3)
    one[1, 2] = 1
    with pytest.raises(ValueError, match="single"):
        masked_var(values, one)


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 0.1]], dtype=F64)
    mask = torch.ones(1, 3)
    # gamma = lam = 1: A2 = 1 - 0.1 = 0.9; A1 = (0.1 - 0.2) + 0.9 = 0.8; A0 = (0.2 - 0.5) + 0.8 = 0.5.
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]], dtype=F64))
    # Whitened [0.5, 0.8, 0.9]: mean 11/15, unbiased std sqrt(13/300).
    raw = torch.tensor([[0.5, 0.8, 0.9]], dtype=F64)
    torch.testing.assert_close(advantages, (raw - 11 / 15) / math.sqrt(13 / 300 + 1e-8))


# The backward recursions run as block matrix products (`SUFFIX_BLOCK` columns each) with a carry
# between blocks: blocks of 2 columns put every boundary case (a carry across holes, a last block
# of one column) into these 7-column references.
BLOCKS = pytest.mark.parametrize("block", [2, core_algos.SUFFIX_BLOCK])


@BLOCKS
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_skipping_masked_positions(gamma, lam, block, monkeypatch):
    monkeypatch.setattr(core_algos, "SUFFIX_BLOCK", block)
    rewards = rand(*MASK.shape, seed=1)
    values = rand(*MASK.shape, seed=2)
    # Garbage outside the mask must not matter.
    rewards = rewards.masked_fill(MASK == 0, 123.0)
    values = values.masked_fill(MASK == 0, float("nan"))
    advantages, returns = compute_gae_advantage_return(rewards, values, MASK, gamma, lam)

    r, v = rewards.tolist(), values.tolist()
    raw = [[0.0] * MASK.shape[1] for _ in range(MASK.shape[0])]
    ref_returns = [[0.0] * MASK.shape[1] for _ in range(MASK.shape[0])]
    for i in range(MASK.shape[0]):
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid_positions(MASK[i])):
            delta = r[i][t] + gamma * next_value - v[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[i][t]
            raw[i][t] = next_adv
            ref_returns[i][t] = next_adv + v[i][t]
    white = ref_whiten(raw, MASK)
    for i in range(MASK.shape[0]):
        for t in range(MASK.shape[1]):
            if MASK[i, t]:
                assert returns[i, t].item() == pytest.approx(ref_returns[i][t], rel=1e-10, abs=1e-12)
                assert advantages[i, t].item() == pytest.approx(white[i][t], rel=1e-8, abs=1e-10)
            else:
                assert returns[i, t].item() == 0.0 and advantages[i, t].item() == 0.0


GROUPS_STR = np.array(["a", "b", "a", "c", "b", "a"], dtype=object)
GROUPS_INT = np.array([7, 3, 7, 1, 3, 7])


def ref_group_scores(scores, groups):
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(scores[i])
    return members


@pytest.mark.parametrize("groups", [GROUPS_STR, GROUPS_INT, GROUPS_INT.tolist(), torch.tensor(GROUPS_INT)])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(groups, norm):
    rewards = rand(*MASK.shape, seed=3)
    advantages, returns = compute_grpo_outcome_advantage(rewards, MASK, groups, norm_adv_by_std_in_grpo=norm)
    scores = rewards.sum(-1).tolist()
    keys = [int(g) if isinstance(g, (torch.Tensor, np.integer)) else g for g in groups]
    members = ref_group_scores(scores, keys)
    for i in range(6):
        group = members[keys[i]]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        expected = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
        for t in range(7):
            want = expected if MASK[i, t] else 0.0
            assert advantages[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert returns is advantages


def test_grpo_hand_values():
    # Group scores [1, 0, 1]: mean 2/3, std sqrt(1/3) -> advantages 1/sqrt(3), -2/sqrt(3), 1/sqrt(3).
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]], dtype=F64)
    mask = torch.ones(3, 2)
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["u", "u", "u"], dtype=object), epsilon=0.0)
    s = 1 / math.sqrt(3)
    torch.testing.assert_close(advantages[:, 0], torch.tensor([s, -2 * s, s], dtype=F64))


def test_rloo_matches_reference():
    rewards = rand(*MASK.shape, seed=4)
    advantages, _ = compute_rloo_outcome_advantage(rewards, MASK, GROUPS_STR)
    scores = rewards.sum(-1).tolist()
    members = ref_group_scores(scores, list(GROUPS_STR))
    for i in range(6):
        group = members[GROUPS_STR[i]]
        n = len(group)
        expected = scores[i] - (sum(group) - scores[i]) / (n - 1) if n > 1 else scores[i]
        for t in range(7):
            want = expected if MASK[i, t] else 0.0
            assert advantages[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)


@BLOCKS
def test_reinforce_plus_plus_matches_reference(block, monkeypatch):
    monkeypatch.setattr(core_algos, "SUFFIX_BLOCK", block)
    rewards = rand(*MASK.shape, seed=5).masked_fill(MASK == 0, 123.0)  # rewards outside the mask are ignored
    gamma = 0.9
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, MASK, gamma)
    r = rewards.tolist()
    ref_returns = [[0.0] * 7 for _ in range(6)]
    for i in range(6):
        running = 0.0
        for t in reversed(range(7)):
            if MASK[i, t]:  # a masked position is skipped: the return carries across it
                running = r[i][t] + gamma * running
                ref_returns[i][t] = running
    white = ref_whiten(ref_returns, MASK)
    for i in range(6):
        for t in range(7):
            if MASK[i, t]:
                assert returns[i, t].item() == pytest.approx(ref_returns[i][t], rel=1e-10)
                assert advantages[i, t].item() == pytest.approx(white[i][t], rel=1e-8, abs=1e-10)
            else:
                assert returns[i, t].item() == 0.0 and advantages[i, t].item() == 0.0


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's valid positions moved to the front, in order (the row without its holes)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        pos = valid_positions(mask[i])
        out[i, :len(pos)] = x[i, pos]
    return out


def test_gae_and_reinforce_plus_plus_treat_a_hole_as_absent():
    """One rule for masked tokens: a response with an observation span (a hole in the mask)
    gets, on its valid tokens, exactly what the same response without the span gets."""
    mask = make_mask([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 0, 0, 0, 0],
                      [0, 0, 1, 1, 1, 1, 1]])
    compact_mask = _compact(mask, mask)
    rewards = rand(*mask.shape, seed=11)
    values = rand(*mask.shape, seed=12)
    # The outcome reward on each row's last valid token, as the trainer places it.
    outcome = torch.zeros_like(rewards)
    for i in range(mask.shape[0]):
        outcome[i, valid_positions(mask[i])[-1]] = 1.0 + i
    for r in (rewards, outcome):
        with_hole = {"gae": compute_gae_advantage_return(r, values, mask, 0.9, 0.8),
                     "reinforce++": compute_reinforce_plus_plus_outcome_advantage(r, mask, 0.9)}
        r_c, v_c = _compact(r, mask), _compact(values, mask)
        without = {"gae": compute_gae_advantage_return(r_c, v_c, compact_mask, 0.9, 0.8),
                   "reinforce++": compute_reinforce_plus_plus_outcome_advantage(r_c, compact_mask, 0.9)}
        for name, (adv, ret) in with_hole.items():
            adv_c, ret_c = without[name]
            torch.testing.assert_close(_compact(ret, mask), ret_c, rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(_compact(adv, mask), adv_c, rtol=1e-12, atol=1e-12, msg=name)
    # Hand values, gamma 0.5: reward 1 on the last token of [a, a, obs, obs, a, a] reaches the
    # first action as 0.5^3 (three valid steps later), not 0 (a reset) nor 0.5^5 (the span counted).
    _, ret = compute_reinforce_plus_plus_outcome_advantage(torch.tensor([[0, 0, 0, 0, 0, 1.0]], dtype=F64),
                                                            make_mask([[1, 1, 0, 0, 1, 1]]), 0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 0, 0, 0.5, 1.0]], dtype=F64))


def test_reinforce_plus_plus_baseline_matches_reference():
    rewards = rand(*MASK.shape, seed=6)
    advantages, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, MASK, GROUPS_INT)
    scores = rewards.sum(-1).tolist()
    members = ref_group_scores(scores, GROUPS_INT.tolist())
    centred = []
    for i in range(6):
        group = members[GROUPS_INT[i]]
        mean = sum(group) / len(group) if len(group) > 1 else 0.0
        centred.append([scores[i] - mean] * 7)
    white = ref_whiten(centred, MASK)
    for i in range(6):
        for t in range(7):
            want = white[i][t] if MASK[i, t] else 0.0
            assert advantages[i, t].item() == pytest.approx(want, rel=1e-8, abs=1e-10)


PAIRS = np.array([2, 0, 1, 1, 0, 2])  # three groups of two; group 2 holds the empty response (row 0)


def test_every_estimator_takes_the_same_keywords_and_matches_its_direct_call():
    rewards, values = rand(6, 7, seed=30), rand(6, 7, seed=31)
    baselines = rand(6, seed=32)
    old_lp, sps, weights = -rand(6, 7, seed=33).abs(), rand(6, 7, seed=34).abs() / 4, rand(6, 7, seed=35).abs()
    inputs = dict(token_level_rewards=rewards, response_mask=MASK, values=values, index=GROUPS_INT, gamma=0.9,
                  lam=0.8, norm_adv_by_std_in_grpo=False, reward_baselines=baselines, old_log_probs=old_lp,
                  sum_pi_squared=sps, rollout_is_weights=weights)
    assert set(inputs) == set(ADV_ESTIMATOR_INPUTS)
    direct = {
        "gae": compute_gae_advantage_return(rewards, values, MASK, 0.9, 0.8),
        "grpo": compute_grpo_outcome_advantage(rewards, MASK, GROUPS_INT, norm_adv_by_std_in_grpo=False),
        "rloo": compute_rloo_outcome_advantage(rewards, MASK, GROUPS_INT),
        "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage(rewards, MASK, 0.9),
        "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, MASK,
                                                                                                GROUPS_INT),
        "grpo_vectorized": core_algos.compute_grpo_vectorized_outcome_advantage(rewards, MASK, GROUPS_INT,
                                                                                norm_adv_by_std_in_grpo=False),
        "gdpo": core_algos.compute_gdpo_outcome_advantage(rewards, MASK, GROUPS_INT),
        "rloo_vectorized": core_algos.compute_rloo_vectorized_outcome_advantage(rewards, MASK, GROUPS_INT),
        "grpo_passk": core_algos.compute_grpo_passk_outcome_advantage(rewards, MASK, PAIRS,
                                                                      norm_adv_by_std_in_grpo=False),
        "opo": core_algos.compute_opo_outcome_advantage(rewards, MASK, GROUPS_INT),
        "gpg": core_algos.compute_gpg_outcome_advantage(rewards, MASK, GROUPS_INT),
        "remax": core_algos.compute_remax_outcome_advantage(rewards, MASK, baselines),
        "optimal_token_baseline": core_algos.compute_optimal_token_baseline_advantage(rewards, MASK, GROUPS_INT,
                                                                                      old_lp, sps, weights),
        "tir_optimal_token_baseline": core_algos.compute_multi_turn_optimal_token_baseline_advantage(
            rewards, MASK, GROUPS_INT, old_lp, sps, weights),
    }
    for name, fn in ADV_ESTIMATORS.items():
        # pass@k needs two responses a group at least
        for got, want in zip(fn(**(inputs | {"index": PAIRS} if name == "grpo_passk" else inputs)), direct[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs values"):
        compute_gae_advantage_return(**(inputs | {"values": None}))


def test_registration_refuses_another_signature():
    with pytest.raises(TypeError, match="lacks \\['values'"):
        register_adv_est("no_values")(lambda token_level_rewards, response_mask, index, gamma, lam,
                                      norm_adv_by_std_in_grpo: None)
    with pytest.raises(TypeError, match="needs \\['baseline'\\]"):
        register_policy_loss("extra")(lambda old_log_prob, log_prob, advantages, response_mask, cliprange,
                                      cliprange_low, cliprange_high, clip_ratio_c, loss_agg_mode,
                                      rollout_is_weights, baseline: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(compute_policy_loss)
    assert "no_values" not in ADV_ESTIMATORS and "extra" not in POLICY_LOSSES

def test_adv_estimator_registry():
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                   "grpo_vectorized", "gdpo", "rloo_vectorized", "grpo_passk", "opo", "gpg", "remax",
                                   "optimal_token_baseline", "tir_optimal_token_baseline"}
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        get_adv_estimator_fn("vtrace")
    with pytest.raises(ValueError, match="index"):
        compute_grpo_outcome_advantage(torch.zeros(3, 2), torch.ones(3, 2), np.array([0, 1]))


def ref_agg(loss, mask, mode, scale=None):
    """Local mean of each mode over non-empty rows, written out plainly."""
    rows = [(i, valid_positions(mask[i])) for i in range(mask.shape[0])]
    if mode in ("token-mean", "token-sum"):
        terms = [loss[i][t] for i, pos in rows for t in pos]
        if mode == "token-sum":
            return sum(terms)
        return sum(terms) / len(terms) if terms else 0.0
    seq = []
    for i, pos in rows:
        if not pos:
            continue
        token_sum = sum(loss[i][t] for t in pos)
        if mode == "seq-mean-token-sum":
            seq.append(token_sum)
        elif mode == "seq-mean-token-mean":
            seq.append(token_sum / len(pos))
        else:
            seq.append(token_sum / (scale or mask.shape[1]))
    return sum(seq) / len(seq) if seq else 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_local_matches_reference(mode):
    loss = rand(*MASK.shape, seed=7)
    loss_with_pad_nan = loss.masked_fill(MASK == 0, float("nan"))
    out = agg_loss(loss_with_pad_nan, MASK, mode)
    assert out.item() == pytest.approx(ref_agg(loss.tolist(), MASK, mode), rel=1e-12)
    assert agg_loss(loss, torch.zeros_like(MASK), mode).item() == 0.0
    if mode == "seq-mean-token-sum-norm":
        out = agg_loss(loss, MASK, mode, loss_scale_factor=20)
        assert out.item() == pytest.approx(ref_agg(loss.tolist(), MASK, mode, scale=20), rel=1e-12)


def test_count_loss_units_and_agg_errors():
    # a tensor, and the NumPy array the trainer's update planning counts (6 rows, one empty)
    for mask in (MASK, MASK.numpy()):
        assert count_loss_units(mask, "token-mean") == count_loss_units(mask, "token-sum") == 20.0
        for mode in LOSS_AGG_MODES[2:]:
            assert count_loss_units(mask, mode) == 5.0
    loss = rand(*MASK.shape)
    with pytest.raises(ValueError, match="global_num_seqs"):
        agg_loss(loss, MASK, "seq-mean-token-mean", global_num_tokens=20)
    with pytest.raises(ValueError, match="global_num_tokens"):
        agg_loss(loss, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, MASK, "sum")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        count_loss_units(MASK, "seq-sum")


def _toy_loss_mat(theta, features):
    # Non-linear in theta so that per-token gradients differ in size and direction.
    z = features @ theta
    return torch.tanh(z) + 0.5 * z**2


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_normalisation_equals_full_batch_gradient(mode):
    gen = torch.Generator().manual_seed(11)
    batch, length, dim = 8, 9, 3
    lengths = [9, 1, 0, 4, 7, 2, 9, 5]
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in lengths])
    features = torch.randn(batch, length, dim, generator=gen, dtype=F64)
    theta0 = torch.randn(dim, generator=gen, dtype=F64)
    scale = float(length) if mode == "seq-mean-token-sum-norm" else None

    theta = theta0.clone().requires_grad_(True)
    agg_loss(_toy_loss_mat(theta, features), mask, mode, loss_scale_factor=scale).backward()
    full_grad = theta.grad.clone()

    # 4 micro-batches of uneven sizes, each trimmed to its own longest response.
    splits = [(0, 1), (1, 4), (4, 6), (6, 8)]
    micro = []
    for lo, hi in splits:
        width = max(1, int(mask[lo:hi].sum(-1).max()))
        micro.append((features[lo:hi, :width], mask[lo:hi, :width]))
    global_count = sum(count_loss_units(m, mode) for _, m in micro)
    key = "global_num_tokens" if mode.startswith("token") else "global_num_seqs"  # (token-sum reads no count)

    dp_size = 2
    rank_grads, naive_grads = [], []
    for rank in range(dp_size):
        theta = theta0.clone().requires_grad_(True)
        naive = theta0.clone().requires_grad_(True)
        mbs = micro[rank * 2 : rank * 2 + 2]
        for feats, m in mbs:
            kwargs = {key: global_count, "dp_size": dp_size, "loss_scale_factor": scale}
            agg_loss(_toy_loss_mat(theta, feats), m, mode, **kwargs).backward()
            # verl's scheme: local mean per micro-batch, divided by the number of micro-batches.
            (agg_loss(_toy_loss_mat(naive, feats), m, mode, loss_scale_factor=scale) / len(mbs)).backward()
        rank_grads.append(theta.grad)
        naive_grads.append(naive.grad)
    averaged = sum(rank_grads) / dp_size  # what FSDP's gradient reduce-scatter does
    torch.testing.assert_close(averaged, full_grad, rtol=1e-12, atol=1e-12)
    # The test can tell the two schemes apart: per-micro-batch means give another gradient.
    assert not torch.allclose(sum(naive_grads) / dp_size, full_grad, rtol=1e-6, atol=1e-9)


def test_token_sum_is_verls_unnormalised_sum():
    """verl 0.9.1's token-sum: the masked sum of the micro-batch's terms times dp_size (the ranks'
    averaged gradients are the global sum's), whatever counts are given; NaN at padding never read."""
    loss = rand(*MASK.shape, seed=9)
    total = sum(loss[i][t].item() for i in range(MASK.shape[0]) for t in valid_positions(MASK[i]))
    padded = loss.masked_fill(MASK == 0, float("nan"))
    assert agg_loss(padded, MASK, "token-sum").item() == pytest.approx(total, rel=1e-12)
    assert agg_loss(padded, MASK, "token-sum", global_num_tokens=44.0, global_num_seqs=9.0,
                    dp_size=3).item() == pytest.approx(3 * total, rel=1e-12)


def test_global_normalisation_accepts_tensor_counts():
    loss = rand(*MASK.shape, seed=8)
    count = torch.tensor(44.0)
    out = agg_loss(loss, MASK, "token-mean", global_num_tokens=count, dp_size=2)
    assert out.item() == pytest.approx(masked_sum(loss, MASK).item() / 44 * 2, rel=1e-12)


def ref_policy_loss(old, new, adv, mask, low, high, c):
    terms, clipped, lower, kl = [], 0, 0, []
    for i in range(len(old)):
        for t in valid_positions(mask[i]):
            ratio = math.exp(min(max(new[i][t] - old[i][t], -20.0), 20.0))
            a = adv[i][t]
            unclipped = -a * ratio
            clipped_loss = -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(unclipped, clipped_loss)
            clipped += clipped_loss > unclipped
            if a < 0:
                lower += loss > -a * c
                loss = min(loss, -a * c)
            terms.append(loss)
            kl.append(old[i][t] - new[i][t])
    n = len(terms)
    return sum(terms) / n, clipped / n, sum(kl) / n, lower / n


@pytest.mark.parametrize("low, high", [(0.2, 0.2), (0.2, 0.28)])
def test_policy_loss_matches_reference(low, high):
    old = rand(*MASK.shape, seed=9) - 2
    new = old + 0.6 * rand(*MASK.shape, seed=10)
    adv = 2 * rand(*MASK.shape, seed=12)
    new[1, 0], adv[1, 0] = old[1, 0] + 1.5, -1.0  # ratio e^1.5 > c with A < 0: the dual clip
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old, new, adv, MASK, cliprange=0.2, cliprange_high=high, clip_ratio_c=3.0
    )
    expected = ref_policy_loss(old.tolist(), new.tolist(), adv.tolist(), MASK, low, high, 3.0)
    got = (pg_loss.item(), clipfrac.item(), ppo_kl.item(), clipfrac_lower.item())
    assert got == pytest.approx(expected, rel=1e-10)
    assert 0 < expected[1] < 1 and 0 < expected[3] < 1  # the data exercises every branch


def test_policy_loss_gradient_branches():
    # Each column is one case; the gradient of -A * r w.r.t. log_prob is -A * r.
    eps_low, eps_high, c = 0.2, 0.28, 3.0
    ratios = [1.1, 1.5, 0.5, 0.5, 2.0, 4.0, 1.25, 1.0]
    advs = [1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 0.5, 9.0]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    expected_grad_unnormalised = [
        -1.0 * 1.1,  # A>0, inside the clip range: unclipped
        0.0,  # A>0, ratio above 1 + eps_high: clipped, no gradient
        -1.0 * 0.5,  # A>0, ratio below 1 - eps_low: the max keeps -A r
        0.0,  # A<0, ratio below 1 - eps_low: clipped
        1.0 * 2.0,  # A<0, ratio in (1 + eps_high, c): -A r is the larger
        0.0,  # A<0, ratio above c: dual clip, constant -A c
        -0.5 * 1.25,  # clip-higher: 1.25 < 1.28 is not clipped (it would be with eps 0.2)
        0.0,  # masked
    ]
    new = torch.zeros(1, 8, dtype=F64, requires_grad=True)
    old = -torch.log(torch.tensor([ratios], dtype=F64))
    adv = torch.tensor([advs], dtype=F64)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old, new, adv, mask, cliprange=eps_low, cliprange_high=eps_high, clip_ratio_c=c
    )
    pg_loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([expected_grad_unnormalised], dtype=F64) / 7)
    expected_loss = (-1.1 - 1.28 - 0.5 + 0.8 + 2.0 + 6.0 - 0.5 * 1.25) / 7
    assert pg_loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert clipfrac.item() == pytest.approx(2 / 7)  # cases 2 and 4
    assert clipfrac_lower.item() == pytest.approx(1 / 7)  # case 6
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in ratios[:7]) / 7)  # old - new = -log r
    assert not (clipfrac.requires_grad or ppo_kl.requires_grad or clipfrac_lower.requires_grad)


def test_policy_loss_forwards_global_normalisation_and_validates():
    old = rand(*MASK.shape, seed=13)
    new = rand(*MASK.shape, seed=14)
    adv = rand(*MASK.shape, seed=15)
    local, *_ = compute_policy_loss(old, new, adv, MASK, cliprange=0.2)
    scaled, *_ = compute_policy_loss(old, new, adv, MASK, cliprange=0.2, global_num_tokens=44, dp_size=4)
    assert scaled.item() == pytest.approx(local.item() * 20 / 44 * 4, rel=1e-12)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, MASK, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_loss(old, new, adv, MASK)


def test_value_loss_reference_and_gradients():
    c = 0.2
    vpreds = torch.tensor([[0.5, 0.5, 0.1, 3.0]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=F64)
    values = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=c)
    # Token 0: unclipped 0.25 < clipped (0.2 - 1)^2 = 0.64 -> clipped branch, no gradient.
    # Token 1: unclipped 0.25 > clipped 0.04 -> gradient (v - R) = 0.5.
    # Token 2: inside the clip range, both equal 0.81 -> gradient (v - R) = -0.9.
    assert vf_loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.81) / 3, rel=1e-12)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)
    vf_loss.backward()
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.5, -0.9, 0.0]], dtype=F64) / 3)

    vpreds = rand(*MASK.shape, seed=16)
    returns = rand(*MASK.shape, seed=17)
    values = vpreds + 0.3 * rand(*MASK.shape, seed=18)
    got, _ = compute_value_loss(vpreds, returns, values, MASK, 0.1, loss_agg_mode="seq-mean-token-mean")
    v, r, old = vpreds.tolist(), returns.tolist(), values.tolist()
    per_token = [
        [max((v[i][t] - r[i][t]) ** 2, (min(max(v[i][t], old[i][t] - 0.1), old[i][t] + 0.1) - r[i][t]) ** 2)
         for t in range(7)]
        for i in range(6)
    ]
    assert got.item() == pytest.approx(0.5 * ref_agg(per_token, MASK, "seq-mean-token-mean"), rel=1e-12)
