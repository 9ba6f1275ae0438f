"""Validation metrics (`trainer.val_metrics`) against verl's algorithm and hand-computed values."""

import itertools
import json
import math
from collections import defaultdict
from functools import partial

import numpy as np
import pytest

from trainer import val_metrics
from trainer.val_metrics import bootstrap_indices, gen_ns, process_validation_metrics, validation_metrics


# ---------------------------------------------------------------- verl, transcribed
# verl 0.9.1's verl.trainer.ppo.metric_utils (bootstrap_metric, calc_maj_val,
# process_validation_metrics) and RayPPOTrainer._val_metrics_update, as written there: the global
# NumPy generator reseeded per call, one reduce_fn call per resample over an object array, the vote
# through a dict; a variable's None values dropped, and a prompt's maj only where none was dropped
# and none of its preds is None.

def verl_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    np.random.seed(seed)
    data_np = np.array(data, dtype=object)
    n_data = len(data_np)
    bootstrap_idxs = np.random.choice(n_data, size=(n_bootstrap, subset_size), replace=True)
    n_fns = len(reduce_fns)
    metric_results = np.empty((n_fns, n_bootstrap), dtype=np.float64)
    for fn_idx, reduce_fn in enumerate(reduce_fns):
        for boot_idx in range(n_bootstrap):
            sample = data_np[bootstrap_idxs[boot_idx]]
            metric_results[fn_idx, boot_idx] = reduce_fn(sample)
    return [(float(np.mean(metric_results[fn_idx])), float(np.std(metric_results[fn_idx]))) for fn_idx in range(n_fns)]


def verl_calc_maj_val(data, vote_key, val_key):
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])
    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    maj_vote = max(vote2cnt, key=vote2cnt.get)
    return vote2vals[maj_vote][0]


def verl_process_validation_metrics(data_sources, sample_uids, infos_dict, seed=42):
    data_src2uid2var2vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for sample_idx, data_source in enumerate(data_sources):
        uid = sample_uids[sample_idx]
        var2vals = data_src2uid2var2vals[data_source][uid]
        for var_name, var_vals in infos_dict.items():
            var2vals[var_name].append(var_vals[sample_idx])
    data_src2uid2var2metric = {}
    for data_source, uid2var2vals in data_src2uid2var2vals.items():
        uid_dict = data_src2uid2var2metric.setdefault(data_source, {})
        for uid, var2vals in uid2var2vals.items():
            pred_vals = var2vals.get("pred")
            var_dict = uid_dict.setdefault(uid, {})
            for var_name, var_vals in var2vals.items():
                var_vals = [v for v in var_vals if v is not None]
                if not var_vals or isinstance(var_vals[0], str):
                    continue
                has_pred = (pred_vals is not None and len(pred_vals) == len(var_vals)
                            and all(p is not None for p in pred_vals))
                n_resps = len(var_vals)
                metric = {f"mean@{n_resps}": float(np.mean(var_vals))}
                if n_resps > 1:
                    metric[f"std@{n_resps}"] = float(np.std(var_vals))
                    for n in gen_ns(n_resps):
                        (bon_mean, bon_std), (won_mean, won_std) = verl_bootstrap_metric(
                            data=var_vals, subset_size=n, reduce_fns=[np.max, np.min], n_bootstrap=1000, seed=seed)
                        metric[f"best@{n}/mean"] = bon_mean
                        metric[f"best@{n}/std"] = bon_std
                        metric[f"worst@{n}/mean"] = won_mean
                        metric[f"worst@{n}/std"] = won_std
                        if has_pred:
                            vote_data = [{"val": val, "pred": pred} for val, pred in zip(var_vals, pred_vals, strict=True)]
                            [(maj_n_mean, maj_n_std)] = verl_bootstrap_metric(
                                data=vote_data, subset_size=n,
                                reduce_fns=[partial(verl_calc_maj_val, vote_key="pred", val_key="val")],
                                n_bootstrap=1000, seed=seed)
                            metric[f"maj@{n}/mean"] = maj_n_mean
                            metric[f"maj@{n}/std"] = maj_n_std
                var_dict[var_name] = metric
    data_src2var2metric2uid_vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for data_source, uid2var2metric in data_src2uid2var2metric.items():
        for uid, var2metric in uid2var2metric.items():
            for var_name, metric in var2metric.items():
                for metric_name, metric_val in metric.items():
                    data_src2var2metric2uid_vals[data_source][var_name][metric_name].append(metric_val)
    data_src2var2metric2val = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for data_source, var2metric2uid_vals in data_src2var2metric2uid_vals.items():
        for var_name, metric2uid_vals in var2metric2uid_vals.items():
            for metric_name, uid_vals in metric2uid_vals.items():
                data_src2var2metric2val[data_source][var_name][metric_name] = np.mean(uid_vals)
    return data_src2var2metric2val


