"""verl's policy-loss modes (`actor.policy_loss.loss_mode`) against float64 references transcribed
here from verl's `core_algos.py` (`compute_policy_loss_<mode>` and `agg_loss`), independently of
the product code: loss and gradient w.r.t. log_prob, locally (one micro-batch: meshppo's
normaliser is verl's) and with global counts (verl's engine workers' `global_batch_info`). The
references drop verl's `+ 1e-8` in token counts (meshppo divides exactly) and keep everything
else. Then hand-checked cases of each mode, the covariance selections of clip_cov / kl_cov, the
config section and the actor update."""

import copy
import math

import pytest
import torch

from models import Transformer
from ppo.core_algos import (BYPASS_LOSS_TYPES, POLICY_LOSS_INPUTS, POLICY_LOSSES, PolicyLossParams,
                            compute_policy_loss_clip_cov, compute_policy_loss_kl_cov, get_policy_loss_fn)
from tests.gpu.test_multi_gpu import UPDATE_RTOL
from tests.unit.test_batching import _actor_cfg, _rollouts
from tests.unit.test_rollout_correction import ARGS, _worker
from trainer.config import PolicyLossConfig, PPOConfig, config_notes, validate
from trainer.configlib import ConfigError, load_config

F64 = torch.float64
VERL_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
              "cispo")  # verl 0.9.1's @register_policy_loss, in its order, less bypass_mode


# ----------------------------------------------------------------------------- verl, transcribed

def _mean(x, mask):
    return (x * mask).sum() / mask.sum()


def _weighed(losses, w):
    """verl's `if rollout_is_weights is not None: losses = losses * rollout_is_weights`."""
    return losses if w is None else losses * w


def verl_agg(loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """verl's agg_loss with its global_batch_info (seq-mean-token-sum-norm left out: tested in test_core_algos)."""
    if mode == "token-sum":
        return (loss_mat * mask).sum() * dp_size
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / n * dp_size
    seq_losses = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / mask.sum(-1)
    seq_mask = (mask.sum(-1) > 0).to(loss_mat.dtype)
    n = seq_mask.sum() if global_batch_size is None else global_batch_size
    return (seq_losses * seq_mask).sum() / n * dp_size


def verl_vanilla(old, logp, adv, mask, mode, p, w, agg):
    nkl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - p["low"], 1 + p["high"])
    c1 = torch.maximum(l1, l2)
    l3 = -adv * 3.0
    c2 = torch.min(l3, c1)
    losses = _weighed(torch.where(adv < 0, c2, c1), w)
    return verl_agg(losses, mask, mode, **agg), _mean((l2 > l1).to(F64), mask)


def verl_dppo(old, logp, adv, mask, mode, p, w, agg, divergence):
    """verl's compute_policy_loss_dppo_tv / _kl (clip_ratio_c 3.0, the actor config's), `divergence` "tv" or "kl"."""
    nkl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(nkl)
    truncated = torch.clamp(ratio, max=3.0).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if divergence == "tv":
        pos, neg = (prob - old_prob) <= p["high"], (prob - old_prob) >= -p["low"]
    else:
        binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos, neg = (binary_kl <= p["high"]) | (prob <= old_prob), (binary_kl <= p["low"]) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).detach().to(F64)
    losses = _weighed(-adv * truncated * logp * valid, w)
    return verl_agg(losses, mask, mode, **agg), _mean(1.0 - valid, mask)


def verl_dppo_tv(*args):
    return verl_dppo(*args, divergence="tv")


def verl_dppo_kl(*args):
    return verl_dppo(*args, divergence="kl")


def verl_dro(old, logp, adv, mask, mode, p, w, agg):
    log_ratio = logp - old
    losses = _weighed(-(logp * adv - 0.5 * p["dro_beta"] * log_ratio.square()), w)
    return verl_agg(losses, mask, mode, **agg), torch.tensor(0.0, dtype=F64)


def verl_gspo(old, logp, adv, mask, mode, p, w, agg):
    nkl = logp - old
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    nkl_seq = torch.sum(nkl * mask, dim=-1) / seq_lengths
    log_s = logp - logp.detach() + nkl_seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - p["low"], 1 + p["high"])
    losses = _weighed(torch.maximum(l1, l2), w)
    return verl_agg(losses, mask, mode, **agg), _mean((l2 > l1).to(F64), mask)


def verl_sapo(old, logp, adv, mask, mode, p, w, agg):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    taus = torch.where(adv > 0, torch.tensor(p["tau_pos"], dtype=F64), torch.tensor(p["tau_neg"], dtype=F64))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return verl_agg(_weighed(-gates * adv, w), mask, "seq-mean-token-mean", **agg), torch.tensor(0.0, dtype=F64)


def verl_gpg(old, logp, adv, mask, mode, p, w, agg):
    return verl_agg(_weighed(-logp * adv, w), mask, mode, **agg), torch.tensor(0.0, dtype=F64)


def verl_clip_cov(old, logp, adv, mask, mode, p, w, agg):
    """Runs verl's random choice (randperm): the cases make it choose every candidate."""
    nkl = logp - old
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    corr = torch.ones_like(adv)
    l2 = -adv * torch.clamp(ratio, 1 - p["low"], 1 + p["high"])
    clip_by_origin = (l2 > l1) & (mask > 0)
    cov_all = (adv - _mean(adv, mask)) * (logp - _mean(logp.detach(), mask))
    cov_all = cov_all.detach().clone()
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(p["clip_cov_ratio"] * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < p["clip_cov_ub"]) & (cov_all > p["clip_cov_lb"]) & (mask > 0))
    top_k_idx = top_k_idx[torch.randperm(len(top_k_idx))[:min(clip_num, len(top_k_idx))]]
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    losses = _weighed(torch.maximum(l1, l2) * corr, w)
    return verl_agg(losses, mask, mode, **agg), _mean((corr == 0).to(F64), mask)


