"""Choosing and calling reward functions.

All reward functions have verl's signature and are called, as verl's naive reward manager calls
them, by keyword::

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | bool | dict

so a user's function may take its parameters in any order, or as `**kwargs` (the other reward
managers, `rewards.managers`, call it as their verl counterparts do). A dict result carries the
score under `"score"`; its other numeric entries become extra metrics, and every other entry (a
predicted answer, a parse) goes to the sample dumps as returned. `default_compute_score`
dispatches the built-in data sources; a user's own function is loaded from a Python file or
module with `load_custom_reward_fn` (verl's `custom_reward_function.path` / `.name` /
`.reward_kwargs`).

Nothing here imports torch: `rewards.pool`'s worker processes load this module.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
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
# The built-in scorers that compare the answer they extract with the ground truth as it is, as verl's do (gsm8k:
# `answer == ground_truth`): a ground truth that is not a string never matches. (demo_add compares with its str().)
_STRING_GROUND_TRUTH = frozenset({"openai/gsm8k"})


def builtin_ground_truth_problem(data_source: Any, ground_truth: Any) -> str | None:
    """Why the built-in scorer of `data_source` would never match `ground_truth` (the end of a sentence that
    begins with the field's name), or None. A number such as 72 scores at most the format score against the
    answer "72", in verl as here: the row is refused at load rather than scored so (verl's GSM8K data stores
    strings)."""
    if data_source not in _STRING_GROUND_TRUTH or isinstance(ground_truth, str):
        return None
    return (f"is {type(ground_truth).__name__} {ground_truth!r:.60}, not a string: the built-in {data_source!r} scorer "
            f"compares the answer it extracts (a string) with it unconverted, as verl's does, so it would never "
            f"match; store it as a string (e.g. {str(ground_truth)!r:.60}) or score with custom_reward_function.path")


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
                          reward_kwargs: dict[str, Any] | None = None, *, args: Sequence[str] = (),
                          keywords: Sequence[str] = REWARD_FN_ARGS) -> RewardFn:
    """Load function `name` from `path`, as verl's `load_extern_object` reads it: a Python file
    (`/abs/x.py`, `rel/x.py` or `file:///abs/x.py`) or an importable module (`pkg://package.module`,
    slashes allowed). `reward_kwargs` are added to every call and win over the call's own
    keywords, as verl's `_call_with_kwargs` merges them.

    A file is executed as a fresh module each call. Raises `RewardError` naming the path and
    function when the file is missing, the file or module fails to import, it lacks a callable
    `name`, or that cannot be called with the positional `args` and the `keywords` (the
    manager's call: by default naive's) plus `reward_kwargs`.
    """
    path = os.fspath(path)
    if path.startswith(PKG_PREFIX):
        module_name = path[len(PKG_PREFIX):].replace("/", ".")
        try:
            module = importlib.import_module(module_name)  # which takes a failed module out of sys.modules
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            raise RewardError(f"custom reward module {module_name} ({path}) cannot be imported{_where(err, None)}: "
                              f"{_import_error(err)}") from err
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
    _check_signature(fn, f"{name!r} in {where}", args, [*keywords, *(k for k in reward_kwargs if k not in keywords)])
    if reward_kwargs:
        plain = fn

        @functools.wraps(plain)
        def fn(*call_args, **kwargs):
            return plain(*call_args, **{**kwargs, **reward_kwargs})
    return _awaited(fn) if inspect.iscoroutinefunction(inspect.unwrap(fn)) else fn


def _awaited(fn: Callable[..., Any]) -> RewardFn:
    """An `async def` reward function as a plain one: a call runs the coroutine to its end on a
    fresh event loop. `score_responses` awaits a batch's calls together instead (`coroutine`), as
    verl's reward loop gathers them: a function that waits on a judge or a sandbox waits once per
    batch, not once per response."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    run.coroutine = fn
    return run


def _exec_file(path: str, name: str):
    """The Python file at `path` executed as a fresh module."""
    if not os.path.isfile(path):
        raise RewardError(f"custom reward file not found: {path} (looking for function {name!r})")
    # A module name derived from the path keeps two reward files with the same basename apart.
    # (hashlib, not hash(): a str's hash differs by process, and prime's workers load the file too,
    # so a class defined in it must have one module name to unpickle its results in the trainer)
    module_name = f"meshppo_custom_reward_{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"cannot import {path} as a Python module (looking for function {name!r})")
    module = importlib.util.module_from_spec(spec)
    # Registered before execution so that dataclasses and pickling inside the file work.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        sys.modules.pop(module_name, None)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise RewardError(f"importing custom reward file {path} failed{_where(err, path)}: "
                          f"{_import_error(err)}") from err
    return module