def verl_val_metrics(data_sources, sample_uids, reward_extra_infos_dict):
    data_src2var2metric2val = verl_process_validation_metrics(data_sources, sample_uids, reward_extra_infos_dict)
    metric_dict = {}
    for data_source, var2metric2val in data_src2var2metric2val.items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var_name, metric2val in var2metric2val.items():
            n_max = max([int(name.split("@")[-1].split("/")[0]) for name in metric2val.keys()])
            for metric_name, metric_val in metric2val.items():
                if ((var_name == core_var) and any(metric_name.startswith(pfx) for pfx in ["mean", "maj", "best"])
                        and (f"@{n_max}" in metric_name)):
                    metric_sec = "val-core"
                else:
                    metric_sec = "val-aux"
                metric_dict[f"{metric_sec}/{data_source}/{var_name}/{metric_name}"] = metric_val
    return metric_dict


# ---------------------------------------------------------------- inputs

def _samples(seed=0):
    """Two data sources, prompts of 1, 2, 3, 4, 5, 6, 8 and 16 samples (rows of different prompts
    interleaved: the uids, not the order, group them), scores of no short binary form (so any other
    summation order shows), a binary acc, a string extra, and preds from three answers (ties in
    most resamples of 2, 4 and 6)."""
    rs = np.random.RandomState(seed)
    layout = [("src/a", 4), ("src/b", 1), ("src/a", 8), ("src/b", 3), ("src/a", 2), ("src/b", 16), ("src/a", 5),
              ("src/b", 4), ("src/a", 6), ("src/a", 4)]
    rows = [(src, f"uid-{p}") for p, (src, n) in enumerate(layout) for _ in range(n)]
    rows = [rows[i] for i in rs.permutation(len(rows))]
    n = len(rows)
    return dict(sources=[r[0] for r in rows], uids=[r[1] for r in rows], reward=rs.randn(n).tolist(),
                acc=[bool(b) for b in rs.randint(0, 2, n)], note=[f"note {i}" for i in range(n)],
                pred=[["A", "B", "C"][k] for k in rs.randint(0, 3, n)])


def _assert_equal(got: dict, want: dict):
    assert got.keys() == want.keys(), set(got) ^ set(want)
    diff = {k: (got[k], want[k]) for k in want if not got[k] == want[k]}
    assert not diff, diff


def test_equals_verl_with_acc_pred_and_a_string_extra():
    """Bit for bit verl's numbers: the same bootstrap draws, the same per-prompt reductions and
    averages, `acc` the core variable; verl's bool acc is meshppo's float, and verl's string extra
    (skipped there) is not a variable here."""
    d = _samples()
    want = verl_val_metrics(d["sources"], d["uids"], {"reward": d["reward"], "acc": d["acc"], "note": d["note"],
                                                      "pred": d["pred"]})
    got = validation_metrics(d["sources"], d["uids"], {"reward": d["reward"], "acc": [float(a) for a in d["acc"]]},
                             d["pred"])
    _assert_equal(got, want)
    assert {k for k in got if k.startswith("val-core/src/a/")} == {
        "val-core/src/a/acc/mean@8", "val-core/src/a/acc/best@8/mean", "val-core/src/a/acc/best@8/std",
        "val-core/src/a/acc/maj@8/mean", "val-core/src/a/acc/maj@8/std"}
    assert "val-aux/src/b/reward/mean@1" in got and "val-aux/src/a/reward/maj@4/std" in got
    assert not any("/note/" in k or "/pred/" in k for k in got)


