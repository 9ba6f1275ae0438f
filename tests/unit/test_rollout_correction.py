"""Rollout correction: importance weights, rejection masks, their place in the policy losses,
the config section, and the actor update in decoupled and bypass mode (hand-computed values)."""

import contextlib
import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models import ModelArgs, Transformer
from trainer.config import PPOConfig
from trainer.configlib import ConfigError, load_config
from ppo.core_algos import (BYPASS_LOSS_TYPES, RejectionCriterion, compute_policy_loss, compute_policy_loss_gpg,
                            compute_rollout_correction, compute_rollout_is_weights, compute_rollout_rejection_mask,
                            get_policy_loss_fn, parse_rollout_is_threshold, parse_rollout_rs)
from trainer.forward import build_micro_batch, response_logprobs
from trainer.roles import Actor, MicroBatching
from tests.unit.test_batching import _actor_cfg, _rollouts

F64 = torch.float64
E = math.e

# Two sequences: log pi_old - log pi_rollout = [0.5, -1.0, 0.0 | pad] and [1.0, 0.2 | pad, pad].
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-2.0, -0.7, 0.0, 0.0]], dtype=F64)
OLD = ROLLOUT + torch.tensor([[0.5, -1.0, 0.0, 7.0], [1.0, 0.2, 9.0, 9.0]], dtype=F64)  # junk at padding


def no_work():
    """A stand-in actor's `count_work` (the old-log-prob pass counts its forwards' work for perf/mfu/actor_infer)."""
    return contextlib.nullcontext(np.zeros(3))



def _k(option, lower, upper):
    return (RejectionCriterion(option, lower, upper),)


def test_token_weights_are_truncated_ratios():
    w = compute_rollout_is_weights(OLD, ROLLOUT, MASK, "token", None, 1.5)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0], [1.5, math.exp(0.2), 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)


def test_sequence_weights_are_one_product_per_sequence():
    w = compute_rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", None, 2.0)
    # exp(0.5 - 1 + 0) = e^-0.5 for every token of row 0; exp(1.2) = 3.32 truncated to 2 in row 1
    expected = torch.tensor([[math.exp(-0.5)] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)


def test_sequence_weight_clamps_the_sum_of_the_log_ratios_not_each_term():
    # verl (rollout_corr_helper.compute_rollout_correction_weights): exp(clamp(sum_t delta_t, -20, 20)).
    # Token log-ratios 25, -24.5, 0 give exp(0.5) = 1.6487, under the threshold 2; clamping each
    # term first gave exp(20 - 20) = 1.
    rollout = torch.tensor([[-30.0, -0.5, -1.0, 0.0]], dtype=F64)
    old = rollout + torch.tensor([[25.0, -24.5, 0.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    w = compute_rollout_is_weights(old, rollout, mask, "sequence", None, 2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5)] * 3 + [0.0]], dtype=F64), rtol=1e-12, atol=0)
    _, _, m = compute_rollout_correction(old, rollout, mask, "sequence", None, 2.0)
    assert math.isclose(float(m["rollout_corr/chi2_seq"]), math.exp(1.0) - 1, rel_tol=1e-12)
    # a sum beyond the bound is clamped: exp(20) truncated to the threshold, chi2 from exp(40)
    old = rollout + torch.tensor([[15.0, 9.0, 0.0, 0.0]], dtype=F64)
    assert compute_rollout_is_weights(old, rollout, mask, "sequence", None, 2.0)[0, 0] == 2.0
    _, _, m = compute_rollout_correction(old, rollout, mask, "sequence", None, 2.0)
    assert math.isclose(float(m["rollout_corr/chi2_seq"]), math.exp(40.0) - 1, rel_tol=1e-12)


def test_icepop_zeroes_weights_outside_the_bounds():
    w = compute_rollout_is_weights(OLD, ROLLOUT, MASK, "token", 0.5, 1.5)
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, math.exp(0.2), 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    seq = compute_rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", 0.5, 1.5)
    torch.testing.assert_close(seq[0, :3], torch.full((3,), math.exp(-0.5), dtype=F64))
    assert torch.all(seq[1] == 0)


def test_weights_are_detached():
    old = OLD.clone().requires_grad_()
    assert not compute_rollout_is_weights(old, ROLLOUT, MASK, "token", None, 2.0).requires_grad