def _import_error(err: BaseException) -> str:
    """`err`, raised importing the user's reward code, for the end of its one-line `RewardError`. A `SystemExit`
    (argparse reading the command line at the file's top level exits so) is said to be one, not taken
    for the trainer refusing its own command line."""
    if isinstance(err, SystemExit):
        return (f"SystemExit: the code exits at import (exit status {err.code!r}), e.g. argparse parsing the "
                "command line at its top level; move that under `if __name__ == \"__main__\":`")
    return f"{type(err).__name__}: {err}"


def _check_signature(fn: RewardFn, what: str, args: Sequence[str], keywords: Sequence[str]) -> None:
    """Raise `RewardError` unless `fn` accepts the positional `args` and the `keywords` (a callable
    whose signature Python cannot read is taken on trust)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **dict.fromkeys(keywords))
    except TypeError as err:
        call = ", ".join([*args, *(f"{k}=..." for k in keywords)])
        raise RewardError(f"{what} cannot be called as a reward function: it is called "
                          f"{'' if args else 'by keyword, '}fn({call}), as verl calls it, "
                          f"and its signature {signature} does not accept that ({err})") from None


def get_reward_fn(custom_path: str | os.PathLike | None = None, custom_name: str = "compute_score",
                  reward_kwargs: dict[str, Any] | None = None, *, args: Sequence[str] = (),
                  keywords: Sequence[str] = REWARD_FN_ARGS) -> RewardFn:
    """The user's function (with `reward_kwargs`, checked against the call `args` / `keywords`) when
    `custom_path` is set, else `default_compute_score`."""
    if custom_path:
        return load_custom_reward_fn(custom_path, custom_name, reward_kwargs, args=args, keywords=keywords)
    return default_compute_score


def describe_fn(fn: RewardFn) -> tuple[str, str | None]:
    """`fn`'s name for messages (module-qualified unless it comes from a reward file) and the file
    its code is in (None where it has no Python code)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    name = f"{module}.{qualname}" if module and not module.startswith("meshppo_custom_reward_") else qualname
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return name, code.co_filename if code else None


def _where(err: BaseException, path: str | None) -> str:
    """` at FILE:LINE` of the deepest line of `path` in `err`'s traceback (the user's line even
    when the error is raised inside a library it calls); without one, of the deepest line."""
    if isinstance(err, SyntaxError) and err.filename and err.lineno:
        return f" at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    frame = (mine or frames or [None])[-1]
    return f" at {frame.filename}:{frame.lineno}" if frame else ""


def call_failure(name: str, where: str, err: BaseException, path: str | None) -> str:
    """What to say when reward function `name` (code in `path`) raised `err` on `where`: a sample, the batch."""
    return f"reward function {name} raised on {where}{_where(err, path)}: {type(err).__name__}: {err}"


