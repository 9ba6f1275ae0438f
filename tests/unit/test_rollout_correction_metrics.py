"""The `rollout_corr/` metrics against verl 0.9.1's: the same keys, and the values of a float64
transcription of verl's `compute_rollout_correction_and_rejection_mask` (its IS, rejection and
off-policy figures), written here in plain Python, row by row; then meshppo's own rules where
it departs (empty responses, asymmetric k1 bounds) and the bypass mode's averages."""

import copy
import math
import statistics

import pytest
import torch

from models import Transformer
from ppo.core_algos import compute_rollout_correction, parse_rollout_is_threshold, parse_rollout_rs
from tests.unit.test_rollout_correction import ARGS, _rc, _step, _worker
from tests.unit.test_batching import _actor_cfg, _rollouts

F64 = torch.float64
BOUND = 20.0  # verl's SAFETY_BOUND


def _clamp(x):
    return min(max(x, -BOUND), BOUND)


def _mean(xs):
    return sum(xs) / len(xs)


def _population_std(xs):
    m = _mean(xs)
    return math.sqrt(max(_mean([x * x for x in xs]) - m * m, 0.0)) if len(xs) > 1 else 0.0


def _sample_std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _verl_threshold(spec):
    """verl's reading of rollout_is_threshold: (upper, lower or None)."""
    if isinstance(spec, str) and "_" in spec:
        lower, upper = spec.split("_")
        return float(upper), float(lower)
    return float(spec), None


def _verl_is(rows, rollout_is, spec):
    """verl's IS figures; `rows` holds each sequence's unclamped log-ratios log pi_old - log pi_rollout."""
    upper, lower = _verl_threshold(spec)
    low = lower if lower is not None else 1 / upper
    if rollout_is == "token":
        raw = [[math.exp(_clamp(d)) for d in r] for r in rows]
    else:
        raw = [[math.exp(_clamp(sum(r)))] * len(r) for r in rows]
    if lower is None:
        w = [[min(x, upper) for x in r] for r in raw]
    else:
        w = [[x if lower <= x <= upper else 0.0 for x in r] for r in raw]
    tokens_w, tokens_raw = [x for r in w for x in r], [x for r in raw for x in r]
    out = {"rollout_is_mean": _mean(tokens_w)}
    if rollout_is == "sequence":
        sums = [sum(r) for r in rows]
        out["rollout_is_max"] = math.exp(min(max(sums), BOUND))
        out["rollout_is_min"] = math.exp(min(sums))
        out["rollout_is_ratio_fraction_high"] = _mean([float(s > math.log(upper)) for s in sums])
        out["rollout_is_ratio_fraction_low"] = _mean([float(s < math.log(low)) for s in sums])
    else:
        out["rollout_is_max"], out["rollout_is_min"] = max(tokens_w), min(tokens_w)
        out["rollout_is_ratio_fraction_high"] = _mean([float(x > upper) for x in tokens_raw])
        out["rollout_is_ratio_fraction_low"] = _mean([float(x < low) for x in tokens_raw])
    capped = [min(max(x, 0.0), upper) for x in tokens_w]
    out["rollout_is_std"] = _population_std(capped)
    m = _mean(capped)
    out["rollout_is_eff_sample_size"] = 1 / _mean([(x / (m + 1e-8)) ** 2 for x in capped])
    seq = [_mean(r) for r in w]
    raw_seq = [_mean(r) for r in raw]
    out.update(rollout_is_seq_mean=_mean(seq), rollout_is_seq_std=_sample_std(seq), rollout_is_seq_max=max(seq),
               rollout_is_seq_min=min(seq), rollout_is_seq_max_deviation=max(abs(s - 1) for s in seq),
               rollout_is_seq_fraction_high=_mean([float(s > upper) for s in raw_seq]),
               rollout_is_seq_fraction_low=_mean([float(s < low) for s in raw_seq]))
    if lower is not None:
        out["rollout_is_oob_ratio"] = _mean([float(x < lower or x > upper) for x in tokens_raw])
    return out, w


def _verl_rs(rows, options, spec):
    """verl's rejection figures: per option, then all options together."""
    options = options.split(",")
    specs = str(spec).split(",")
    specs = specs * len(options) if len(specs) == 1 else specs
    keep = [[True] * len(r) for r in rows]
    out = {}
    for option, s in zip(options, specs):
        level, kind = option.rsplit("_", 1)
        k1 = kind == "k1"
        if k1:
            lower, upper = map(float, s.split("_")) if "_" in s else (1 / float(s), float(s))
            hi, lo = math.log(upper), math.log(lower)
        else:
            hi, lo = float(s), 0.0
        stat = {"k1": lambda d: -d, "k2": lambda d: 0.5 * d * d, "k3": lambda d: math.exp(d) - 1 - d}[kind]
        per_token = [[stat(_clamp(d)) for d in r] for r in rows]
        if level == "token":
            seq_values = [_mean(r) for r in per_token]
            judged = [x for r in per_token for x in r]
            passed = [[(lo <= x <= hi) if k1 else x <= hi for x in r] for r in per_token]
        else:
            how = {"seq_sum": sum, "seq_mean": _mean, "seq_max": max}[level]
            seq_values = [how(r) for r in per_token]
            judged = seq_values
            per_token = [[v] * len(r) for v, r in zip(seq_values, rows)]
            passed = [[(lo <= v <= hi) if k1 else v <= hi] * len(r) for v, r in zip(seq_values, rows)]
        tokens = [x for r in per_token for x in r]
        p = f"rollout_rs_{option}"
        out[f"{p}_mean"] = _mean(tokens)
        out[f"{p}_max"], out[f"{p}_min"] = max(judged), min(judged)
        out[f"{p}_fraction_high"] = _mean([float(x > hi) for x in judged])
        out[f"{p}_fraction_low"] = _mean([float(x < lo) for x in judged]) if k1 else 0.0
        out[f"{p}_std"] = _population_std([min(max(x, lo), hi) for x in tokens])
        out.update({f"{p}_seq_mean": _mean(seq_values), f"{p}_seq_std": _sample_std(seq_values),
                    f"{p}_seq_max": max(seq_values), f"{p}_seq_min": min(seq_values),
                    f"{p}_seq_max_deviation": max(abs(v) for v in seq_values),
                    f"{p}_seq_fraction_high": _mean([float(v > hi) for v in seq_values])})
        if k1:
            out[f"{p}_seq_fraction_low"] = _mean([float(v < lo) for v in seq_values])
        out[f"{p}_masked_fraction"] = _mean([float(not x) for r in passed for x in r])
        out[f"{p}_seq_masked_fraction"] = _mean([float(not all(r)) for r in passed])
        keep = [[a and b for a, b in zip(k, q)] for k, q in zip(keep, passed)]
    out["rollout_rs_masked_fraction"] = _mean([float(not x) for r in keep for x in r])
    out["rollout_rs_seq_masked_fraction"] = _mean([float(not all(r)) for r in keep])
    return out


def _verl_off_policy(old_rows, rollout_rows):
    deltas = [[o - r for o, r in zip(orow, rrow)] for orow, rrow in zip(old_rows, rollout_rows)]
    tokens = [d for r in deltas for d in r]
    old_means, rollout_means = [_mean(r) for r in old_rows], [_mean(r) for r in rollout_rows]
    diffs = [r - o for o, r in zip(old_means, rollout_means)]
    return {
        "training_ppl": _mean([math.exp(-m) for m in old_means]), "training_log_ppl": _mean([-m for m in old_means]),
        "kl": _mean([-d for d in tokens]), "k3_kl": _mean([math.exp(d) - d - 1 for d in tokens]),
        "rollout_ppl": _mean([math.exp(-m) for m in rollout_means]),
        "rollout_log_ppl": _mean([-m for m in rollout_means]),
        "log_ppl_diff": _mean(diffs), "log_ppl_abs_diff": _mean([abs(x) for x in diffs]),
        "log_ppl_diff_max": max(diffs), "log_ppl_diff_min": min(diffs),
        "ppl_ratio": _mean([math.exp(x) for x in diffs]),
        "chi2_token": _mean([math.exp(_clamp(d)) ** 2 for d in tokens]) - 1,
        "chi2_seq": _mean([math.exp(2 * _clamp(sum(r))) for r in deltas]) - 1,
    }