def verl_kl_cov(old, logp, adv, mask, mode, p, w, agg):
    nkl = logp - old
    abs_kl = nkl.abs()
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    l_kl = -adv * ratio + p["ppo_kl_coef"] * abs_kl
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    v_adv = adv[valid].detach().reshape(-1)
    v_logp = logp[valid].detach().reshape(-1)
    cov = (v_adv - v_adv.mean()) * (v_logp - v_logp.mean())
    k = max(1, int(len(cov) * p["kl_cov_ratio"]))
    large = valid_idx[torch.topk(cov, k, largest=True).indices]
    chosen = torch.zeros(adv.numel(), dtype=torch.bool)
    chosen[large] = True
    losses = _weighed(torch.where(chosen.view_as(adv), l_kl, l1), w)
    return verl_agg(losses, mask, mode, **agg), torch.tensor(0.0, dtype=F64)


def verl_geo_mean(old, logp, adv, mask, mode, p, w, agg):
    """verl's torch.mean over the micro-batch's rows; with global counts, meshppo's global mean of it."""
    nkl = logp - old
    sgn = torch.sign(adv)
    nkl_clamp = torch.clamp(nkl, -p["low"], p["high"])
    nkl_min = sgn * torch.min(sgn * nkl, sgn * nkl_clamp)
    n = mask.sum(dim=-1)
    ratio = torch.exp((nkl_min * mask).sum(dim=-1) / n)
    advantage = (adv * mask).sum(dim=-1) / n
    losses = -advantage * ratio
    if w is not None:  # verl leaves the factor out without weights (it would be exp(log(1 + 1e-10)))
        losses = losses * torch.exp((torch.log(w + 1e-10) * mask).sum(dim=-1) / n)
    loss = losses.mean() if not agg else losses.sum() / agg["global_batch_size"] * agg["dp_size"]
    clipped = torch.ne(nkl, nkl_clamp)
    return loss, _mean((clipped & (adv > 0)).to(F64), mask)


def verl_cispo(old, logp, adv, mask, mode, p, w, agg):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    clipped = torch.clamp(ratio, 1 - p["low"], 1 + p["high"])
    losses = _weighed(-clipped.detach() * adv * logp, w)
    return verl_agg(losses, mask, mode, **agg), _mean((ratio != clipped).to(F64), mask)


REFERENCES = {"vanilla": verl_vanilla, "dppo_tv": verl_dppo_tv, "dppo_kl": verl_dppo_kl, "gspo": verl_gspo,
              "sapo": verl_sapo, "gpg": verl_gpg, "clip_cov": verl_clip_cov, "kl_cov": verl_kl_cov,
              "geo_mean": verl_geo_mean, "dro": verl_dro, "cispo": verl_cispo}
PARAMS = dict(low=0.2, high=0.28, clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=1.0, kl_cov_ratio=0.2,
              ppo_kl_coef=0.7, tau_pos=1.3, tau_neg=2.1, dro_beta=0.6)
# dppo_kl's bounds on the binary KL, which these inputs' probability changes keep below 0.2
MODE_PARAMS = {"dppo_kl": dict(PARAMS, low=0.01, high=0.015)}


def _inputs(seed=0, b=6, t=7, lengths=(7, 3, 1, 5, 6, 4), scale=0.3):
    """Random log-probs, old ones 0.3 nats off plus a shift per row (sequence ratios out of a
    clip range of 0.2 too), token-level advantages and importance weights."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    logp = -3.0 * torch.rand(b, t, generator=g, dtype=F64)
    shift = 0.4 * torch.randn(b, 1, generator=g, dtype=F64)
    old = logp + scale * torch.randn(b, t, generator=g, dtype=F64) + shift
    adv = torch.randn(b, t, generator=g, dtype=F64)
    w = 0.5 + 1.5 * torch.rand(b, t, generator=g, dtype=F64)
    return old, logp, adv, mask, w


def _product(mode, old, logp, adv, mask, loss_agg_mode, w=None, generator=None, p=PARAMS, **agg):
    logp = logp.clone().requires_grad_()
    params = PolicyLossParams(p["clip_cov_ratio"], p["clip_cov_lb"], p["clip_cov_ub"], p["kl_cov_ratio"],
                              p["ppo_kl_coef"], p["tau_pos"], p["tau_neg"], p["dro_beta"])
    out = get_policy_loss_fn(mode)(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                   cliprange=0.5, cliprange_low=p["low"], cliprange_high=p["high"], clip_ratio_c=3.0,
                                   loss_agg_mode=loss_agg_mode, rollout_is_weights=w, loss_params=params,
                                   generator=generator, **agg)
    out.pg_loss.backward()
    return out, logp.grad


def _reference(mode, old, logp, adv, mask, loss_agg_mode, w=None, p=PARAMS, **agg):
    logp = logp.clone().requires_grad_()
    loss, clipfrac = REFERENCES[mode](old, logp, adv, mask, loss_agg_mode, p, w, agg)
    loss.backward()
    return loss, clipfrac, logp.grad


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- registry

def test_registry_holds_verls_modes_and_bypass_names_two_of_them():
    assert tuple(POLICY_LOSSES) == VERL_MODES
    assert BYPASS_LOSS_TYPES == {"ppo_clip": "vanilla", "reinforce": "gpg"}
    with pytest.raises(ValueError, match="valid names are \\['vanilla', 'dppo_tv'"):
        get_policy_loss_fn("bypass_mode")
    assert "loss_params" in POLICY_LOSS_INPUTS and "generator" in POLICY_LOSS_INPUTS


# ----------------------------------------------------------------------------- against verl

GLOBAL = {"product": dict(global_num_tokens=61.0, global_num_seqs=13.0, dp_size=2),
          "verl": dict(batch_num_tokens=61.0, global_batch_size=13.0, dp_size=2)}


@pytest.mark.parametrize("normaliser", ["local", "global"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_loss_and_gradient_match_verl(mode, loss_agg_mode, weighted, normaliser):
    """Local: one micro-batch, meshppo's normaliser is verl's own count. Global: the mini-batch's
    counts over micro-batches and ranks, as verl's engine workers pass them."""
    old, logp, adv, mask, w = _inputs()
    w = w if weighted else None
    agg_p, agg_v = (GLOBAL["product"], GLOBAL["verl"]) if normaliser == "global" else ({}, {})
    p = MODE_PARAMS.get(mode, PARAMS)
    out, grad = _product(mode, old, logp, adv, mask, loss_agg_mode, w, p=p, **agg_p)
    loss, clipfrac, want_grad = _reference(mode, old, logp, adv, mask, loss_agg_mode, w, p=p, **agg_v)
    _close(out.pg_loss.detach(), loss.detach())
    _close(grad, want_grad)
    assert grad.abs().max() > 1e-3  # a gradient to compare
    _close(out.pg_clipfrac, clipfrac)
    if mode in ("vanilla", "dppo_tv", "dppo_kl", "gspo", "clip_cov", "geo_mean", "cispo"):  # the inputs exercise the clip
        assert 0 < out.pg_clipfrac < 1, out.pg_clipfrac


