"""Validation metrics under verl's names and with verl's definitions
(`verl.trainer.ppo.metric_utils.process_validation_metrics` and `RayPPOTrainer._val_metrics_update`),
computed on the host with NumPy from every validation sample.

For each data source and each variable (`reward`, the score, and every numeric extra of the reward
function), per prompt over its N samples: `mean@N`, `std@N` (N > 1) and, for each n of `gen_ns(N)`
(2, 4, 8, ... below N, then N), the bootstrap estimates `best@n/mean`, `best@n/std`,
`worst@n/mean`, `worst@n/std` and, when the function returns a `pred`, `maj@n/mean`, `maj@n/std`:
1000 resamples of n of the prompt's samples, with replacement, each reduced to its largest value,
its smallest, or the value of its first sample whose `pred` is the most common one (ties: the
`pred` seen first in the resample); the mean and standard deviation over the resamples. Each
metric is then averaged over the data source's prompts that have it. A data source's core variable
is `acc` where it has one, else `reward`: its `mean`, `maj` and `best` metrics at its largest N in
the source are logged as `val-core/{data_source}/{var}/{metric}`, everything else as `val-aux/...`.

The numbers are verl's for the same samples, to the bit: verl reseeds NumPy's global generator with
42 before each (prompt, variable, n) bootstrap and draws `np.random.choice(N, size=(1000, n))`; a
local `np.random.RandomState(42)` draws the identical indices (the legacy global generator is such a
RandomState), so the global generator is never touched, and the draw, the same for every prompt of
N samples, is made once per (N, n). The reductions run on arrays of every prompt of N samples at once.

Where verl has nothing to say, meshppo decides:
- A sample with no value for a variable (NaN: the reward function did not return the key, or
  returned NaN) is left out of that variable, as the training metric `reward_extra/<key>/mean` leaves
  it out: the prompt's metrics for it are over the samples that gave one (`mean@k`, k of them), and
  a prompt none of whose samples gave one has none. (verl's reward managers append each key's values
  without gaps, so a key that some samples lack misaligns its list and fails `_validate`'s length
  assertion.)
- Only numeric extras are variables. verl skips a variable whose first value is a string and fails
  on one mixing numbers with other values; here a key's numbers are its values, the rest left out.
- `pred` values vote as Python's `==` groups them (1, 1.0 and True are one answer, as in verl's
  dict); lists and dicts vote by equality too (verl's dict could not hold them).

A prompt has `maj@n` metrics for a variable, as in verl, only where every one of its samples has a
`pred` (not None, nor NaN for a numeric one) and a value of the variable: a prompt with a sample
lacking either has the variable's other metrics but no `maj`, so the data source's `maj` average is
over the prompts that have it, and a variable none of whose prompts has it logs no `maj`.

One difference is the reward functions' own: verl's naive and dapo managers record a dict result's
`score` among its extras, so verl also logs a variable `score` (the score before the float32
rounding of `reward`); meshppo's extras (`rewards.registry`) leave `score` out, and so do these
metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42
_BLOCK = 1 << 22  # elements of the [prompts, resamples, N] arrays at once: bounds the memory (32 MiB each)


def gen_ns(n_resps: int) -> list[int]:
    """verl's subset sizes for N samples: 2, 4, 8, ... below N, then N; none for N <= 1."""
    if n_resps <= 1:
        return []
    ns, n = [], 2
    while n < n_resps:
        ns.append(n)
        n *= 2
    return ns + [n_resps]


def bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED) -> np.ndarray:
    """verl's `bootstrap_metric` draw, `[n_bootstrap, subset_size]` indices into `n_data` samples:
    `np.random.seed(seed); np.random.choice(...)`, drawn from a local RandomState of the same seed."""
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


_LIST, _TUPLE, _DICT, _OTHER = object(), object(), object(), object()  # tags no value carries


def _is_pred(pred: Any) -> bool:
    """Whether a sample has a `pred`: None, or NaN (a numeric column's gap), is none."""
    return pred is not None and not (isinstance(pred, float) and math.isnan(pred))