def verl_rollout_corr(old, rollout, mask, rollout_is=None, is_threshold=2.0, batch_normalize=False,
                      rollout_rs=None, rs_threshold=None):
    """verl 0.9.1's `rollout_corr/` metrics for a batch without empty responses, in float64."""
    lengths = [int(n) for n in mask.sum(-1)]
    old_rows = [old[i, :n].tolist() for i, n in enumerate(lengths)]
    rollout_rows = [rollout[i, :n].tolist() for i, n in enumerate(lengths)]
    deltas = [[o - r for o, r in zip(orow, rrow)] for orow, rrow in zip(old_rows, rollout_rows)]
    out = {}
    if rollout_is is not None:
        figures, w = _verl_is(deltas, rollout_is, is_threshold)
        out.update(figures)
        if batch_normalize:
            mean = _mean([x for r in w for x in r]) if rollout_is == "token" else _mean([_mean(r) for r in w])
            out["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    if rollout_rs is not None:
        out.update(_verl_rs(deltas, rollout_rs, rs_threshold))
    out.update(_verl_off_policy(old_rows, rollout_rows))
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def _batch(seed=0, lengths=(7, 3, 1, 5, 6, 2), scale=0.6):
    """Log-probs of sequences of `lengths` (no empty one), the engine's differing by N(0, scale)
    per token, junk at the padding."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rollout = -torch.rand(len(lengths), width, generator=g, dtype=F64) * 3
    old = rollout + torch.randn(len(lengths), width, generator=g, dtype=F64) * scale
    junk = torch.full_like(old, 50.0)
    return torch.where(mask.bool(), old, junk), torch.where(mask.bool(), rollout, -junk), mask


def _meshppo(old, rollout, mask, rollout_is=None, is_threshold=2.0, batch_normalize=False, rollout_rs=None,
             rs_threshold=None):
    lower, upper = parse_rollout_is_threshold(is_threshold)
    rejection = parse_rollout_rs(rollout_rs, rs_threshold) if rollout_rs else ()
    _, _, metrics = compute_rollout_correction(old, rollout, mask, rollout_is, lower, upper, rejection, batch_normalize)
    return {k: float(v) for k, v in metrics.items()}


CONFIGS = [
    dict(rollout_is="token", is_threshold=2.0, rollout_rs="token_k1", rs_threshold=2.0),
    dict(rollout_is="sequence", is_threshold=3.0, rollout_rs="seq_mean_k3", rs_threshold=0.05),
    dict(rollout_is="token", is_threshold="0.5_2.0", rollout_rs="token_k2,seq_sum_k1,seq_max_k3",
         rs_threshold="0.3,3.0,0.8"),
    dict(rollout_is="sequence", is_threshold="0.5_5.0", batch_normalize=True,
         rollout_rs="seq_mean_k1,token_k3,seq_sum_k2,seq_max_k2,seq_mean_k2,seq_sum_k3,token_k1",
         rs_threshold="1.5,0.4,1.0,0.3,0.1,0.9,0.5_2.0"),
    dict(rollout_is="token", is_threshold=1.5, batch_normalize=True),
    dict(rollout_rs="token_k3", rs_threshold=0.2),
    dict(),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "off-policy")
def test_rollout_corr_metrics_are_verls(config, seed):
    """verl 0.9.1 logs 13 off-policy figures, 14 per IS level (15 with IcePop, 16 with batch
    normalisation), 15 per k1 rejection option, 14 per k2 / k3 one and 2 for all options;
    meshppo logged 17 in all (no ESS, no std, no per-option statistics)."""
    old, rollout, mask = _batch(seed)
    got, want = _meshppo(old, rollout, mask, **config), verl_rollout_corr(old, rollout, mask, **config)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_configs_exercise_every_branch():
    """The batches above are not degenerate: the bounds reject some tokens and keep others, and
    truncation and IcePop act on some weights."""
    old, rollout, mask = _batch(1)
    m = verl_rollout_corr(old, rollout, mask, **CONFIGS[3])
    for option in ("seq_mean_k1", "token_k3", "seq_sum_k2", "seq_max_k2", "seq_mean_k2", "seq_sum_k3", "token_k1"):
        assert 0 < m[f"rollout_corr/rollout_rs_{option}_masked_fraction"] < 1, option
    assert 0 < m["rollout_corr/rollout_is_oob_ratio"] < 1
    assert 0 < m["rollout_corr/rollout_is_seq_fraction_high"] < 1
    chained = verl_rollout_corr(old, rollout, mask, **CONFIGS[2])
    for option in ("token_k2", "seq_sum_k1", "seq_max_k3"):
        assert 0 < chained[f"rollout_corr/rollout_rs_{option}_masked_fraction"] < 1, option
    tis = verl_rollout_corr(old, rollout, mask, **CONFIGS[0])
    assert 0 < tis["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    assert 0 < tis["rollout_corr/rollout_is_ratio_fraction_low"] < 1
    assert 0.3 < tis["rollout_corr/rollout_is_eff_sample_size"] < 1


def test_empty_responses_are_left_out_of_every_figure():
    """verl counts an empty response in some sequence figures (a weight of 1, a perplexity of 1);
    meshppo leaves it out of all of them: the figures of a batch with an empty row are those of
    the batch without it."""
    old, rollout, mask = _batch(1)
    config = CONFIGS[3]
    plain = _meshppo(old, rollout, mask, **config)
    with_empty = _meshppo(torch.cat([old, old[:1]]), torch.cat([rollout, rollout[:1]]),
                          torch.cat([mask, torch.zeros_like(mask[:1])]), **config)
    assert sorted(with_empty) == sorted(plain)
    for key, value in plain.items():
        assert with_empty[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_asymmetric_k1_bounds_are_reported_as_they_reject():
    """verl's code puts k1 bounds on log(pi_rollout / pi_old) = -delta where its documentation
    (and meshppo's rejection) puts them on the ratio pi_old / pi_rollout; meshppo's k1 figures
    keep verl's statistic (-delta) with the bounds it rejects by, [-log upper, -log lower]: the
    shares above and below them add up to the share rejected."""
    old, rollout, mask = _batch(1)
    m = _meshppo(old, rollout, mask, rollout_rs="token_k1,seq_mean_k1", rs_threshold="0.7_1.6,0.8_1.3")
    for option in ("token_k1", "seq_mean_k1"):
        p = f"rollout_corr/rollout_rs_{option}"
        assert m[f"{p}_fraction_high"] > 0 and m[f"{p}_fraction_low"] > 0
    p = "rollout_corr/rollout_rs_token_k1"
    assert m[f"{p}_fraction_high"] + m[f"{p}_fraction_low"] == pytest.approx(m[f"{p}_masked_fraction"], abs=1e-12)
    p = "rollout_corr/rollout_rs_seq_mean_k1"
    assert m[f"{p}_seq_fraction_high"] + m[f"{p}_seq_fraction_low"] == pytest.approx(
        m[f"{p}_seq_masked_fraction"], abs=1e-12)
    # delta = 0.4 (ratio 1.49, inside [0.9, 1.6]) is kept; verl's statistic -0.4 is below log 0.9 = -0.105
    one = torch.tensor([[-1.0]], dtype=F64)
    kept = _meshppo(one + 0.4, one, torch.ones(1, 1, dtype=F64), rollout_rs="token_k1", rs_threshold="0.9_1.6")
    assert kept["rollout_corr/rollout_rs_token_k1_masked_fraction"] == 0.0
    assert kept["rollout_corr/rollout_rs_token_k1_mean"] == pytest.approx(-0.4, abs=1e-12)
    assert kept["rollout_corr/rollout_rs_token_k1_fraction_low"] == 0.0


def test_bypass_mode_averages_every_figure_over_the_micro_batches():
    """In bypass mode verl 0.9.1 computes the figures per micro-batch and averages them (its
    policy-loss metrics are `Metric` MEAN), a max or min too; meshppo does the same (means over
    micro-batches, then ranks)."""
    base = Transformer.build(ARGS, seed=0)
    ro = _rollouts()
    g = torch.Generator().manual_seed(5)
    shift = torch.randn(ro.response_mask.shape, generator=g) * 0.2 * ro.response_mask
    rc = _rc(bypass_mode=True, loss_type="reinforce", rollout_is="token", is_bounds=(None, 1.1),
             rejection=parse_rollout_rs("token_k1,seq_max_k2", "1.3,0.05"))
    _, out = _step(base, rollout_shift=shift, rc=rc, ppo_micro_batch_size_per_gpu=2)
    old, _ = _worker(copy.deepcopy(base)).log_probs(ro)
    rollout = old - shift
    parts = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    per_part = [compute_rollout_correction(old[p].double(), rollout[p].double(), ro.response_mask[p], "token", None,
                                           1.1, rc.rejection)[2] for p in parts]
    keys = [k for k in per_part[0] if k.startswith("rollout_corr/")]
    assert {"rollout_corr/rollout_is_max", "rollout_corr/log_ppl_diff_min",
            "rollout_corr/rollout_rs_seq_max_k2_seq_max"} <= set(keys) <= set(out)
    spread = [float(m["rollout_corr/rollout_is_min"]) for m in per_part]
    assert max(spread) - min(spread) > 0.05  # the micro-batches differ: the mean is not any one of them
    for key in keys:
        want = sum(float(m[key]) for m in per_part) / len(per_part)
        assert out[key] == pytest.approx(want, rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_float32_log_probs_give_the_weights_exact_spread(level):
    """The trainer's log-probs are float32: the spreads come from sums of float64 products of them, so weights
    that are equal up to float32 rounding (a shift of 0.1 nats) and nearly equal ones get the two-pass float64
    figures of the same weights (float32 squares' rounding, summed over 32k tokens, read as a 1e-4 spread)."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(64, 512, generator=g).float()
    mask = torch.ones(64, 512, dtype=torch.bool)
    for rollout in (old - 0.1, old - 0.1 + 1e-4 * torch.randn(64, 512, generator=g)):
        weights, _, m = compute_rollout_correction(old, rollout, mask, level, None, 2.0)
        w = weights.double()
        per_sequence = w.mean(-1)
        # (torch's float64 std is two-pass: the mean taken out before squaring)
        assert m["rollout_corr/rollout_is_std"].item() == pytest.approx(w.std(correction=0).item(), abs=1e-6)
        assert m["rollout_corr/rollout_is_seq_std"].item() == pytest.approx(per_sequence.std().item(), abs=1e-6)


def test_bypass_mode_combines_the_mini_batches_as_verls_reduce_metrics():
    """Over mini-batches verl 0.9.1 reduces a role's figures by name (`verl.utils.metric.reduce_metrics`):
    the largest mini-batch figure for a key holding "max", the smallest for one holding "min", else the
    mean. Two mini-batches of two micro-batches each, the actor left unchanged (learning rate 0), so each
    mini-batch's figures are the means of its micro-batches' own."""
    model = Transformer.build(ARGS, seed=0)
    worker = _worker(model)
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ro = _rollouts()
    old, _ = worker.log_probs(ro)
    g = torch.Generator().manual_seed(5)
    rollout = old - torch.randn(ro.response_mask.shape, generator=g) * 0.3 * ro.response_mask
    ro.old_log_probs = ro.rollout_log_probs = rollout
    rc = _rc(bypass_mode=True, loss_type="reinforce", rollout_is="token", is_bounds=(None, 5.0),
             rejection=parse_rollout_rs("token_k1", "1.3"))
    out = worker.update(ro, _actor_cfg(entropy_coeff=0.0, use_kl_loss=False, ppo_micro_batch_size_per_gpu=2),
                        num_mini_batches=2, kl_loss_coef=0.0, seed=0, rollout_correction=rc)
    parts = [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]
    per_mini_batch = [[compute_rollout_correction(old[p].double(), rollout[p].double(), ro.response_mask[p], "token",
                                                  None, 5.0, rc.rejection)[2] for p in mb] for mb in parts]
    keys = [k for k in per_mini_batch[0][0] if k.startswith("rollout_corr/")]
    assert {"rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min", "rollout_corr/log_ppl_diff_max",
            "rollout_corr/rollout_is_mean"} <= set(keys) <= set(out)
    for key in keys:
        figures = [sum(float(m[key]) for m in mb) / len(mb) for mb in per_mini_batch]
        want = max(figures) if "max" in key else min(figures) if "min" in key else sum(figures) / 2
        assert out[key] == pytest.approx(want, rel=1e-4, abs=1e-5), key
    for key in ("rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min", "rollout_corr/log_ppl_diff_max"):
        figures = [sum(float(m[key]) for m in mb) / 2 for mb in per_mini_batch]
        assert abs(figures[0] - figures[1]) > 0.01, key  # the mini-batches differ: max, min and mean tell apart