@pytest.mark.parametrize("mode", VERL_MODES)
def test_statistics_have_verls_meaning(mode):
    old, logp, adv, mask, _ = _inputs()
    out, _ = _product(mode, old, logp, adv, mask, "token-mean")
    log_ratio = logp - old
    want_kl = {"kl_cov": _mean(log_ratio.abs(), mask), "gpg": _mean(old - logp, mask)}.get(mode,
                                                                                          _mean(-log_ratio, mask))
    _close(out.ppo_kl, want_kl)
    if mode == "geo_mean":  # tokens outside the log-space clip with a negative advantage
        outside = log_ratio != torch.clamp(log_ratio, -PARAMS["low"], PARAMS["high"])
        _close(out.pg_clipfrac_lower, _mean((outside & (adv < 0)).to(F64), mask))
        assert out.pg_clipfrac_lower > 0
    elif mode != "vanilla":
        assert out.pg_clipfrac_lower == 0
    for stat in out[1:]:
        assert not stat.requires_grad


def test_ppo_kl_at_log_ratios_past_the_clamp_is_verls():
    """verl's vanilla reports ppo_kl of the log-ratio clamped to [-20, 20] (as its ratio is), its geo_mean
    of the raw log-ratio (the clamp is the loss's only): tokens at log-ratios +25 and -0.5 give
    -(20 - 0.5) / 2 and -(25 - 0.5) / 2 (they were the other way round, by 2.5 here)."""
    old, logp = [-26.0, -1.0], [-1.0, -1.5]
    vanilla, _ = _one("vanilla", old, logp, [1.0, -1.0])
    assert vanilla.ppo_kl.item() == pytest.approx(-(20.0 - 0.5) / 2, rel=1e-12)
    geo, _ = _one("geo_mean", old, logp, [1.0, 1.0])
    assert geo.ppo_kl.item() == pytest.approx(-(25.0 - 0.5) / 2, rel=1e-12)


@pytest.mark.parametrize("mode", [m for m in VERL_MODES if m not in ("clip_cov", "kl_cov")])
def test_global_counts_make_the_loss_independent_of_micro_batching(mode):
    """The losses summed over two micro-batches, each normalised by the whole batch's counts, are
    the whole batch's loss, whichever aggregation the mode uses. (clip_cov and kl_cov choose
    their tokens by a covariance over each micro-batch, as verl: not independent.)"""
    old, logp, adv, mask, w = _inputs()
    counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float((mask.sum(-1) > 0).sum()))
    whole, whole_grad = _product(mode, old, logp, adv, mask, "token-mean", w, **counts)
    parts = [_product(mode, old[rows], logp[rows], adv[rows], mask[rows], "token-mean", w[rows], **counts)
             for rows in ([0, 2, 5], [1, 3, 4])]
    _close(parts[0][0].pg_loss + parts[1][0].pg_loss, whole.pg_loss)
    _close(torch.cat([parts[0][1], parts[1][1]])[[0, 3, 1, 4, 5, 2]], whole_grad)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_padding_cannot_leak_into_the_loss(mode):
    """inf / NaN log-probs at padding (a pad token's) change nothing: the sequence means of gspo and
    geo_mean, the covariance means of clip_cov and kl_cov select the valid tokens."""
    old, logp, adv, mask, w = _inputs()
    clean, clean_grad = _product(mode, old, logp, adv, mask, "token-mean", w)
    pad = mask == 0
    dirty, dirty_grad = _product(mode, torch.where(pad, math.inf, old), torch.where(pad, -math.inf, logp),
                                 torch.where(pad, math.nan, adv), mask, "token-mean", torch.where(pad, 0.0, w))
    for a, b in zip(dirty, clean):
        _close(a.detach(), b.detach())
    _close(dirty_grad[~pad], clean_grad[~pad])