@pytest.mark.parametrize("criteria,expected", [
    # token_k1, C=2: ratio in [0.5, 2], i.e. log-ratio in [-0.69, 0.69]: row 0's -1.0 and row 1's 1.0 fail
    (_k("token_k1", 0.5, 2.0), [[1, 0, 1], [0, 1, 0]]),
    # the bounds are on pi_old / pi_rollout: [0.9, 2] keeps the ratio e^0.5 = 1.65 (verl's code would
    # bound the inverse, 0.61, and reject it)
    (_k("token_k1", 0.9, 2.0), [[1, 0, 1], [0, 1, 0]]),
    (_k("token_k1", 1.2, 2.0), [[1, 0, 0], [0, 1, 0]]),
    # product of the ratios: e^-0.5 = 0.61 and e^1.2 = 3.3
    (_k("seq_sum_k1", 0.5, 2.0), [[1, 1, 1], [0, 0, 0]]),
    # geometric mean: e^(-0.5/3) = 0.85 and e^0.6 = 1.82
    (_k("seq_mean_k1", 0.8, 2.0), [[1, 1, 1], [1, 1, 0]]),
    (_k("seq_mean_k1", 0.9, 2.0), [[0, 0, 0], [1, 1, 0]]),
    # k2 = delta^2 / 2: [0.125, 0.5, 0] and [0.5, 0.02]
    (_k("token_k2", None, 0.2), [[1, 0, 1], [0, 1, 0]]),
    (_k("seq_sum_k2", None, 0.6), [[0, 0, 0], [1, 1, 0]]),   # sums 0.625 and 0.52
    (_k("seq_mean_k2", None, 0.22), [[1, 1, 1], [0, 0, 0]]),  # means 0.2083 and 0.26
    (_k("seq_max_k2", None, 0.4), [[0, 0, 0], [0, 0, 0]]),   # maxima 0.5 and 0.5
    # k3 = e^d - 1 - d: [0.1487, 0.3679, 0] and [0.7183, 0.0214]
    (_k("token_k3", None, 0.2), [[1, 0, 1], [0, 1, 0]]),
    (_k("seq_mean_k3", None, 0.2), [[1, 1, 1], [0, 0, 0]]),  # means 0.1722 and 0.3698
    (_k("seq_sum_k3", None, 0.5), [[0, 0, 0], [0, 0, 0]]),   # sums 0.5166 and 0.7397
    (_k("seq_max_k3", None, 0.72), [[1, 1, 1], [1, 1, 0]]),  # maxima 0.3679 and 0.7183
    # every criterion must pass
    (_k("seq_mean_k1", 0.8, 2.0) + _k("token_k2", None, 0.2), [[1, 0, 1], [0, 1, 0]]),
])
def test_rejection_mask_hand_computed(criteria, expected):
    keep = compute_rollout_rejection_mask(OLD, ROLLOUT, MASK, criteria)
    want = torch.zeros(2, 4, dtype=F64)
    want[:, :3] = torch.tensor(expected, dtype=F64)
    torch.testing.assert_close(keep, want * MASK)


def test_correction_combines_weights_and_rejection_and_reports_metrics():
    rejection = _k("token_k1", 0.5, 2.0)
    weights, keep, m = compute_rollout_correction(OLD, ROLLOUT, MASK, "token", None, 1.5, rejection)
    # the truncated weights, and rejection as a mask of its own (verl's modified response_mask)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0], [1.5, math.exp(0.2), 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=F64))
    deltas = [0.5, -1.0, 0.0, 1.0, 0.2]
    near = lambda key, value: math.isclose(float(m[key]), value, rel_tol=1e-12, abs_tol=1e-12)  # noqa: E731
    assert near("rollout_corr/kl", -sum(deltas) / 5)
    assert near("rollout_corr/k3_kl", sum(math.exp(d) - 1 - d for d in deltas) / 5)
    assert near("rollout_corr/chi2_token", sum(math.exp(2 * d) for d in deltas) / 5 - 1)
    assert near("rollout_corr/chi2_seq", (math.exp(-1.0) + math.exp(2.4)) / 2 - 1)
    old_means, rollout_means = [(-1.0 - 2.0 - 0.5) / 3, (-1.0 - 0.5) / 2], [-1.0, -1.35]
    assert near("rollout_corr/training_ppl", sum(math.exp(-x) for x in old_means) / 2)
    assert near("rollout_corr/rollout_ppl", sum(math.exp(-x) for x in rollout_means) / 2)
    assert near("rollout_corr/log_ppl_abs_diff", sum(abs(r - o) for r, o in zip(rollout_means, old_means)) / 2)
    assert near("rollout_corr/training_log_ppl", -sum(old_means) / 2)
    assert near("rollout_corr/rollout_log_ppl", -sum(rollout_means) / 2)
    assert near("rollout_corr/log_ppl_diff", sum(r - o for r, o in zip(rollout_means, old_means)) / 2)
    assert near("rollout_corr/ppl_ratio", sum(math.exp(r - o) for r, o in zip(rollout_means, old_means)) / 2)
    assert near("rollout_corr/rollout_is_mean", (1.5 + math.exp(-1.0) + 1.0 + 1.5 + math.exp(0.2)) / 5)
    assert near("rollout_corr/rollout_is_ratio_fraction_high", 2 / 5)  # e^0.5 and e^1 > 1.5
    assert near("rollout_corr/rollout_is_ratio_fraction_low", 1 / 5)   # e^-1 < 1 / 1.5
    assert near("rollout_corr/rollout_rs_masked_fraction", 2 / 5)
    assert near("rollout_corr/rollout_rs_token_k1_masked_fraction", 2 / 5)
    assert near("rollout_corr/rollout_rs_seq_masked_fraction", 1.0)
    # sequence level: the fractions count sequences (e^-0.5 is below 1/1.2, e^1.2 above 1.2)
    _, _, m = compute_rollout_correction(OLD, ROLLOUT, MASK, "sequence", None, 1.2)
    assert near("rollout_corr/rollout_is_ratio_fraction_high", 0.5)
    assert near("rollout_corr/rollout_is_ratio_fraction_low", 0.5)
    assert not any(k.startswith("rollout_corr/rollout_rs") for k in m)