def test_equals_verl_without_pred_and_with_a_numeric_pred():
    """Without a pred no maj metrics and `reward` the core; a numeric pred (verl's ints, meshppo's
    floats) is a variable as well as the vote."""
    d = _samples(1)
    _assert_equal(validation_metrics(d["sources"], d["uids"], {"reward": d["reward"]}),
                  verl_val_metrics(d["sources"], d["uids"], {"reward": d["reward"]}))
    ints = [len(p) + "ABC".index(p) % 2 for p in d["pred"]]  # two answers: 1 and 2
    got = validation_metrics(d["sources"], d["uids"], {"reward": d["reward"], "pred": [float(i) for i in ints]},
                             [float(i) for i in ints])
    _assert_equal(got, verl_val_metrics(d["sources"], d["uids"], {"reward": d["reward"], "pred": ints}))
    assert "val-core/src/b/reward/maj@16/mean" in got and "val-aux/src/b/pred/mean@16" in got


def test_votes_group_equal_preds_of_any_type():
    """1, 1.0 and True are one answer as in verl's dict, "1" another; a list pred (which verl's dict
    cannot hold) votes as its JSON text would; with each prompt's first pred a string, verl skips
    pred as a variable."""
    d = _samples(2)
    rs = np.random.RandomState(3)
    choices = [1, 1.0, True, "1", 2]
    firsts = set()
    mixed = []
    for uid in d["uids"]:
        mixed.append("x" if uid not in firsts else choices[rs.randint(len(choices))])
        firsts.add(uid)
    variables = {"reward": d["reward"]}
    _assert_equal(validation_metrics(d["sources"], d["uids"], variables, mixed),
                  verl_val_metrics(d["sources"], d["uids"], {**variables, "pred": mixed}))
    lists = [[k, {"a": [k % 2]}] for k in rs.randint(0, 3, len(d["uids"])).tolist()]
    _assert_equal(validation_metrics(d["sources"], d["uids"], variables, lists),
                  verl_val_metrics(d["sources"], d["uids"], {**variables, "pred": [json.dumps(p) for p in lists]}))


def test_samples_without_a_value_are_left_out_of_that_variable():
    """NaN (a sample without the key; verl's None) leaves the sample out of that variable only: the
    metrics are verl's over the samples that have it (a prompt with none has none); `src/b` has no
    acc at all, so its core variable is `reward`; a prompt with a sample lacking the pred or the
    value has no maj for that variable, and the maj average is over the prompts that have it."""
    d = _samples(4)
    rs = np.random.RandomState(5)
    acc = [None if src == "src/b" or rs.rand() < 0.3 else float(a) for src, a in zip(d["sources"], d["acc"])]
    pred = [None if rs.rand() < 0.05 else p for p in d["pred"]]
    got = validation_metrics(d["sources"], d["uids"],
                             {"reward": d["reward"], "acc": [math.nan if a is None else a for a in acc]}, pred)
    want = verl_val_metrics(d["sources"], d["uids"], {"reward": d["reward"], "acc": acc, "pred": pred})
    _assert_equal(got, want)
    assert any(k.startswith("val-core/src/a/acc/") for k in got)
    assert any(k.startswith("val-core/src/b/reward/") for k in got) and not any("src/b/acc" in k for k in got)
    assert "val-aux/src/a/reward/maj@2/mean" in got  # some prompts keep their maj


def _two_prompts(preds, acc=None):
    """`process_validation_metrics` of source "s": prompt 0 (values 1, 0, 0, 0.5) and prompt 1
    (1, 1, 0, 0), `preds` theirs; with `acc` a variable of its own."""
    reward = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0]
    variables = {"reward": reward} if acc is None else {"reward": reward, "acc": acc}
    return process_validation_metrics(["s"] * 8, [0] * 4 + [1] * 4, variables, preds)["s"]