# ----------------------------------------------------------------------------- by hand

def _one(mode, old, logp, adv, mask=None, p=PARAMS, **kw):
    old, logp, adv = (torch.tensor([x], dtype=F64) for x in (old, logp, adv))
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=F64)
    return _product(mode, old, logp, adv, mask, "token-mean", p=p, **kw)


def test_gspo_by_hand():
    logp = [-1.0, -2.0, -0.5, -3.0]
    # every token's log-ratio 0.01: s = e^0.01 inside the clip; the loss -A s, each token's gradient -A s / 4
    out, grad = _one("gspo", [x - 0.01 for x in logp], logp, [1.0] * 4)
    assert math.isclose(out.pg_loss.item(), -math.exp(0.01), rel_tol=1e-12)
    _close(grad, torch.full((1, 4), -math.exp(0.01) / 4, dtype=F64))
    # token log-ratios 0.3, -0.1, 0.2, 0.0: the sequence's 0.1 for each token, its own ratio irrelevant
    out, grad = _one("gspo", [x - d for x, d in zip(logp, (0.3, -0.1, 0.2, 0.0))], logp, [-1.0] * 4)
    assert math.isclose(out.pg_loss.item(), math.exp(0.1), rel_tol=1e-12) and out.pg_clipfrac == 0
    _close(grad, torch.full((1, 4), math.exp(0.1) / 4, dtype=F64))
    # GSPO's recipe clip 3e-4 / 4e-4: s = e^0.01 is clipped for A > 0, no gradient, every token counted clipped
    tiny = dict(PARAMS, low=3e-4, high=4e-4)
    out, grad = _one("gspo", [x - 0.01 for x in logp], logp, [2.0] * 4, p=tiny)
    assert math.isclose(out.pg_loss.item(), -2.0 * (1 + 4e-4), rel_tol=1e-12) and out.pg_clipfrac == 1
    assert torch.all(grad == 0)
    # a log-ratio of 12 is clamped at 10 (verl): the value e^10, and the clamp stops the gradient
    out, grad = _one("gspo", [x - 12.0 for x in logp], logp, [-1.0] * 4)
    assert math.isclose(out.pg_loss.item(), math.exp(10.0), rel_tol=1e-12) and torch.all(grad == 0)
    # two sequences of 4 and 1 tokens weigh the same under seq-mean-token-mean (GSPO's paper)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0] * 4, [3.0] * 4], dtype=F64)
    out, grad = _product("gspo", old, old, adv, mask, "seq-mean-token-mean")  # on-policy: s = 1
    assert math.isclose(out.pg_loss.item(), -(1.0 + 3.0) / 2, rel_tol=1e-12)
    _close(grad, torch.tensor([[-1 / 8] * 4, [-3 / 2, 0, 0, 0]], dtype=F64))