def test_batch_normalize_token_level_divides_by_the_mean_over_valid_tokens():
    # truncated at 1.5: [1.5, e^-1, 1 | 1.5, e^0.2]; the mean is over the response mask's 5 tokens,
    # not over the 3 that rejection (token_k1 in [0.5, 2]) keeps, as verl (weights before rejection)
    truncated = torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0], [1.5, math.exp(0.2), 0.0, 0.0]], dtype=F64)
    mean = (4.0 + math.exp(-1.0) + math.exp(0.2)) / 5
    weights, keep, m = compute_rollout_correction(OLD, ROLLOUT, MASK, "token", None, 1.5, _k("token_k1", 0.5, 2.0),
                                                  batch_normalize=True)
    torch.testing.assert_close(weights, truncated / mean, rtol=1e-12, atol=1e-12)
    assert math.isclose(float(m["rollout_corr/rollout_is_batch_norm_factor"]), mean, rel_tol=1e-12)
    assert math.isclose(float(m["rollout_corr/rollout_is_mean"]), mean, rel_tol=1e-12)  # before normalising
    assert math.isclose(float(weights.sum() / MASK.sum()), 1.0, rel_tol=1e-12)
    torch.testing.assert_close(keep, compute_rollout_correction(OLD, ROLLOUT, MASK, "token", None, 1.5,
                                                                _k("token_k1", 0.5, 2.0))[1])
    _, _, off = compute_rollout_correction(OLD, ROLLOUT, MASK, "token", None, 1.5)
    assert "rollout_corr/rollout_is_batch_norm_factor" not in off


def test_batch_normalize_sequence_level_averages_one_weight_per_sequence():
    # rows: e^-0.5 over 3 tokens, 2.0 (e^1.2 truncated) over 2, and an empty row that does not count
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=F64)])
    old, rollout = torch.cat([OLD, OLD[:1]]), torch.cat([ROLLOUT, ROLLOUT[:1]])
    weights, _, m = compute_rollout_correction(old, rollout, mask, "sequence", None, 2.0, batch_normalize=True)
    mean = (math.exp(-0.5) + 2.0) / 2  # per sequence; per token it would be (3 e^-0.5 + 4) / 5
    expected = torch.tensor([[math.exp(-0.5)] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0], [0.0] * 4], dtype=F64) / mean
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    assert math.isclose(float(m["rollout_corr/rollout_is_batch_norm_factor"]), mean, rel_tol=1e-12)


def test_batch_normalize_leaves_all_zero_weights_alone():
    # IcePop [1.5, 1.6] zeroes every token weight: a mean of 0 is not divided by (factor 1, as verl)
    weights, _, m = compute_rollout_correction(OLD, ROLLOUT, MASK, "token", 1.5, 1.6, batch_normalize=True)
    assert torch.all(weights == 0) and float(m["rollout_corr/rollout_is_batch_norm_factor"]) == 1.0


def test_batch_normalize_all_reduce_sums_float64_totals():
    seen = []

    def reduce(t):  # a stand-in for the sum over ranks: another rank holding one token of weight 0.5
        seen.append(t.clone())
        return t + torch.tensor([0.5, 1.0], dtype=F64)

    weights, _, m = compute_rollout_correction(OLD, ROLLOUT, MASK, "token", None, 1.5, batch_normalize=True,
                                               all_reduce=reduce)
    local = 4.0 + math.exp(-1.0) + math.exp(0.2)
    assert seen[0].dtype == F64 and seen[0][1] == 5.0 and math.isclose(float(seen[0][0]), local, rel_tol=1e-12)
    assert math.isclose(float(m["rollout_corr/rollout_is_batch_norm_factor"]), (local + 0.5) / 6, rel_tol=1e-12)


def test_no_weights_without_is_or_rejection():
    weights, keep, m = compute_rollout_correction(OLD, ROLLOUT, MASK)
    assert weights is None and keep is None and "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" not in m


def test_policy_loss_multiplies_each_token_by_its_weight():
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.0, -0.5, -2.0, 0.0]], dtype=F64)
    logp = old.clone().requires_grad_()  # ratio 1: no clipping
    w = torch.tensor([[2.0, 0.0, 0.5, 0.0]], dtype=F64)
    loss, *_ = compute_policy_loss(old, logp, adv, mask, cliprange=0.2, rollout_is_weights=w)
    assert math.isclose(loss.item(), (-1.0 * 2.0 + 0.0 - 0.5 * 0.5) / 3, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 3, 0.0, -0.25 / 3, 0.0]], dtype=F64))


def test_reinforce_loss_is_the_weighted_policy_gradient():
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, -0.5, -2.0, 0.0]], dtype=F64)
    logp = (rollout + 0.7 * mask).requires_grad_()  # far outside any clip range: nothing is clipped
    w = torch.tensor([[2.0, 1.0, 0.0, 5.0]], dtype=F64)
    fn = get_policy_loss_fn(BYPASS_LOSS_TYPES["reinforce"])
    assert fn is compute_policy_loss_gpg
    loss, clipfrac, ppo_kl, clipfrac_lower = fn(rollout, logp, adv, mask, cliprange=0.2, rollout_is_weights=w)
    assert math.isclose(loss.item(), -(1.0 * 2.0 * -0.3 + -2.0 * 1.0 * 0.2) / 3, rel_tol=1e-12)
    assert clipfrac.item() == clipfrac_lower.item() == 0.0 and math.isclose(ppo_kl.item(), -0.7, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 3, 2.0 / 3, 0.0, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="valid names"):
        get_policy_loss_fn("reinforce")