def test_a_prompt_with_a_missing_pred_has_no_maj():
    """Prompt 1 lacks one pred: its mean and best still count (mean@4 = (0.375 + 0.5) / 2), its
    maj does not (verl's `has_pred`), so `maj@n` is prompt 0's alone: for n = 2 the first draw's
    value (preds x, y, y, z: every resample of 2 is a tie or a pair), E = 1.5 / 4 over the 16 draws."""
    m = _two_prompts(["x", "y", "y", "z", "5", None, "2", "2"])["reward"]
    alone = process_validation_metrics(["s"] * 4, [0] * 4, {"reward": [1.0, 0.0, 0.0, 0.5]},
                                       ["x", "y", "y", "z"])["s"]["reward"]
    assert m["mean@4"] == pytest.approx(0.4375, abs=1e-12)
    for n in (2, 4):
        assert m[f"maj@{n}/mean"] == pytest.approx(alone[f"maj@{n}/mean"], abs=1e-12)
        assert m[f"maj@{n}/std"] == pytest.approx(alone[f"maj@{n}/std"], abs=1e-12)
    outcomes = [verl_calc_maj_val([{"v": [1.0, 0.0, 0.0, 0.5][i], "p": "xyyz"[i]} for i in d], "p", "v")
                for d in itertools.product(range(4), repeat=2)]
    assert sum(outcomes) / 16 == pytest.approx(0.375, abs=1e-12)
    _assert_bootstrap_estimates(m, "maj@2", outcomes)


def test_a_missing_value_drops_that_prompts_maj_for_that_variable_only():
    """Prompt 1 lacks acc on one sample: its acc metrics are over 3 values with no maj (verl: the
    values left are fewer than the preds), so acc's `maj@4` is prompt 0's alone while reward's,
    whose values are all there, is the mean of both prompts' own."""
    preds = ["x", "y", "y", "z", "5", "5", "2", "2"]
    got = _two_prompts(preds, acc=[1.0, 0.0, 0.0, 0.5, 1.0, math.nan, 0.0, 0.0])
    first, second = (process_validation_metrics(["s"] * 4, [0] * 4, {"v": vals}, preds[rows])["s"]["v"]
                     for vals, rows in (([1.0, 0.0, 0.0, 0.5], slice(4)), ([1.0, 1.0, 0.0, 0.0], slice(4, 8))))
    acc = got["acc"]
    assert acc["mean@4"] == pytest.approx(0.375, abs=1e-12) and acc["mean@3"] == pytest.approx(1 / 3, abs=1e-12)
    assert not any(k.startswith("maj@3") for k in acc)
    assert acc["maj@4/mean"] == pytest.approx(first["maj@4/mean"], abs=1e-12)
    assert got["reward"]["maj@4/mean"] == pytest.approx((first["maj@4/mean"] + second["maj@4/mean"]) / 2, abs=1e-12)


def test_no_maj_keys_where_no_prompt_has_every_pred():
    """Each prompt lacks a pred (None, or NaN for a numeric one): no maj metric at all, the keys
    those of no pred column, as verl's."""
    preds = [None, "3", "3", "7", "5", math.nan, "2", "2"]
    got = validation_metrics(["s"] * 8, [0] * 4 + [1] * 4, {"reward": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]}, preds)
    assert set(got) == set(validation_metrics(["s"] * 8, [0] * 4 + [1] * 4,
                                              {"reward": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]}))
    assert not any("maj@" in k for k in got) and len(got) == 2 + 2 * 4
    verl = verl_val_metrics(["s"] * 8, [0] * 4 + [1] * 4, {"reward": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0],
                                                           "pred": [None, "3", "3", "7", "5", None, "2", "2"]})
    assert set(got) == set(verl)


def test_bootstrap_draw_is_verls_and_leaves_the_global_generator_alone():
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    idx = bootstrap_indices(5, 4)
    assert (np.random.get_state()[1] == before).all()
    np.random.seed(42)
    assert (idx == np.random.choice(5, size=(1000, 4), replace=True)).all()
    assert gen_ns(1) == [] and gen_ns(2) == [2] and gen_ns(5) == [2, 4, 5] and gen_ns(8) == [2, 4, 8]


# ---------------------------------------------------------------- by hand

def _assert_bootstrap_estimates(m: dict, name: str, outcomes: list[float]):
    """`name/mean` and `name/std`, estimated from 1000 resamples, against the exact distribution
    of the equally likely `outcomes`: each within 5 standard errors (the std's from the fourth
    central moment)."""
    k = len(outcomes)
    mean = sum(outcomes) / k
    var = sum((o - mean) ** 2 for o in outcomes) / k
    mu4 = sum((o - mean) ** 4 for o in outcomes) / k
    sd = math.sqrt(var)
    assert abs(m[f"{name}/mean"] - mean) < 5 * sd / math.sqrt(1000), (name, m[f"{name}/mean"], mean)
    assert abs(m[f"{name}/std"] - sd) < 5 * math.sqrt(mu4 - var ** 2) / (2 * sd * math.sqrt(1000)), (name, sd)


