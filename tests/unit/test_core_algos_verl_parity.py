"""Where meshppo's policy losses deliberately differ from verl 0.9.1's (docs/VERL.md, "Algorithms"),
pinned against float64 values computed here by hand: geo_mean's normalisation, the [-20, 20]
log-ratio clamp of clip_cov, kl_cov and geo_mean, and the clip range that `actor.clip_ratio`
alone sets."""

import math

import pytest
import torch

from ppo.core_algos import LOG_RATIO_BOUND, PolicyLossParams, get_policy_loss_fn
from trainer.config import PPOConfig
from trainer.configlib import load_config

F64 = torch.float64


def _geo_inputs():
    """Four responses, the third empty, with a log-ratio per token inside the clip range of 0.2 / 0.28
    (so the log-space clip changes nothing and each sequence's ratio is exp of its mean log-ratio)."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=F64)
    log_ratio = torch.tensor([[0.1, -0.05, 0.15, 0.0], [-0.1, 0.05, 0.0, 0.0], [0.0] * 4, [0.02, 0.04, -0.06, 0.1]],
                             dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0], [0.0] * 4, [0.5, 0.5, 0.5, 0.5]], dtype=F64)
    old = torch.full_like(mask, -1.0)
    return old, old + log_ratio, adv, mask


def _geo_sequence_losses():
    """-mean_t(A) * exp(mean_t log-ratio) of each non-empty response, by hand."""
    return [-1.0 * math.exp((0.1 - 0.05 + 0.15) / 3), 2.0 * math.exp((-0.1 + 0.05) / 2),
            -0.5 * math.exp((0.02 + 0.04 - 0.06 + 0.1) / 4)]


def _geo(old, logp, adv, mask, **agg):
    return get_policy_loss_fn("geo_mean")(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                          cliprange_low=0.2, cliprange_high=0.28, **agg).pg_loss


def test_geo_mean_is_the_mean_over_the_mini_batchs_non_empty_sequences():
    """meshppo's geo_mean: the sum of the sequence losses over the mini-batch's non-empty sequences,
    whatever its micro-batches. verl 0.9.1's takes torch.mean over each micro-batch's rows (the empty
    one included) and its engine adds those means up: 1/3 of the first two losses plus 1/2 of the
    last with these micro-batches, not the mean of the three."""
    old, logp, adv, mask = _geo_inputs()
    seq = _geo_sequence_losses()
    mean = sum(seq) / 3
    assert _geo(old, logp, adv, mask).item() == pytest.approx(mean, rel=1e-12)
    counts = {"global_num_seqs": 3.0, "global_num_tokens": float(mask.sum())}
    halves = [_geo(old[rows], logp[rows], adv[rows], mask[rows], **counts) for rows in ([0, 1, 2], [3])]
    assert (halves[0] + halves[1]).item() == pytest.approx(mean, rel=1e-12)
    # two ranks, one micro-batch each, gradients averaged: each rank's loss times dp_size, halved
    ranks = [_geo(old[rows], logp[rows], adv[rows], mask[rows], dp_size=2, **counts) for rows in ([0, 1], [2, 3])]
    assert ((ranks[0] + ranks[1]) / 2).item() == pytest.approx(mean, rel=1e-12)
    verl = (seq[0] + seq[1]) / 3 + seq[2] / 1
    assert abs(verl - mean) > 0.1


def _one_token(mode, log_ratio, adv, **params):
    """The loss of one token of log-prob -30 + log_ratio and its gradient w.r.t. that log-prob."""
    old = torch.tensor([[-30.0]], dtype=F64)
    logp = (old + log_ratio).requires_grad_(True)
    out = get_policy_loss_fn(mode)(old_log_prob=old, log_prob=logp, advantages=torch.tensor([[adv]], dtype=F64),
                                   response_mask=torch.ones(1, 1, dtype=F64), cliprange=0.2,
                                   loss_params=PolicyLossParams(**params))
    out.pg_loss.backward()
    return out.pg_loss.item(), logp.grad.item()


def test_clip_cov_kl_cov_and_geo_mean_clamp_the_log_ratio_at_20():
    """A token at log-ratio 25 with advantage -2: meshppo's ratio is e^20 there, as in verl's vanilla,
    dppo, sapo and cispo; verl's clip_cov, kl_cov and geo_mean exponentiate the 25 (a loss e^5 = 148
    times larger, whose gradient the clamp stops)."""
    big = math.exp(LOG_RATIO_BOUND)
    loss, grad = _one_token("clip_cov", 25.0, -2.0)  # its covariance term, 0, is not in (lb, ub): kept
    assert loss == pytest.approx(2.0 * big, rel=1e-12) and grad == 0.0
    loss, grad = _one_token("kl_cov", 25.0, -2.0, kl_cov_ratio=1.0, ppo_kl_coef=0.1)  # the one token is chosen
    assert loss == pytest.approx(2.0 * big + 0.1 * 25.0, rel=1e-12) and grad == pytest.approx(0.1, rel=1e-12)
    loss, grad = _one_token("geo_mean", 25.0, -2.0)  # a negative advantage keeps the larger log-ratio
    assert loss == pytest.approx(2.0 * big, rel=1e-12) and grad == 0.0
    # inside the bound the three exponentiate as verl's do
    assert _one_token("geo_mean", 15.0, -2.0)[0] == pytest.approx(2.0 * math.exp(15.0), rel=1e-12)


def test_geo_mean_clamps_a_token_below_minus_20_inside_its_sequences_mean():
    """geo_mean exponentiates the sequence's mean log-ratio: a token at -30 beside one at 0, advantage 1
    (the pessimistic side keeps the -30), gives meshppo exp(mean(-20, 0)) = e^-10, where verl's
    exp(mean(-30, 0)) = e^-15 is e^((30 - 20) / 2) times smaller, not a ratio under 2e-9 in both."""
    old = torch.tensor([[-40.0, -1.0]], dtype=F64)
    logp = old + torch.tensor([[-30.0, 0.0]], dtype=F64)
    out = get_policy_loss_fn("geo_mean")(old_log_prob=old, log_prob=logp, advantages=torch.ones(1, 2, dtype=F64),
                                         response_mask=torch.ones(1, 2, dtype=F64), cliprange=0.2)
    assert out.pg_loss.item() == pytest.approx(-math.exp(-10.0), rel=1e-12)
    verl = -math.exp((-30.0 + 0.0) / 2)
    assert out.pg_loss.item() / verl == pytest.approx(math.exp((30.0 - LOG_RATIO_BOUND) / 2), rel=1e-12)


def test_clip_ratio_alone_sets_both_sides_of_the_clip():
    """clip_ratio_low / clip_ratio_high default to null (clip_ratio); verl's yaml sets both to 0.2, so
    there `actor.clip_ratio=0.3` alone leaves the clip at 0.2. A ratio of 1.25 with advantage 1 is
    inside meshppo's clip (loss -1.25), outside verl's (-1.2)."""
    actor = load_config(PPOConfig, None, ["actor_rollout_ref.actor.clip_ratio=0.3"]).actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (None, None)
    old = torch.tensor([[-1.0]], dtype=F64)
    out = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=old + math.log(1.25),
                                        advantages=torch.ones(1, 1, dtype=F64), response_mask=torch.ones(1, 1, dtype=F64),
                                        cliprange=actor.clip_ratio, cliprange_low=actor.clip_ratio_low,
                                        cliprange_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c)
    assert out.pg_loss.item() == pytest.approx(-1.25, rel=1e-12)


@pytest.mark.parametrize("mode", ["gpg", "kl_cov", "dro", "clip_cov"])
def test_the_statistics_a_loss_lacks_in_verl_are_zero(mode):
    """verl's gpg returns no statistic, kl_cov and dro only ppo_kl, clip_cov no pg_clipfrac_lower; meshppo's
    report 0 for the clip they lack, and gpg the mean of old - new log-prob (verl's reinforce's ppo_kl)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    logp = old + torch.tensor([[0.3, -0.1, 0.4]], dtype=F64)
    out = get_policy_loss_fn(mode)(old_log_prob=old, log_prob=logp, advantages=torch.tensor([[1.0, -1.0, 2.0]], dtype=F64),
                                   response_mask=torch.ones(1, 3, dtype=F64), cliprange=0.2,
                                   loss_params=PolicyLossParams(dro_beta=0.5))
    assert out.pg_clipfrac_lower.item() == 0.0
    if mode != "clip_cov":
        assert out.pg_clipfrac.item() == 0.0
    if mode == "gpg":
        assert out.ppo_kl.item() == pytest.approx(-(0.3 - 0.1 + 0.4) / 3, rel=1e-12)