def _hashable(value: Any) -> Any:
    """`value` itself if hashable, else a hashable stand-in that equals another's where the values
    are equal (a list, tuple, dict or set, element by element; anything else by its repr)."""
    if _is_hashable(value):
        return value
    if isinstance(value, list):
        return (_LIST, tuple(_hashable(v) for v in value))
    if isinstance(value, tuple):
        return (_TUPLE, tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return (_DICT, frozenset((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, set):
        return frozenset(value)
    return (_OTHER, repr(value))


def _is_hashable(value: Any) -> bool:
    """Whether `hash(value)` works (a tuple holding a list is a `Hashable` that does not hash)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _row_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean and (population) standard deviation of each row of `x` `[G, K]`: the same floats as
    `np.mean` / `np.std` of the row alone, as NumPy sums a contiguous row pairwise either way (a
    strided one it sums in another order, hence the copy)."""
    x = np.ascontiguousarray(x)
    return np.mean(x, axis=1), np.std(x, axis=1)


def _vote_codes(rows: np.ndarray, preds: Sequence[Any]) -> np.ndarray:
    """`[G, N]` integer codes of the preds of `rows` `[G, N]`, per prompt: equal preds one code."""
    codes = np.empty(rows.shape, dtype=np.int64)
    for r, prompt_rows in enumerate(rows):
        table: dict = {}
        codes[r] = [table.setdefault(_hashable(preds[i]), len(table)) for i in prompt_rows]
    return codes


def _majority_choice(codes: np.ndarray) -> np.ndarray:
    """verl's `calc_maj_val` choice in each resample of `codes` `[G, B, n]` (the resampled samples'
    pred codes): the position of the first sample whose pred is one of the most common. That is
    verl's choice: its dict keeps the preds in the order first seen and `max` returns the first most
    common one, whose first sample comes before any other most common pred's; its value is the
    resample's `maj` value."""
    g, b, n = codes.shape
    k = int(codes.max()) + 1
    rows = np.arange(g * b).reshape(g, b, 1)
    counts = np.bincount((rows * k + codes).ravel(), minlength=g * b * k).reshape(g, b, k)
    at = np.take_along_axis(counts, codes, axis=2)  # each sample's pred's count in its resample
    return np.argmax(at == at.max(axis=2, keepdims=True), axis=2)


def _prompt_metrics(rows: np.ndarray, col: np.ndarray, preds: Sequence[Any] | None, n_bootstrap: int, seed: int,
                    draws: dict, votes: dict) -> list[dict[str, float]]:
    """verl's metrics of each prompt of `rows` `[G, N]` (G prompts of N samples, a row index each) for
    the variable `col` (every row's value), one dict per prompt; with `preds`, every row's pred, the
    maj metrics too. `draws` caches the bootstrap indices per (N, n) and `votes` the majority
    choices per (rows, n): variables of the same samples share them."""
    vals = col[rows]
    g, n_resps = vals.shape
    mean, std = _row_stats(vals)
    cols: dict[str, np.ndarray] = {f"mean@{n_resps}": mean}
    if n_resps > 1:
        cols[f"std@{n_resps}"] = std
        codes = None
        for n in gen_ns(n_resps):
            if (n_resps, n) not in draws:
                draws[n_resps, n] = bootstrap_indices(n_resps, n, n_bootstrap, seed)
            idx = draws[n_resps, n]
            sample = vals[:, idx]  # [G, B, n]
            stats = {"best": sample.max(axis=2), "worst": sample.min(axis=2)}
            if preds is not None:
                key = (rows.shape, rows.tobytes(), n)
                if key not in votes:
                    codes = _vote_codes(rows, preds) if codes is None else codes
                    votes[key] = _majority_choice(codes[:, idx])
                stats["maj"] = np.take_along_axis(sample, votes[key][..., None], axis=2)[..., 0]
            for name, x in stats.items():
                cols[f"{name}@{n}/mean"], cols[f"{name}@{n}/std"] = _row_stats(x)
    return [{name: float(col[i]) for name, col in cols.items()} for i in range(g)]


def _group_prompts(uid_rows: dict[Any, list[int]], col: np.ndarray, has_pred: list[bool] | None,
                   ) -> dict[tuple[int, bool], list[tuple[int, list[int]]]]:
    """The prompts (their position in `uid_rows` and rows with a value in `col`) that have a value,
    grouped by (how many values, whether they get `maj`): verl's rule, `maj` only where no sample's
    value was left out and every sample has a pred (`has_pred`, per row; None: no pred column)."""
    groups: dict[tuple[int, bool], list[tuple[int, list[int]]]] = {}
    for p, rows in enumerate(uid_rows.values()):
        kept = [i for i in rows if not math.isnan(col[i])]
        if kept:
            with_maj = has_pred is not None and len(kept) == len(rows) and all(has_pred[i] for i in rows)
            groups.setdefault((len(kept), with_maj), []).append((p, kept))
    return groups


def process_validation_metrics(data_sources: Sequence[str], uids: Sequence[Any], variables: dict[str, Sequence[float]],
                               preds: Sequence[Any] | None = None, *, n_bootstrap: int = N_BOOTSTRAP,
                               seed: int = SEED) -> dict[str, dict[str, dict[str, float]]]:
    """`{data_source: {variable: {metric: value}}}` of the samples: row i is a sample of prompt
    `uids[i]` from `data_sources[i]`, with `variables[var][i]` (NaN: none) and `preds[i]` (None
    without a `pred` column); the data sources, variables and metrics in verl's order."""
    n_rows = len(data_sources)
    if len(uids) != n_rows or any(len(v) != n_rows for v in variables.values()) or (
            preds is not None and len(preds) != n_rows):
        raise ValueError(f"validation metrics need one value per sample: {n_rows} data sources, {len(uids)} uids, "
                         f"{ {k: len(v) for k, v in variables.items()} } values"
                         + ("" if preds is None else f", {len(preds)} preds"))
    prompts: dict[Any, dict[Any, list[int]]] = {}  # data source -> uid -> rows, in order of appearance
    for i, (src, uid) in enumerate(zip(data_sources, uids)):
        prompts.setdefault(src, {}).setdefault(uid, []).append(i)
    columns = {k: np.asarray(v, dtype=np.float64) for k, v in variables.items()}
    has_pred = None if preds is None else [_is_pred(p) for p in preds]
    draws: dict = {}
    votes: dict = {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for src, uid_rows in prompts.items():
        for var, col in columns.items():
            per_prompt: list[dict[str, float] | None] = [None] * len(uid_rows)
            for (n_resps, with_maj), group in _group_prompts(uid_rows, col, has_pred).items():
                step = max(1, _BLOCK // (n_bootstrap * n_resps))  # prompts at a time: bounds the [G, B, N] arrays
                for s in range(0, len(group), step):
                    block = group[s:s + step]
                    rows = np.array([kept for _, kept in block])
                    for (p, _), metrics in zip(block, _prompt_metrics(rows, col, preds if with_maj else None,
                                                                      n_bootstrap, seed, draws, votes)):
                        per_prompt[p] = metrics
            gathered: dict[str, list[float]] = {}
            for metrics in per_prompt:
                for name, value in (metrics or {}).items():
                    gathered.setdefault(name, []).append(value)
            if gathered:
                out.setdefault(src, {})[var] = {name: float(np.mean(v)) for name, v in gathered.items()}
    return out


def validation_metrics(data_sources: Sequence[str], uids: Sequence[Any], variables: dict[str, Sequence[float]],
                       preds: Sequence[Any] | None = None, *, n_bootstrap: int = N_BOOTSTRAP,
                       seed: int = SEED) -> dict[str, float]:
    """`process_validation_metrics` under verl's logged names (`_val_metrics_update`):
    `val-core/{data_source}/{var}/{metric}` for the core variable's (`acc` where the data source
    has one, else `reward`) metrics that start with mean, maj or best at the source's largest N
    of that variable, `val-aux/...` for the others."""
    out = {}
    for src, var2metrics in process_validation_metrics(data_sources, uids, variables, preds,
                                                       n_bootstrap=n_bootstrap, seed=seed).items():
        core = "acc" if "acc" in var2metrics else "reward"
        for var, metrics in var2metrics.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                is_core = (var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name)
                out[f"{'val-core' if is_core else 'val-aux'}/{src}/{var}/{name}"] = value
    return out


__all__ = ["gen_ns", "bootstrap_indices", "process_validation_metrics", "validation_metrics"]