def test_hand_computed_values():
    """One prompt of 4 values: mean@4 and std@4 exactly; best@n, worst@n and maj@n against the
    exact distributions over the 4^n equally likely ordered draws with replacement. For best@n
    P(max <= v_(k)) = (k/4)^n gives the expectation in closed form; for maj, preds x, y, y, z on
    values 1, 0, 0, 0.5, a tie goes to the pred drawn first, so maj@2 is the first draw's value:
    E = (1 + 0 + 0 + 0.5) / 4."""
    vals = [0.1, 0.9, 0.2, 0.7]
    m = process_validation_metrics(["s"] * 4, [0] * 4, {"reward": vals})["s"]["reward"]
    assert m["mean@4"] == pytest.approx(0.475, abs=1e-12)
    assert m["std@4"] == pytest.approx(math.sqrt((0.375 ** 2 + 0.425 ** 2 + 0.275 ** 2 + 0.225 ** 2) / 4), abs=1e-12)
    srt = sorted(vals)
    for n in (2, 4):
        draws = list(itertools.product(vals, repeat=n))
        assert sum(max(d) for d in draws) / 4 ** n == pytest.approx(
            sum(v * (((k + 1) / 4) ** n - (k / 4) ** n) for k, v in enumerate(srt)), abs=1e-12)
        _assert_bootstrap_estimates(m, f"best@{n}", [max(d) for d in draws])
        _assert_bootstrap_estimates(m, f"worst@{n}", [min(d) for d in draws])

    vals, preds = [1.0, 0.0, 0.0, 0.5], ["x", "y", "y", "z"]
    m = process_validation_metrics(["s"] * 4, [0] * 4, {"reward": vals}, preds)["s"]["reward"]
    for n in (2, 4):
        outcomes = [verl_calc_maj_val([{"v": vals[i], "p": preds[i]} for i in d], "p", "v")
                    for d in itertools.product(range(4), repeat=n)]
        if n == 2:
            assert sum(outcomes) / 16 == pytest.approx(0.375, abs=1e-12)
        _assert_bootstrap_estimates(m, f"maj@{n}", outcomes)


def test_one_sample_per_prompt_is_the_mean_only():
    got = validation_metrics(["s", "s", "t"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5]}, ["a", "b", "c"])
    assert got == {"val-core/s/reward/mean@1": 0.5, "val-core/t/reward/mean@1": 0.5}


def test_rows_must_align():
    with pytest.raises(ValueError, match="one value per sample"):
        validation_metrics(["s", "s"], [0, 0], {"reward": [1.0]})


def test_256_prompts_of_8_samples_reduce_in_one_vectorised_pass(monkeypatch):
    """256 prompts x 8 samples in 2 data sources, three variables and a pred: the cost does not grow
    with a loop per prompt. Counted, not timed: the reduction (`_prompt_metrics`) runs once per
    (data source, variable) over all of its prompts, each bootstrap draw is made once per (N, n)
    and each majority vote once per (data source, n), shared by the variables."""
    calls = {"_prompt_metrics": 0, "bootstrap_indices": 0, "_majority_choice": 0}
    for name in calls:
        monkeypatch.setattr(val_metrics, name, _counted(getattr(val_metrics, name), calls, name))
    rs = np.random.RandomState(0)
    n = 256 * 8
    acc = rs.randint(0, 2, n).astype(float)
    got = validation_metrics(["a"] * (n // 2) + ["b"] * (n // 2), [i // 8 for i in range(n)],
                             {"reward": (acc + rs.rand(n) * 0.1).tolist(), "acc": acc.tolist(),
                              "length": rs.rand(n).tolist()},
                             [str(k) for k in rs.randint(0, 4, n)])
    assert len(got) == 2 * 3 * (2 + 3 * 6)  # sources x variables x (mean, std, then n = 2, 4, 8 x 6)
    assert calls == {"_prompt_metrics": 2 * 3, "bootstrap_indices": 3, "_majority_choice": 2 * 3}


def _counted(fn, calls, name):
    """`fn`, counting its calls in `calls[name]`."""
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper
