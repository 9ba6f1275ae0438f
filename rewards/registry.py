"""Choosing and calling reward functions.

All reward functions have verl's signature and are called, as verl calls them, by keyword::

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | bool | dict

so a user's function may take its parameters in any order, or as `**kwargs`. A dict result carries the score under `"score"`; its other numeric entries become extra
metrics, and every other entry (a predicted answer, a parse) goes to the sample dumps as
returned. `default_compute_score` dispatches the built-in data sources; a user's own
function is loaded from a Python file or module with `load_custom_reward_fn` (verl's
`custom_reward_function.path` / `.name` / `.reward_kwargs`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rewards import demo, gsm8k

RewardFn = Callable[..., Any]

REWARD_FN_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")  # the keywords a reward function gets


class RewardError(RuntimeError):
    """A reward function is missing, cannot be loaded, fails, or returns an unusable value."""


def _gsm8k_strict(solution_str: str, ground_truth: str) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


_SCORERS: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": _gsm8k_strict,
    "meshppo/demo_add": demo.compute_score,
}
BUILTIN_DATA_SOURCES = tuple(sorted(_SCORERS))  # the data sources default_compute_score scores


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """The built-in rule-based score for `data_source`.

    Raises `RewardError` for a data source without a built-in scorer.
    """
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise RewardError(
            f"no built-in reward for data_source {data_source!r} (built-in: {sorted(_SCORERS)}); "
            "set custom_reward_function.path to a Python file defining "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        )
    return scorer(solution_str, ground_truth)


PKG_PREFIX, FILE_PREFIX = "pkg://", "file://"  # verl's `load_module` path forms


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score",
                          reward_kwargs: dict[str, Any] | None = None) -> RewardFn:
    """Load function `name` from `path`, as verl's `load_extern_object` reads it: a Python file
    (`/abs/x.py`, `rel/x.py` or `file:///abs/x.py`) or an importable module (`pkg://package.module`,
    slashes allowed). `reward_kwargs` are added to every call and win over the call's own
    keywords, as verl's `_call_with_kwargs` merges them.

    A file is executed as a fresh module each call. Raises `RewardError` naming the path and
    function when the file is missing, the file or module fails to import, or it lacks a
    callable `name`.
    """
    path = os.fspath(path)
    if path.startswith(PKG_PREFIX):
        module_name = path[len(PKG_PREFIX):].replace("/", ".")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:
            raise RewardError(f"custom reward module {module_name} ({path}) cannot be imported{_where(err, None)}: "
                              f"{type(err).__name__}: {err}") from err
        where = f"custom reward module {path}"
    else:
        module = _exec_file(path[len(FILE_PREFIX):] if path.startswith(FILE_PREFIX) else path, name)
        where = f"custom reward file {path}"
    if not hasattr(module, name):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"{where} has no function {name!r} (it defines: {available})")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"{name!r} in {where} is a {type(fn).__name__}, not a function")
    reward_kwargs = dict(reward_kwargs or {})
    _check_signature(fn, f"{name!r} in {where}", reward_kwargs)
    if not reward_kwargs:
        return fn

    @functools.wraps(fn)
    def with_kwargs(**kwargs):
        return fn(**{**kwargs, **reward_kwargs})

    return with_kwargs


def _exec_file(path: str, name: str):
    """The Python file at `path` executed as a fresh module."""
    if not os.path.isfile(path):
        raise RewardError(f"custom reward file not found: {path} (looking for function {name!r})")
    # A module name derived from the path keeps two reward files with the same basename apart.
    module_name = f"meshppo_custom_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"cannot import {path} as a Python module (looking for function {name!r})")
    module = importlib.util.module_from_spec(spec)
    # Registered before execution so that dataclasses and pickling inside the file work.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise RewardError(f"importing custom reward file {path} failed{_where(err, path)}: "
                          f"{type(err).__name__}: {err}") from err
    return module


def _check_signature(fn: RewardFn, what: str, reward_kwargs: dict[str, Any]) -> None:
    """Raise `RewardError` unless `fn` accepts the keywords `REWARD_FN_ARGS` and `reward_kwargs` (a
    callable whose signature Python cannot read is taken on trust)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    keywords = [*REWARD_FN_ARGS, *(k for k in reward_kwargs if k not in REWARD_FN_ARGS)]
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        raise RewardError(f"{what} cannot be called as a reward function: it is called by keyword, "
                          f"fn({', '.join(f'{a}=...' for a in keywords)}), as verl calls it, "
                          f"and its signature {signature} does not accept that ({err})") from None


def get_reward_fn(custom_path: str | os.PathLike | None = None, custom_name: str = "compute_score",
                  reward_kwargs: dict[str, Any] | None = None) -> RewardFn:
    """The user's function (with `reward_kwargs`) when `custom_path` is set, else `default_compute_score`."""
    if custom_path:
        return load_custom_reward_fn(custom_path, custom_name, reward_kwargs)
    return default_compute_score


def _fn_name(fn: RewardFn) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    if module and not module.startswith("meshppo_custom_reward_"):
        return f"{module}.{qualname}"
    return qualname


def _where(err: BaseException, path: str | None) -> str:
    """` at FILE:LINE` of the deepest line of `path` in `err`'s traceback (the user's line even
    when the error is raised inside a library it calls); without one, of the deepest line."""
    if isinstance(err, SyntaxError) and err.filename and err.lineno:
        return f" at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    frame = (mine or frames or [None])[-1]
    return f" at {frame.filename}:{frame.lineno}" if frame else ""


def _as_float(value: Any) -> float | None:
    """A number, a bool, or a 0-d real tensor or array (verl stores whatever torch can assign to a reward slot)."""
    if isinstance(value, (bool, np.bool_, numbers.Real)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_complex:
        return float(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        return float(value.item())
    return None


# What verl's reward manager adds to every extra_info (naive.py): the agent loop's turn count, 2 for a
# single-turn generation (prompt, response), and the rollout's own reward scores, none here.
SINGLE_TURN_EXTRA_INFO = {"num_turns": 2, "rollout_reward_scores": {}}


def score_responses(
    fn: RewardFn,
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
) -> tuple[list[float], dict[str, list[float]], dict[str, list[Any]]]:
    """Score every response with `fn`.

    Each call's `extra_info` is a copy of the row's with `SINGLE_TURN_EXTRA_INFO` added, as verl's
    reward manager adds them. A score may be a number, a bool, a 0-d tensor or a dict with `score`.

    Returns `(scores, extras, other_extras)`, each aligned with the samples: one float per
    sample; for every extra key of a dict result that some sample gave a number for, the
    numbers (NaN where a sample gave none), which are metrics; and for every extra key that
    some sample gave anything else for (a string, a list, None...), every sample's value as
    returned (None where a sample did not return the key), which only the dumps write (verl's
    dumps carry every key of the result). A key of both kinds is in both.

    Raises `RewardError` when `fn` raises (chained from the original error) or returns
    something that is not a finite number, naming the function, sample index and data
    source.
    """
    n = len(solution_strs)
    if extra_infos is None:
        extra_infos = [None] * n
    lengths = {"data_sources": len(data_sources), "solution_strs": n,
               "ground_truths": len(ground_truths), "extra_infos": len(extra_infos)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"score_responses needs inputs of one length, got {lengths}")

    name = _fn_name(fn)
    code = getattr(inspect.unwrap(fn), "__code__", None)
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    returned: list[dict] = []  # each sample's dict result ({} for a plain score)
    other_keys: dict[str, None] = {}  # the keys some sample gave a non-number for, in the function's order
    for i in range(n):
        where = f"sample {i} (data_source={data_sources[i]!r})"
        try:
            # a copy (the dataset's dict is every epoch's), with a fresh rollout_reward_scores
            extra_info = {**(extra_infos[i] or {}), **SINGLE_TURN_EXTRA_INFO, "rollout_reward_scores": {}}
            result = fn(data_source=data_sources[i], solution_str=solution_strs[i], ground_truth=ground_truths[i],
                        extra_info=extra_info)
        except Exception as err:
            at = _where(err, code.co_filename if code else None)
            raise RewardError(f"reward function {name} raised on {where}{at}: {type(err).__name__}: {err}") from err
        sample_extras: dict[str, float] = {}
        returned.append(result if isinstance(result, dict) else {})
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(
                    f"reward function {name} returned a dict without a 'score' key on {where}: "
                    f"keys {sorted(result)}"
                )
            for key, value in result.items():
                if key == "score":
                    continue
                if (as_float := _as_float(value)) is not None:
                    sample_extras[key] = as_float
                else:
                    other_keys[key] = None
            result = result["score"]
        score = _as_float(result)
        if score is None:
            raise RewardError(
                f"reward function {name} returned {type(result).__name__} {result!r} on {where}; "
                "expected a number, a bool or a dict with a 'score' key"
            )
        if not math.isfinite(score):
            raise RewardError(f"reward function {name} returned non-finite score {score} on {where}")
        scores.append(score)
        for key in sample_extras:  # new keys in the order the function gave them (a set's order varies by process)
            if key not in extras:
                extras[key] = [math.nan] * i
        for key, values in extras.items():
            values.append(sample_extras.get(key, math.nan))
    return scores, extras, {key: [r.get(key) for r in returned] for key in other_keys}