def real_value(value: Any) -> float | None:
    """`value` as a float if it is a number, a bool, or a 0-d real tensor or array (verl stores
    whatever torch can assign to a reward slot), else None (the reward functions' results and the
    tools' rewards are read with it). A tensor or array can only come from a process that imported torch or numpy,
    so neither is imported here."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if isinstance(value, (bool, numbers.Real)) or (np is not None and isinstance(value, np.bool_)):
        return float(value)
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_complex:
        return float(value.item())
    if np is not None and isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        return float(value.item())
    return None


def row_extra_info(row: dict | None, num_turns: bool) -> dict:
    """A copy of a row's `extra_info` (the dataset's dict is every epoch's) with what verl's reward
    managers add: a fresh `rollout_reward_scores` (the rollout's own scores: none here) and, where
    `num_turns` (naive's), the agent loop's turn count, `tool_rewards` and `turn_scores`: the row's
    own when a multi-turn rollout put them there (`agent.loop`), else 2, [] and [] (a single-turn
    generation's, as verl 0.9.1's single-turn agent loop sets them and its naive manager passes them)."""
    row = row or {}
    turns = {"num_turns": row.get("num_turns", 2), "tool_rewards": list(row.get("tool_rewards", [])),
             "turn_scores": list(row.get("turn_scores", []))}
    return {**row, **(turns if num_turns else {}), "rollout_reward_scores": {}}


class ResultCollector:
    """The reward function's results, row by row, as `score_responses` returns them, each checked
    as it comes: a `RewardError` names the function, the row and its data source. `plain_key`:
    an extra that a plain (not dict) result's score is also recorded under (dapo's `acc`).
    `row_names`: how an error names each row (the trainer's: where the row is in the step's batch and
    the data, whichever share of the batch this process scores); without them, `sample i`, the row's
    position in the lists scored."""

    def __init__(self, name: str, data_sources: Sequence[str], plain_key: str | None = None,
                 row_names: Sequence[str] | None = None):
        self.name, self.data_sources, self.plain_key, self.row_names = name, data_sources, plain_key, row_names
        self.scores: list[float] = []
        self.extras: dict[str, list[float]] = {}
        self.returned: list[dict] = []  # each sample's dict result ({} for a plain score)
        self.other_keys: dict[str, None] = {}  # the keys some sample gave a non-number for, in the function's order

    def where(self, i: int) -> str:
        row = f"sample {i}" if self.row_names is None else self.row_names[i]
        return f"{row} (data_source={self.data_sources[i]!r})"

    def add(self, result: Any) -> None:
        """Record the next row's result: a number, a bool, a 0-d tensor or a dict with `score`."""
        i, name = len(self.scores), self.name
        where = self.where(i)
        sample_extras: dict[str, float] = {}
        self.returned.append(result if isinstance(result, dict) else {})
        plain = not isinstance(result, dict)
        if not plain:
            if "score" not in result:
                raise RewardError(f"reward function {name} returned a dict without a 'score' key on {where}: "
                                  f"keys {sorted(result)}")
            for key, value in result.items():
                if key == "score":
                    continue
                if (as_float := real_value(value)) is not None:
                    sample_extras[key] = as_float
                else:
                    self.other_keys[key] = None
            result = result["score"]
        score = real_value(result)
        if score is None:
            raise RewardError(f"reward function {name} returned {type(result).__name__} {result!r} on {where}; "
                              "expected a number, a bool or a dict with a 'score' key")
        if not math.isfinite(score):
            raise RewardError(f"reward function {name} returned non-finite score {score} on {where}")
        if plain and self.plain_key:
            sample_extras[self.plain_key] = score
        self.scores.append(score)
        for key in sample_extras:  # new keys in the order the function gave them (a set's order varies by process)
            if key not in self.extras:
                self.extras[key] = [math.nan] * i
        for key, values in self.extras.items():
            values.append(sample_extras.get(key, math.nan))

    def done(self) -> tuple[list[float], dict[str, list[float]], dict[str, list[Any]]]:
        """`(scores, extras, other_extras)`, as `score_responses` describes them."""
        return self.scores, self.extras, {key: [r.get(key) for r in self.returned] for key in self.other_keys}


def named_rows(row_names: Sequence[str] | None) -> dict[str, Sequence[str]]:
    """`row_names` as a column for `check_lengths`, where they are given."""
    return {} if row_names is None else {"row_names": row_names}


def check_lengths(**columns: Sequence) -> int:
    """The common length of the per-row `columns`; ValueError naming each length if they differ."""
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"reward scoring needs inputs of one length, got {lengths}")
    return next(iter(lengths.values()))


def score_responses(
    fn: RewardFn,
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    *,
    num_turns: bool = True,
    plain_key: str | None = None,
    row_names: Sequence[str] | None = None,
) -> tuple[list[float], dict[str, list[float]], dict[str, list[Any]]]:
    """Score every response with `fn`, one call each (verl's naive reward manager).

    Each call's `extra_info` is `row_extra_info` of the row's (with `num_turns` unless told not
    to: verl's dapo manager adds none). A score may be a number, a bool, a 0-d tensor or a dict
    with `score`.

    Returns `(scores, extras, other_extras)`, each aligned with the samples: one float per
    sample; for every extra key of a dict result that some sample gave a number for, the
    numbers (NaN where a sample gave none), which are metrics; and for every extra key that
    some sample gave anything else for (a string, a list, None...), every sample's value as
    returned (None where a sample did not return the key), which only the dumps write (verl's
    dumps carry every key of the result). A key of both kinds is in both. `plain_key` and
    `row_names`: see `ResultCollector`.

    Raises `RewardError` when `fn` raises (chained from the original error) or returns
    something that is not a finite number, naming the function, the row (`row_names`' name, or
    its index) and its data source.
    """
    n = len(solution_strs)
    if extra_infos is None:
        extra_infos = [None] * n
    check_lengths(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                  extra_infos=extra_infos, **named_rows(row_names))
    name, path = describe_fn(fn)
    results = ResultCollector(name, data_sources, plain_key, row_names)
    calls = [dict(data_source=data_sources[i], solution_str=solution_strs[i], ground_truth=ground_truths[i],
                  extra_info=row_extra_info(extra_infos[i], num_turns)) for i in range(n)]
    coroutine = getattr(fn, "coroutine", None)
    if coroutine is not None:  # an async function: every call awaited together, results in order
        async def every_call():
            return await asyncio.gather(*(coroutine(**call) for call in calls), return_exceptions=True)
        outcomes = asyncio.run(every_call())
    for i, call in enumerate(calls):
        try:
            if coroutine is None:
                result = fn(**call)
            elif isinstance(outcomes[i], BaseException):
                raise outcomes[i]
            else:
                result = outcomes[i]
        except Exception as err:
            raise RewardError(call_failure(name, results.where(i), err, path)) from err
        results.add(result)
    return results.done()