def test_threshold_parsing():
    assert parse_rollout_is_threshold(2.0) == (None, 2.0)
    assert parse_rollout_is_threshold("2") == (None, 2.0)
    assert parse_rollout_is_threshold("0.5_5.0") == (0.5, 5.0)
    assert parse_rollout_rs("seq_mean_k1, token_k3,seq_mean_k1", "0.99_1.01,0.1") == (
        RejectionCriterion("seq_mean_k1", 0.99, 1.01), RejectionCriterion("token_k3", None, 0.1))
    assert parse_rollout_rs("token_k1,seq_max_k2", 2.0) == (
        RejectionCriterion("token_k1", 0.5, 2.0), RejectionCriterion("seq_max_k2", None, 2.0))
    for args, message in [(("token_k4", 2.0), "unknown option 'token_k4'"), (("token_k1", None), "needs"),
                          (("token_k2", "0.5_2.0"), "one upper bound"), (("token_k1,token_k2", "1,2,3"), "3 bounds"),
                          (("token_k1", "2_0.5"), "above the upper"), (("token_k1", "-1"), "positive"),
                          ((" , ", 2.0), "names no option"),
                          # [1/C, C] is empty for C < 1: a config that would reject every token
                          (("token_k1", 0.5), r"empty for C = 0.5 < 1"), (("seq_mean_k1,token_k2", "0.9,2"), "empty")]:
        with pytest.raises(ValueError, match=message):
            parse_rollout_rs(*args)
    for spec in ("a_b", "1_2_3", 0, True):
        with pytest.raises(ValueError):
            parse_rollout_is_threshold(spec)


def _load(*overrides):
    return load_config(PPOConfig, "configs/demo.yaml", [f"algorithm.rollout_correction.{o}" for o in overrides])


def test_config_section_resolves_bounds():
    rc = _load("rollout_is=sequence", "rollout_is_threshold='0.5_4.0'", "rollout_rs=seq_mean_k3",
               "rollout_rs_threshold=0.01").algorithm.rollout_correction
    assert rc.is_bounds == (0.5, 4.0) and rc.rejection == (RejectionCriterion("seq_mean_k3", None, 0.01),)
    default = _load().algorithm.rollout_correction
    assert (default.rollout_is, default.rejection, default.bypass_mode, default.loss_type) == (None, (), False,
                                                                                                "ppo_clip")
    assert _load("bypass_mode=true", "loss_type=reinforce", "rollout_is=token").algorithm.rollout_correction.bypass_mode


def test_batch_normalize_without_weights_is_a_start_up_note():
    from trainer.config import config_notes

    note = ("algorithm.rollout_correction.rollout_is_batch_normalize=true has no effect: rollout_is is null "
            "(no importance weights to normalise)")
    assert note in config_notes(_load("rollout_is_batch_normalize=true"))
    assert note not in config_notes(_load("rollout_is_batch_normalize=true", "rollout_is=token"))
    assert _load("rollout_is_batch_normalize=true", "rollout_is=token").algorithm.rollout_correction \
        .rollout_is_batch_normalize


def test_weights_in_bypass_ppo_clip_are_for_metrics_only_as_in_verl():
    """verl computes rollout_is's weights in bypass mode with loss_type=ppo_clip for their metrics only
    (its rollout-correction example sets them "for metrics"); meshppo refused the pair. Now a note says
    so; the update (tests/e2e/test_rollout_correction_trainer.py) applies none of them."""
    from trainer.config import config_notes

    note = ("algorithm.rollout_correction.rollout_is=sequence with bypass_mode=true and loss_type=ppo_clip: the "
            "weights are computed for their rollout_corr/* metrics only (as in verl)")
    assert any(n.startswith(note) for n in config_notes(_load("bypass_mode=true", "rollout_is=sequence")))
    assert not any(n.startswith(note[:60]) for n in config_notes(_load("bypass_mode=true", "rollout_is=sequence",
                                                                       "loss_type=reinforce")))