def test_gspo_follows_loss_agg_mode_as_verl():
    """verl 0.9.1 aggregates gspo by the actor's loss_agg_mode (token-mean by default), not the
    paper's seq-mean-token-mean. On-policy (s = 1), a row of 4 tokens with A = +1 and one of 1
    token with A = -1: token-mean gives (-4 + 1) / 5 = -0.6 and each token's gradient -A / 5, so
    the rows' gradients sum to -0.8 and 0.2 (seq-mean-token-mean would give 0, -0.5 and 0.5)."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=F64)
    out, grad = _product("gspo", old, old, adv, mask, "token-mean")
    assert math.isclose(out.pg_loss.item(), -0.6, rel_tol=1e-12)
    _close(grad.sum(-1), torch.tensor([-0.8, 0.2], dtype=F64))
    loss, _, want_grad = _reference("gspo", old, old, adv, mask, "token-mean")
    _close(out.pg_loss.detach(), loss.detach())
    _close(grad, want_grad)


def test_dppo_tv_by_hand():
    """Bounds 0.2 / 0.28 on p - p_old: A > 0 and p 0.5 -> 0.6 stays in (ratio 1.2, gradient -A 1.2);
    A > 0 and p 0.2 -> 0.6 is out (no loss, no gradient); A < 0 and p 0.5 -> 0.2 is out; A < 0 and
    p 0.1 -> 0.35 stays in with its ratio 3.5 truncated at clip_ratio_c 3 (gradient -A 3)."""
    old, new = [0.5, 0.2, 0.5, 0.1], [0.6, 0.6, 0.2, 0.35]
    out, grad = _one("dppo_tv", [math.log(x) for x in old], [math.log(x) for x in new], [1.0, 1.0, -1.0, -1.0])
    assert math.isclose(out.pg_loss.item(), (-1.2 * math.log(0.6) + 3.0 * math.log(0.35)) / 4, rel_tol=1e-12)
    _close(grad, torch.tensor([[-1.2 / 4, 0.0, 0.0, 3.0 / 4]], dtype=F64))
    assert out.pg_clipfrac.item() == pytest.approx(0.5) and out.pg_clipfrac_lower.item() == pytest.approx(0.25)


def test_dppo_kl_by_hand():
    """Bounds 0.01 / 0.015 on the binary KL D(p_old, p): A > 0 with p 0.5 -> 0.6 (D = 0.0204) is out,
    A > 0 with p 0.5 -> 0.3 stays in (its probability fell), A < 0 with p 0.5 -> 0.45 (D = 0.0050)
    stays in, A < 0 with p 0.5 -> 0.3 (D = 0.087) is out. Ratios below 3: no truncation."""
    def binary_kl(p_old, p):
        return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))

    new = [0.6, 0.3, 0.45, 0.3]
    assert binary_kl(0.5, 0.6) > 0.015 and binary_kl(0.5, 0.45) < 0.01 < binary_kl(0.5, 0.3)
    out, grad = _one("dppo_kl", [math.log(0.5)] * 4, [math.log(x) for x in new], [1.0, 1.0, -1.0, -1.0],
                     p=dict(PARAMS, low=0.01, high=0.015))
    want = (-1.0 * 0.6 * math.log(0.3) + 1.0 * 0.9 * math.log(0.45)) / 4  # -A r log p of the two inside
    assert math.isclose(out.pg_loss.item(), want, rel_tol=1e-12)
    _close(grad, torch.tensor([[0.0, -0.6 / 4, 0.9 / 4, 0.0]], dtype=F64))
    assert out.pg_clipfrac.item() == pytest.approx(0.5) and out.pg_clipfrac_lower == 0


def test_dro_by_hand():
    """beta 0.6: L = -(A log p - 0.3 (log p - log p_old)^2), gradient -A + 0.6 (log p - log p_old)."""
    out, grad = _one("dro", [-1.5, -2.0], [-1.0, -2.0], [1.0, -2.0])
    assert math.isclose(out.pg_loss.item(), (-(-1.0 - 0.3 * 0.25) + -(4.0)) / 2, rel_tol=1e-12)
    _close(grad, torch.tensor([[(-1.0 + 0.3) / 2, 2.0 / 2]], dtype=F64))
    assert math.isclose(out.ppo_kl.item(), -0.25, rel_tol=1e-12) and out.pg_clipfrac == 0
    with pytest.raises(ValueError, match="dro_beta"):
        _one("dro", [-1.0], [-1.0], [1.0], p=dict(PARAMS, dro_beta=None))


def test_sapo_by_hand():
    # on-policy: the gate is 2 / tau with slope 1, so the gradient is PPO's (-A per token, over the count)
    out, grad = _one("sapo", [-1.0, -2.0], [-1.0, -2.0], [1.0, -2.0])
    assert math.isclose(out.pg_loss.item(), -(2 / 1.3 * 1.0 + 2 / 2.1 * -2.0) / 2, rel_tol=1e-12)
    _close(grad, torch.tensor([[-0.5, 1.0]], dtype=F64))
    # off-policy the gate fades: ratio e^1 with tau 1.3, gradient -A sigmoid'(tau (r - 1)) 4 r
    r = math.e
    s = 1 / (1 + math.exp(-1.3 * (r - 1)))
    out, grad = _one("sapo", [-2.0], [-1.0], [1.0])
    assert math.isclose(out.pg_loss.item(), -s * 4 / 1.3, rel_tol=1e-12)
    assert math.isclose(grad.item(), -4 * s * (1 - s) * r, rel_tol=1e-12)


def test_cispo_by_hand():
    # ratio e^0.5 clipped to 1.28: the clipped weight still carries the gradient of -A log pi (PPO's would not)
    out, grad = _one("cispo", [-1.5, -1.0], [-1.0, -1.0], [1.0, 1.0])
    assert math.isclose(out.pg_loss.item(), -(1.28 * -1.0 + 1.0 * -1.0) / 2, rel_tol=1e-12)
    _close(grad, torch.tensor([[-1.28 / 2, -1 / 2]], dtype=F64))
    assert out.pg_clipfrac == 0.5


def test_geo_mean_by_hand():
    # A > 0, log-ratios 0.1 and 0.5: the second clipped to 0.28, ratio e^((0.1 + 0.28) / 2), loss -A ratio
    ratio = math.exp((0.1 + 0.28) / 2)
    out, grad = _one("geo_mean", [-1.1, -1.5], [-1.0, -1.0], [2.0, 2.0])
    assert math.isclose(out.pg_loss.item(), -2.0 * ratio, rel_tol=1e-12)
    _close(grad, torch.tensor([[-2.0 * ratio / 2, 0.0]], dtype=F64))
    assert out.pg_clipfrac == 0.5 and out.pg_clipfrac_lower == 0
    # A < 0 keeps the larger log-ratio: nothing is pessimistic to clip upwards
    out, _ = _one("geo_mean", [-1.1, -1.5], [-1.0, -1.0], [-2.0, -2.0])
    assert math.isclose(out.pg_loss.item(), 2.0 * math.exp(0.3), rel_tol=1e-12)
    assert out.pg_clipfrac == 0 and out.pg_clipfrac_lower == 0.5


def test_gpg_by_hand():
    out, grad = _one("gpg", [-5.0, -5.0], [-1.0, -2.0], [1.0, -3.0])
    assert math.isclose(out.pg_loss.item(), -(1.0 * -1.0 + -3.0 * -2.0) / 2, rel_tol=1e-12)
    _close(grad, torch.tensor([[-0.5, 1.5]], dtype=F64))


# ----------------------------------------------------------------------------- covariance selections

# A = [2, 0, 0, -2], log pi = [-1, -2, -2, -3]: both means 0 and -2, covariance terms [2, 0, 0, 2].
COV_ADV = [2.0, 0.0, 0.0, -2.0]
COV_LOGP = [-1.0, -2.0, -2.0, -3.0]


def test_clip_cov_detaches_the_known_token():
    """Token 0 (A > 0, ratio e^0.5) is clipped and so not a candidate; token 3 (covariance 2 in
    (1, 5), ratio 1) is the one candidate and one token (0.0002 x 4, at least one) is detached."""
    p = dict(PARAMS, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, high=0.2)
    old = [COV_LOGP[0] - 0.5] + COV_LOGP[1:]
    out, grad = _one("clip_cov", old, COV_LOGP, COV_ADV, p=p)
    assert math.isclose(out.pg_loss.item(), -2.0 * 1.2 / 4, rel_tol=1e-12)  # token 3's -A r = 2 left out
    assert torch.all(grad == 0) and out.pg_clipfrac == 0.25
    vanilla, vanilla_grad = _one("vanilla", old, COV_LOGP, COV_ADV, p=p)
    assert math.isclose(vanilla.pg_loss.item(), (-2.4 + 2.0) / 4, rel_tol=1e-12) and vanilla_grad[0, 3] == 0.5


def test_clip_cov_draws_its_share_at_random_from_the_generator():
    old, logp, adv, mask, _ = _inputs(seed=1, b=16, t=32, lengths=list(range(17, 33)))
    p = dict(PARAMS, clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=3.0)
    ratio = torch.exp(logp - old)
    unclipped = ~(-adv * torch.clamp(ratio, 1 - p["low"], 1 + p["high"]) > -adv * ratio)
    cov = (adv - _mean(adv, mask)) * (logp - _mean(logp, mask))
    candidates = (mask > 0) & unclipped & (cov > 0.0) & (cov < 3.0)
    count = math.floor(0.02 * mask.sum().item())
    assert 1 < count < candidates.sum() // 4

    def chosen(seed):
        out, grad = _product("clip_cov", old, logp, adv, mask, "token-mean", p=p,
                             generator=torch.Generator().manual_seed(seed))
        picked = candidates & (grad == 0)  # an unclipped token with A != 0 has a gradient unless detached
        assert picked.sum() == count and math.isclose(out.pg_clipfrac.item(), count / mask.sum().item())
        keep = torch.where(picked, 0.0, 1.0)  # verl's formula with the tokens it chose
        lossmat = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - p["low"], 1 + p["high"])) * keep
        _close(out.pg_loss.detach(), verl_agg(lossmat, mask, "token-mean"))
        return picked

    first = chosen(0)
    assert torch.equal(chosen(0), first)  # a seeded generator repeats its choice
    n_draws = 400
    frequency = sum(chosen(seed).to(F64) for seed in range(1, n_draws + 1)) / n_draws
    expected = count / candidates.sum().item()
    assert frequency[~candidates].max() == 0
    assert abs(frequency[candidates].mean() - expected) < 1e-12  # every draw takes `count` of them
    # Spread over all: a uniform draw leaves a given candidate out of every draw with probability
    # (1 - expected)^n_draws, so some candidate is never picked with probability below this bound
    # (whatever the generator's stream); picking one 6 times as often as expected is far less likely.
    assert candidates.sum().item() * (1 - expected) ** n_draws < 1e-6
    assert frequency[candidates].min() > 0 and frequency[candidates].max() < 6 * expected


def test_kl_cov_penalises_the_known_tokens():
    """The covariance terms [2, 0, 0, 2]: with kl_cov_ratio 0.25 one token, the earlier of the tie;
    with 0.5 both."""
    old = [x - d for x, d in zip(COV_LOGP, (0.3, 0.1, -0.2, -0.4))]
    r = [math.exp(d) for d in (0.3, 0.1, -0.2, -0.4)]
    base = sum(-a * x for a, x in zip(COV_ADV, r))
    for ratio, chosen in ((0.25, (0,)), (0.5, (0, 3))):
        out, grad = _one("kl_cov", old, COV_LOGP, COV_ADV, p=dict(PARAMS, kl_cov_ratio=ratio, ppo_kl_coef=0.7))
        penalty = sum(0.7 * abs(d) for i, d in enumerate((0.3, 0.1, -0.2, -0.4)) if i in chosen)
        assert math.isclose(out.pg_loss.item(), (base + penalty) / 4, rel_tol=1e-12)
        want = [(-a * x + (0.7 * math.copysign(1, d) if i in chosen else 0.0)) / 4
                for i, (a, x, d) in enumerate(zip(COV_ADV, r, (0.3, 0.1, -0.2, -0.4)))]
        _close(grad, torch.tensor([want], dtype=F64))
        assert math.isclose(out.ppo_kl.item(), (0.3 + 0.1 + 0.2 + 0.4) / 4, rel_tol=1e-12)


def test_covariance_share_is_at_least_one_token():
    """The share is max(floor(ratio x valid tokens), 1): verl's defaults (0.0002) take one token
    of these 26, the one of largest covariance term for kl_cov; an empty micro-batch none."""
    old, logp, adv, mask, _ = _inputs()
    for fn in (compute_policy_loss_clip_cov, compute_policy_loss_kl_cov):
        assert fn(old, logp, adv, torch.zeros_like(mask), cliprange=0.2).pg_loss.item() == 0.0
    cov = torch.where(mask > 0, (adv - _mean(adv, mask)) * (logp - _mean(logp, mask)), -math.inf)
    top = cov.flatten().argmax()
    unpenalised = _product("kl_cov", old, logp, adv, mask, "token-mean", p=dict(PARAMS, ppo_kl_coef=0.0))[0]
    out = compute_policy_loss_kl_cov(old, logp, adv, mask, cliprange=0.2)
    assert math.isclose(out.pg_loss.item() - unpenalised.pg_loss.item(),
                        0.1 * (logp - old).flatten()[top].abs().item() / 26, rel_tol=1e-9)


# ----------------------------------------------------------------------------- config

def _load(*overrides):
    return load_config(PPOConfig, "configs/demo.yaml", list(overrides))


def _needs(mode):
    """The options a mode cannot run without (dro's coefficient has no default, as in verl)."""
    return ("actor_rollout_ref.actor.policy_loss.dro_beta=0.1",) if mode == "dro" else ()


def test_verls_policy_loss_section_and_defaults_load():
    verl_yaml = ("actor_rollout_ref.actor.policy_loss={loss_mode: vanilla, clip_cov_ratio: 0.0002, clip_cov_lb: 1.0, "
                 "clip_cov_ub: 5.0, kl_cov_ratio: 0.0002, ppo_kl_coef: 0.1, dro_beta: null}")
    actor = _load(verl_yaml, "actor_rollout_ref.actor.tau_pos=1.0", "actor_rollout_ref.actor.tau_neg=1.05"
                  ).actor_rollout_ref.actor
    assert actor.policy_loss == PolicyLossConfig() == _load().actor_rollout_ref.actor.policy_loss
    assert PolicyLossParams(*(getattr(actor.policy_loss, k) for k in PolicyLossParams._fields[:5]),
                            actor.tau_pos, actor.tau_neg) == PolicyLossParams()  # the losses' defaults are verl's too
    for mode in VERL_MODES:
        loaded = _load(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *_needs(mode)).actor_rollout_ref.actor
        assert loaded.policy_loss.loss_mode == mode


@pytest.mark.parametrize("override,message", [
    ("policy_loss.loss_mode=ppo", "actor_rollout_ref.actor.policy_loss.loss_mode: 'ppo' is not one of ['vanilla', "
                                  "'dppo_tv', 'dppo_kl', 'gspo', 'sapo', 'gpg', 'clip_cov', 'kl_cov', 'geo_mean', "
                                  "'dro', 'cispo']"),
    ("policy_loss.loss_mode=bypass_mode", "is not one of"),
    ("policy_loss.clip_cov_ratio=0", "actor_rollout_ref.actor.policy_loss.clip_cov_ratio: 0.0 is out of range"),
    ("policy_loss.kl_cov_ratio=1.5", "actor_rollout_ref.actor.policy_loss.kl_cov_ratio: 1.5 is out of range"),
    ("policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss: loss_mode=dro needs dro_beta (> 0)"),
    ("policy_loss.dro_beta=0", "actor_rollout_ref.actor.policy_loss.dro_beta: 0.0 is out of range"),
    ("policy_loss.ppo_kl_coef=-1", "actor_rollout_ref.actor.policy_loss.ppo_kl_coef: -1.0 is out of range"),
    ("policy_loss.clip_cov_lb=5", "actor_rollout_ref.actor.policy_loss: clip_cov_lb=5.0 must be below clip_cov_ub=5.0"),
    ("policy_loss.clip_cov_ratio=much", "actor_rollout_ref.actor.policy_loss.clip_cov_ratio: expected a number"),
    ("policy_loss.clip_cov_ration=0.1", "did you mean 'actor_rollout_ref.actor.policy_loss.clip_cov_ratio'"),
    ("tau_pos=0", "actor_rollout_ref.actor.tau_pos: 0.0 is out of range; allowed: > 0"),
    ("tau_neg=-1", "actor_rollout_ref.actor.tau_neg: -1.0 is out of range"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        _load(f"actor_rollout_ref.actor.{override}")
    assert message in str(e.value)


def test_bypass_mode_refuses_another_loss_mode():
    bypass = "algorithm.rollout_correction.bypass_mode=true"
    validate(_load(bypass), 2, 2)
    validate(_load(bypass, "algorithm.rollout_correction.loss_type=reinforce"), 2, 2)
    validate(_load("actor_rollout_ref.actor.policy_loss.loss_mode=gspo"), 2, 2)
    with pytest.raises(ConfigError) as e:
        validate(_load(bypass, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"), 2, 2)
    message = str(e.value)
    for part in ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "algorithm.rollout_correction.bypass_mode=true",
                 "algorithm.rollout_correction.loss_type", "set loss_mode=vanilla, or bypass_mode=false"):
        assert part in message, message
    with pytest.raises(ConfigError, match="'vanilla' is not one of \\['ppo_clip', 'reinforce'\\]"):
        _load("algorithm.rollout_correction.loss_type=vanilla")


def test_options_the_loss_does_not_read_are_noted():
    assert config_notes(_load()) == []
    for mode in VERL_MODES:  # every mode knows the options it reads; the demo sets none at another value
        assert config_notes(_load(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *_needs(mode),
                                  "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")) == []
    assert config_notes(_load("actor_rollout_ref.actor.policy_loss.dro_beta=0.5")) == [
        "actor_rollout_ref.actor.policy_loss.dro_beta not read by actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"]
    notes = config_notes(_load("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.tau_pos=2",
                               "actor_rollout_ref.actor.clip_ratio_c=4", "actor_rollout_ref.actor.clip_ratio_low=3e-4"))
    assert notes == [
        "actor_rollout_ref.actor.clip_ratio_c, actor_rollout_ref.actor.tau_pos not read by "
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]  # gspo reads loss_agg_mode (verl 0.9.1)
    assert config_notes(_load("actor_rollout_ref.actor.policy_loss.loss_mode=sapo")) == [
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo weighs every sequence the same (as verl): "
        "actor_rollout_ref.actor.loss_agg_mode=token-mean aggregates the entropy and KL-loss terms only"]
    assert config_notes(_load("actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                              "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")) == []
    # a critic that inherits the mode aggregates its value loss by it (one with its own mode does not)
    gae = ("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "algorithm.adv_estimator=gae")
    assert config_notes(_load(*gae)) == [
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo weighs every sequence the same (as verl): "
        "actor_rollout_ref.actor.loss_agg_mode=token-mean aggregates the entropy and KL-loss terms only, and the "
        "critic's value loss (critic.loss_agg_mode inherits it)"]
    assert config_notes(_load(*gae, "critic.loss_agg_mode=seq-mean-token-mean")) == [
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo weighs every sequence the same (as verl): "
        "actor_rollout_ref.actor.loss_agg_mode=token-mean aggregates the entropy and KL-loss terms only"]
    assert config_notes(_load("algorithm.rollout_correction.bypass_mode=true",
                              "algorithm.rollout_correction.loss_type=reinforce",
                              "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5")) == [
        "actor_rollout_ref.actor.policy_loss.ppo_kl_coef not read by algorithm.rollout_correction.loss_type=reinforce"]


# ----------------------------------------------------------------------------- the actor update

def _update(base, mode, micro=8, seed=0, **cfg):
    model = copy.deepcopy(base)
    worker = _worker(model)
    ro = _rollouts()
    with torch.no_grad():
        old, _ = worker.log_probs(ro)
    ro.old_log_probs = old - 0.05 * ro.response_mask  # ratios != 1: two epochs, the stored old log-probs are the ratio's
    worker.update(ro, _actor_cfg(ppo_epochs=2, entropy_coeff=0.0, use_kl_loss=False, ppo_micro_batch_size_per_gpu=micro,
                                 policy_loss=PolicyLossConfig(loss_mode=mode, **cfg)),
                  num_mini_batches=1, kl_loss_coef=0.1, seed=seed)
    return {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "gspo", "sapo", "geo_mean", "dro", "cispo", "gpg"])
def test_update_trains_the_chosen_loss_independent_of_micro_batching(mode):
    """loss_agg_mode token-mean: sapo and geo_mean normalise by the mini-batch's sequence
    count, which the update plans beside the token count. The two updates differ in the order of
    float32 sums only: at most 2.3e-6 of the largest update (about 1) over 48 model seeds of each
    mode, against UPDATE_RTOL (1e-4); a micro-batch normalised by its own counts differs by 1.7
    times the update or more."""
    base = Transformer.build(ARGS, seed=0)
    kw = {"dro_beta": 0.5} if mode == "dro" else {}
    whole, split = _update(base, mode, **kw), _update(base, mode, micro=2, **kw)
    vanilla = _update(base, "vanilla")
    assert max((whole[k] - vanilla[k]).abs().max().item() for k in whole) > 1e-4  # not vanilla's step
    update = max(v.abs().max().item() for v in whole.values())
    diff = max((whole[k] - split[k]).abs().max().item() for k in whole)
    assert update > 0.1 and diff <= UPDATE_RTOL * update, (diff, update)


def test_update_repeats_clip_covs_draws_for_a_seed():
    base = Transformer.build(ARGS, seed=0)
    kw = dict(clip_cov_ratio=0.3, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    first, again, other = _update(base, "clip_cov", **kw), _update(base, "clip_cov", **kw), \
        _update(base, "clip_cov", seed=1, **kw)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_update_passes_the_configs_loss_and_parameters(monkeypatch):
    import trainer.roles as roles

    calls = []

    def spy(name):
        fn = get_policy_loss_fn(name)

        def loss(**kw):
            calls.append((name, kw["loss_params"], kw["generator"]))
            return fn(**kw)
        return loss

    monkeypatch.setattr(roles, "get_policy_loss_fn", spy)
    params = dict(clip_cov_ratio=0.01, clip_cov_lb=0.5, clip_cov_ub=2.0, kl_cov_ratio=0.02, ppo_kl_coef=0.3)
    model = Transformer.build(ARGS, seed=0)
    ro = _rollouts()
    _worker(model).update(ro, _actor_cfg(policy_loss=PolicyLossConfig(loss_mode="kl_cov", **params), tau_pos=1.5,
                                         tau_neg=2.5), num_mini_batches=1, kl_loss_coef=0.1, seed=0)
    assert calls and {c[:2] for c in calls} == {("kl_cov", PolicyLossParams(**params, tau_pos=1.5, tau_neg=2.5))}
    assert all(isinstance(c[2], torch.Generator) for c in calls)


@pytest.mark.parametrize("mode", ["vanilla", "cispo"])
def test_a_lower_clip_range_of_one_or_more_clips_nothing_from_below(mode):
    """verl's CISPO script sets clip_ratio_low=10: the lower bound 1 - 10 is below every ratio, so
    no token is clipped from below: a negative-advantage token with ratio 0.05 is not counted as
    clipped, and vanilla's loss keeps the unclipped term -A r = 0.05."""
    assert load_config(PPOConfig, None, ["actor_rollout_ref.model.path=/m",
                                         "actor_rollout_ref.actor.clip_ratio_low=10"]).actor_rollout_ref.actor \
        .clip_ratio_low == 10
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[math.log(0.05), 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    out = get_policy_loss_fn(mode)(old, new, adv, mask, cliprange_low=10.0, cliprange_high=0.2,
                                   loss_agg_mode="token-mean")
    assert float(out.pg_clipfrac_lower) == 0.0
    if mode == "vanilla":
        assert float(out.pg_loss.detach()) == pytest.approx(0.05, rel=1e-12)
        assert float(out.pg_clipfrac) == 0.0