@pytest.mark.parametrize("overrides,message", [
    (["rollout_is=tokens"], "rollout_is: 'tokens' is not one of"),
    (["loss_type=reinforce"], "bypass mode only"),
    (["loss_type=vanilla"], "not one of"),
    (["rollout_rs_threshold=2.0"], "needs rollout_rs"),
    (["rollout_rs=token_k1"], "needs rollout_rs_threshold"),
    (["rollout_rs=geometric", "rollout_rs_threshold=2.0"], "unknown option 'geometric'"),
    (["rollout_is_threshold=-1.0"], "positive"),
])
def test_config_errors_name_the_section(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(*overrides)
    assert "algorithm.rollout_correction" in str(e.value)


ARGS = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
PG_ONLY = dict(entropy_coeff=0.0, use_kl_loss=False)


def _worker(model):
    return Actor(model, torch.optim.SGD(model.parameters(), lr=1.0), None, packed=True, temperature=0.8,
                 pad_token_id=0, device=torch.device("cpu"), world_size=1, response_length=5,
                 batching=MicroBatching(8, False, 0))


def _rc(**kw):
    base = dict(bypass_mode=False, loss_type="ppo_clip", rollout_is=None, is_bounds=(None, 2.0), rejection=(),
                rollout_is_batch_normalize=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _step(base, rollout_shift=0.0, weights=None, rc=None, **cfg):
    """One update of a copy of `base` on fixed rollouts: (parameter change, metrics)."""
    model = copy.deepcopy(base)
    worker = _worker(model)
    ro = _rollouts()
    old, _ = worker.log_probs(ro)
    ro.old_log_probs = old
    ro.rollout_log_probs = old - rollout_shift * ro.response_mask
    if rc is not None and rc.bypass_mode:  # as the trainer does
        ro.old_log_probs = ro.rollout_log_probs
    if weights is not None:
        ro.rollout_is_weights = weights * ro.response_mask
    out = worker.update(ro, _actor_cfg(**{**PG_ONLY, **cfg}), num_mini_batches=1, kl_loss_coef=0.1, seed=0,
                        rollout_correction=rc)
    delta = {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}
    return delta, out


def _assert_same(a, b, scale=1.0, atol=1e-6):
    for k in a:
        torch.testing.assert_close(a[k] * scale, b[k], rtol=0, atol=atol, msg=k)


def test_decoupled_weights_scale_the_policy_gradient():
    base = Transformer.build(ARGS, seed=0)
    plain, _ = _step(base)
    assert max(v.abs().max().item() for v in plain.values()) > 1e-3  # the update moved the weights
    doubled, _ = _step(base, weights=torch.tensor(2.0), rc=_rc(rollout_is="token"))
    _assert_same(plain, doubled, scale=2.0)
    zero, _ = _step(base, weights=torch.tensor(0.0), rc=_rc(rollout_is="token"))
    assert all(torch.all(v == 0) for v in zero.values())


def test_bypass_equals_recompute_when_the_engine_agrees():
    """Bypass mode with engine log-probs equal to the recomputed ones: the same update, and the
    metrics of the skipped pass (entropy, log-prob gap) from the update's first mini-batch."""
    base = Transformer.build(ARGS, seed=0)
    plain, _ = _step(base)
    bypass, out = _step(base, rc=_rc(bypass_mode=True), ppo_micro_batch_size_per_gpu=2)
    _assert_same(plain, bypass)
    ro = _rollouts()
    with torch.no_grad():
        _, ent = response_logprobs(base, build_micro_batch(ro.prompts, ro.responses, "cpu", True), ro.width, 0.8, True)
    expected_entropy = float((ent * ro.response_mask).sum() / ro.response_mask.sum())
    assert math.isclose(out["actor/entropy"], expected_entropy, rel_tol=1e-6)
    assert out["rollout/logprob_diff"] == pytest.approx(0.0, abs=1e-7)
    # a known gap: the engine's log-probs 0.01 below the actor's
    _, out = _step(base, rollout_shift=0.01, rc=_rc(bypass_mode=True))
    assert out["rollout/logprob_diff"] == pytest.approx(0.01, abs=1e-6)
    assert out["rollout_corr/kl"] == pytest.approx(-0.01, abs=1e-6)


def test_bypass_rejection_removes_the_policy_gradient():
    base = Transformer.build(ARGS, seed=0)
    rc = _rc(bypass_mode=True, rejection=(RejectionCriterion("token_k1", 0.99, 1.01),))
    kept, out = _step(base, rollout_shift=0.001, rc=rc)  # ratio e^0.001: inside the bounds
    assert out["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert max(v.abs().max().item() for v in kept.values()) > 1e-3
    rejected, out = _step(base, rollout_shift=0.1, rc=rc)  # ratio e^0.1 = 1.105: every token rejected
    assert out["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert all(torch.all(v == 0) for v in rejected.values())


def test_bypass_reinforce_matches_a_hand_written_surrogate():
    """loss_type=reinforce with token weights min(pi_theta / pi_rollout, 1.02): the update equals
    one SGD step on mean_t(-w * A * log pi) computed here in one full-batch forward."""
    base = Transformer.build(ARGS, seed=0)
    shift = 0.03  # engine log-probs 0.03 lower: ratio e^0.03 = 1.030, truncated to 1.02
    got, _ = _step(base, rollout_shift=shift, rc=_rc(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                                     is_bounds=(None, 1.02)))
    model = copy.deepcopy(base)
    ro = _rollouts()
    logp, _ = response_logprobs(model, build_micro_batch(ro.prompts, ro.responses, "cpu", True), ro.width, 0.8, False)
    mask = ro.response_mask
    loss = (-1.02 * ro.advantages * logp * mask).sum() / mask.sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    want = {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}
    assert max(v.abs().max().item() for v in want.values()) > 1e-3
    _assert_same(want, got)


def test_bypass_reinforce_batch_normalize_divides_by_the_micro_batch_mean():
    """As above, with rollout_is_batch_normalize: every token's weight is 1.02, whose mean is
    1.02, so the normalised weights are 1 and the update is the unweighted surrogate's."""
    base = Transformer.build(ARGS, seed=0)
    got, out = _step(base, rollout_shift=0.03, rc=_rc(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                                      is_bounds=(None, 1.02), rollout_is_batch_normalize=True))
    assert math.isclose(out["rollout_corr/rollout_is_batch_norm_factor"], 1.02, rel_tol=1e-6)
    model = copy.deepcopy(base)
    ro = _rollouts()
    logp, _ = response_logprobs(model, build_micro_batch(ro.prompts, ro.responses, "cpu", True), ro.width, 0.8, False)
    mask = ro.response_mask
    ((-ro.advantages * logp * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    _assert_same({k: v - base.state_dict()[k] for k, v in model.state_dict().items()}, got)


def _sgd_delta(base, loss_fn):
    """The parameter change of one SGD step (lr 1) of a copy of `base` on `loss_fn(logp, entropy)`,
    from one full-batch forward of the rollouts of `_step`."""
    model = copy.deepcopy(base)
    ro = _rollouts()
    logp, ent = response_logprobs(model, build_micro_batch(ro.prompts, ro.responses, "cpu", True), ro.width, 0.8, True)
    loss_fn(ro, logp, ent).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}


# Rejected tokens of `_rollouts()` (8 rows, lengths 1 2 4 2 5 4 1 1): row 1 entirely, row 2's last
# token (the one that carries an outcome score) and one inside row 4.
REJECTED = [(1, 0), (1, 1), (2, 3), (4, 2)]


def _keep(ro):
    keep = ro.response_mask.clone()
    for i, t in REJECTED:
        keep[i, t] = 0.0
    return keep


def test_decoupled_rejection_removes_tokens_from_every_term_and_the_normaliser():
    """verl's decoupled mode overwrites the batch's response_mask with the rejection mask: the
    policy-gradient, entropy and KL-loss terms are token means over the kept tokens only (with
    weight-0 tokens instead, the old behaviour, they stayed in all three normalisers and in the
    entropy and KL terms). One SGD step equals the hand-written loss; pg_loss (ratio 1 at the
    first mini-batch) is -sum(A keep) / sum(keep)."""
    from kl import kl_penalty

    base = Transformer.build(ARGS, seed=0)
    model = copy.deepcopy(base)
    worker = _worker(model)
    ro = _rollouts()
    assert [len(r) for r in ro.responses] == [1, 2, 4, 2, 5, 4, 1, 1]
    keep = _keep(ro)
    ro.old_log_probs, _ = worker.log_probs(ro)
    ro.rollout_log_probs = ro.old_log_probs
    ro.rollout_rs_mask = keep  # as the trainer sets it (`_old_log_probs`)
    cfg = _actor_cfg(entropy_coeff=0.01, use_kl_loss=True, ppo_micro_batch_size_per_gpu=3)
    out = worker.update(ro, cfg, num_mini_batches=1, kl_loss_coef=0.1, seed=0,
                        rollout_correction=_rc(rejection=(RejectionCriterion("token_k1", 0.5, 2.0),)))
    got = {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}

    def verl_loss(ro, logp, ent):
        n = keep.sum()
        pg = (-ro.advantages * torch.exp(logp - logp.detach()) * keep).sum() / n
        kl = (kl_penalty(logp, ro.ref_log_probs, "low_var_kl") * keep).sum() / n
        return pg - 0.01 * (ent * keep).sum() / n + 0.1 * kl

    want = _sgd_delta(base, verl_loss)
    assert max(v.abs().max().item() for v in want.values()) > 1e-3
    _assert_same(want, got)
    expected_pg = -float((ro.advantages.double() * keep).sum() / keep.sum())
    assert out["actor/pg_loss"] == pytest.approx(expected_pg, rel=1e-6)


def test_decoupled_rejection_of_a_whole_sequence_keeps_it_in_the_sequence_count():
    """seq-mean-token-mean in decoupled mode: each term is a token mean over each row's kept
    tokens, summed over the rows and divided by the mini-batch's 8 rows, as verl's
    global_batch_size; row 1, which rejection emptied, adds 0 but counts. It was left out of the
    count (7): the surviving rows weighed 8 / 7 of verl's. The critic's vf_loss counts it too."""
    from kl import kl_penalty
    from trainer.roles import Critic
    from tests.unit.test_batching import _critic_cfg

    base = Transformer.build(ARGS, seed=0)
    model = copy.deepcopy(base)
    worker = _worker(model)
    ro = _rollouts()
    keep = _keep(ro)
    assert keep[1].sum() == 0 and ro.response_mask[1].sum() == 2
    ro.old_log_probs, _ = worker.log_probs(ro)
    ro.rollout_log_probs = ro.old_log_probs
    ro.rollout_rs_mask = keep
    cfg = _actor_cfg(entropy_coeff=0.01, use_kl_loss=True, ppo_micro_batch_size_per_gpu=3,
                     loss_agg_mode="seq-mean-token-mean")
    out = worker.update(ro, cfg, num_mini_batches=1, kl_loss_coef=0.1, seed=0,
                        rollout_correction=_rc(rejection=(RejectionCriterion("token_k1", 0.5, 2.0),)))
    got = {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}

    def seq_mean(x):  # verl's agg_loss: sum_i (sum_t keep x / n_kept_i) / global_batch_size
        return ((x * keep).sum(-1) / keep.sum(-1).clamp(min=1)).sum() / 8

    def verl_loss(ro, logp, ent):
        pg = seq_mean(-ro.advantages * torch.exp(logp - logp.detach()))
        return pg - 0.01 * seq_mean(ent) + 0.1 * seq_mean(kl_penalty(logp, ro.ref_log_probs, "low_var_kl"))

    want = _sgd_delta(base, verl_loss)
    assert max(v.abs().max().item() for v in want.values()) > 1e-3
    _assert_same(want, got)
    # pg_loss at ratio 1, by hand: the kept advantages' mean of each row, summed, over 8
    a = ro.advantages.double()
    rows = [[float(a[i, t]) for t in range(ro.width) if keep[i, t]] for i in range(8)]
    expected_pg = -sum(sum(r) / len(r) for r in rows if r) / 8
    assert out["actor/pg_loss"] == pytest.approx(expected_pg, rel=1e-6)
    assert abs(expected_pg * 8 / 7 - expected_pg) > 1e-3  # the old count's figure is far off

    critic = Critic(Transformer.build(ARGS, head="value", seed=1), None, None, packed=True, pad_token_id=0,
                    device=torch.device("cpu"), world_size=1, response_length=5, batching=MicroBatching(8, False, 0))
    critic.optimizer = torch.optim.SGD(critic.model.parameters(), lr=0.0)
    with torch.no_grad():
        ro.values = critic.values(ro)
    gap = 0.1 * torch.arange(1, ro.width + 1, dtype=torch.float32) * ro.response_mask
    ro.returns = ro.values + gap  # vpred = values: the clipped and plain terms are both gap^2
    vf = critic.update(ro, _critic_cfg(loss_agg_mode="seq-mean-token-mean"), num_mini_batches=1, seed=0)
    squares = [[(0.1 * (t + 1)) ** 2 for t in range(ro.width) if keep[i, t]] for i in range(8)]
    assert vf["critic/vf_loss"] == pytest.approx(0.5 * sum(sum(r) / len(r) for r in squares if r) / 8, rel=1e-5)


def test_bypass_rejection_is_a_per_sequence_mean_over_the_kept_tokens():
    """Bypass mode, loss_type=reinforce, seq-mean-token-mean: verl's bypass loss takes the
    rejection mask as the policy-gradient term's response mask, so each sequence's token mean
    runs over its kept tokens, and the count of sequences is the mini-batch's (the rejected row
    adds 0 but counts), as verl's global_batch_size. The old weight-0 form divided each row by
    all its tokens."""
    base = Transformer.build(ARGS, seed=0)
    ro = _rollouts()
    keep = _keep(ro)
    # pi_theta / pi_rollout = e^0.3 on the rejected tokens (outside [1/1.2, 1.2]), e^0.001 elsewhere
    shift = 0.001 * ro.response_mask + 0.299 * (ro.response_mask - keep)
    rc = _rc(bypass_mode=True, loss_type="reinforce", rejection=(RejectionCriterion("token_k1", 1 / 1.2, 1.2),))
    got, out = _step(base, rollout_shift=shift, rc=rc, loss_agg_mode="seq-mean-token-mean")
    # the mean over the 4 micro-batches of 2 rows: 2 / 3, 1 / 6, 1 / 9 and 0 rejected
    assert out["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx((2 / 3 + 1 / 6 + 1 / 9) / 4)

    def verl_loss(ro, logp, ent):
        per_seq = (-ro.advantages * logp * keep).sum(-1) / keep.sum(-1).clamp(min=1)
        return per_seq.sum() / 8

    want = _sgd_delta(base, verl_loss)
    assert max(v.abs().max().item() for v in want.values()) > 1e-3
    _assert_same(want, got)


def test_trainer_folds_rejection_into_the_advantages_and_data_metrics():
    """Decoupled mode in the trainer: `_old_log_probs` sets the rejection mask, `_compute_advantages`
    runs GAE over it (verl's `compute_advantage` sees the modified response_mask: a rejected token
    gets no advantage, the recursion passes over it and its reward, the whitening counts only kept
    tokens), and the per-token data metrics use it while `response_length` counts every token
    (verl's comes from the attention mask). GAE is verl's loop, transcribed here in float64."""
    from trainer.metrics import data_metrics
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    cfg = load_config(PPOConfig, None, [
        "data.train_batch_size=4", "algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
        "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2.0"])
    lengths = [5, 3, 4, 2]
    engine = [[-1.0 - 0.1 * t for t in range(n)] for n in lengths]
    full = RolloutBatch([[3, 4]] * 4, [[5] * n for n in lengths], [0, 0, 1, 1], [None] * 4, [None] * 4, [{}] * 4,
                        ["stop"] * 4, engine, 5, torch.device("cpu"))
    ro, parts = full.take([0, 1, 2, 3]), [[0, 1, 2, 3]]
    # log pi_old - log pi_rollout: |delta| > ln 2 is rejected; row 0 loses a middle and its last
    # (scored) token, row 2 all of its tokens
    delta = torch.tensor([[0, 0.9, 0, 0, -1.0], [0, 0.1, 0, 0, 0], [1.5] * 4 + [0], [0, -0.2, 0, 0, 0]])
    mask = ro.response_mask
    keep = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0] * 5, [1, 1, 0, 0, 0]], dtype=torch.float32)
    old = (ro.padded(engine) + delta) * mask
    entropy = torch.full((4, 5), 0.5) * mask
    g = torch.Generator().manual_seed(3)
    values = torch.randn(4, 5, generator=g) * mask
    scores = torch.tensor([1.0, -0.5, 2.0, 0.25])
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=0)
    trainer.actor = SimpleNamespace(count_work=no_work,
                                    log_probs=lambda ro, with_entropy, with_sum_pi_squared: (old, entropy))
    trainer.kl = None  # no KL in reward
    ro.token_level_scores = torch.zeros(4, 5)
    ro.token_level_scores[torch.arange(4), torch.tensor(lengths) - 1] = scores
    ro.values = values
    metrics = {}
    trainer._old_log_probs(full, ro, parts, metrics)
    torch.testing.assert_close(ro.rollout_rs_mask, keep, rtol=0, atol=0)
    torch.testing.assert_close(full.rollout_rs_mask, keep, rtol=0, atol=0)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(6 / 14)
    assert metrics["actor/entropy"] == pytest.approx(0.5)  # over every response token, as verl's
    trainer._compute_advantages(full, ro, parts, metrics)

    rewards, v, m = ro.token_level_scores.double(), values.double(), keep.double()
    next_value, last, adv = torch.zeros(4, dtype=F64), torch.zeros(4, dtype=F64), torch.zeros(4, 5, dtype=F64)
    for t in reversed(range(5)):  # verl's compute_gae_advantage_return
        gae = rewards[:, t] + 0.9 * next_value - v[:, t] + 0.9 * 0.8 * last
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = gae * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    returns = adv + v
    mean = (adv * m).sum() / m.sum()
    var = ((adv - mean) ** 2 * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    whitened = (adv - mean) * torch.rsqrt(var + 1e-8)
    torch.testing.assert_close(ro.advantages.double(), whitened * m, rtol=0, atol=1e-5)
    torch.testing.assert_close(ro.returns.double() * m, returns * m, rtol=0, atol=1e-5)
    assert torch.all(ro.advantages[keep == 0] == 0)

    dm = data_metrics(ro, scores, {}, max_prompt_length=2, max_response_length=5)
    kept = keep.bool()
    assert dm["response_length/mean"] == pytest.approx(3.5)
    assert dm["critic/advantages/mean"] == pytest.approx(float(whitened[kept].mean()), abs=1e-6)
    assert dm["critic/values/mean"] == pytest.approx(float(v[kept].mean()), abs=1e-6)
    assert dm["critic/returns/max"] == pytest.approx(float(returns[kept].max()), abs=1e-5)


@pytest.mark.parametrize("mode,overrides,expected", [
    # rows of 5, 3, 4 and 2 tokens with entropy 0.1 (i + 1) + 0.01 t
    ("token-mean", [], lambda rows: sum(sum(r) for r in rows) / 14),
    ("seq-mean-token-mean", [], lambda rows: sum(sum(r) / len(r) for r in rows) / 4),
    ("seq-mean-token-sum", [], lambda rows: sum(sum(r) for r in rows) / 4),
    ("seq-mean-token-sum-norm", ["actor_rollout_ref.actor.loss_scale_factor=8"],
     lambda rows: sum(sum(r) / 8 for r in rows) / 4),
    ("seq-mean-token-sum-norm", ["data.max_response_length=6"], lambda rows: sum(sum(r) / 6 for r in rows) / 4),
])
def test_actor_entropy_is_aggregated_with_the_loss_agg_mode(mode, overrides, expected):
    """verl's `actor/entropy` is agg_loss(entropy, response_mask, loss_agg_mode, loss_scale_factor)
    over the batch; it was always a token mean. (meshppo's seq-mean-token-sum-norm keeps its
    division by the number of sequences, as its loss does.) Bypass mode's, from the update's
    first mini-batch, is aggregated the same way."""
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    cfg = load_config(PPOConfig, None, ["data.train_batch_size=4", f"actor_rollout_ref.actor.loss_agg_mode={mode}",
                                        *overrides])
    lengths = [5, 3, 4, 2]
    ro = RolloutBatch([[3, 4]] * 4, [[5] * n for n in lengths], [0, 1, 2, 3], [None] * 4, [None] * 4, [{}] * 4,
                      ["stop"] * 4, [[0.0] * n for n in lengths], 5, torch.device("cpu"))
    rows = [[0.1 * (i + 1) + 0.01 * t for t in range(n)] for i, n in enumerate(lengths)]
    entropy = torch.zeros(4, 5)
    for i, r in enumerate(rows):
        entropy[i, :len(r)] = torch.tensor(r)
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=0)
    trainer.actor = SimpleNamespace(count_work=no_work,
                                    log_probs=lambda ro, with_entropy, with_sum_pi_squared: (-entropy, entropy))
    metrics = {}
    trainer._old_log_probs(ro, ro, [[0, 1, 2, 3]], metrics)
    assert metrics["actor/entropy"] == pytest.approx(expected(rows), rel=1e-6)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_bypass_entropy_is_aggregated_with_the_loss_agg_mode(mode):
    base = Transformer.build(ARGS, seed=0)
    _, out = _step(base, rc=_rc(bypass_mode=True), loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=3)
    ro = _rollouts()
    with torch.no_grad():
        _, ent = response_logprobs(base, build_micro_batch(ro.prompts, ro.responses, "cpu", True), ro.width, 0.8, True)
    per_seq = (ent * ro.response_mask).sum(-1).double()
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / ro.response_mask.sum(-1)
    assert out["actor/entropy"] == pytest.approx(float(per_seq.mean()), rel=1e-6)


def test_bypass_entropy_is_the_first_mini_batchs_with_calculate_entropy_too():
    """Bypass mode runs no old-log-prob pass: `actor/entropy` is the first mini-batch's, which
    the pass would have measured, with `calculate_entropy` too (it was then the update's own,
    averaged over mini-batches that saw a stepped actor); that one is `actor/entropy_loss`, as
    verl 0.9.1 logs it."""
    base = Transformer.build(ARGS, seed=0)
    worker = _worker(copy.deepcopy(base))
    ro = _rollouts()
    with torch.no_grad():
        old, ent = worker.log_probs(ro, with_entropy=True)
    ro.old_log_probs = ro.rollout_log_probs = old
    cfg = _actor_cfg(**PG_ONLY, calculate_entropy=True)
    out = worker.update(ro, cfg, num_mini_batches=2, kl_loss_coef=0.0, seed=0, rollout_correction=_rc(bypass_mode=True))
    mask = ro.response_mask
    first, second = (float((ent[h] * mask[h]).sum() / mask[h].sum()) for h in (slice(0, 4), slice(4, 8)))
    assert out["actor/entropy"] == pytest.approx(first, rel=1e-5)
    # the second mini-batch's entropy under the stepped actor differs from its entropy before the update
    assert abs(2 * out["actor/entropy_loss"] - first - second) > 1e-3

