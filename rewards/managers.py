"""verl's reward managers (`reward_model.reward_manager`): how the reward function is called for a
batch of responses and how its results become scores.

Every manager is called with the rows' data sources, decoded responses, ground truths, extra infos
and response lengths (tokens, EOS included), and optionally `row_names`, how an error names each row
(`ResultCollector`; the trainer's say where the row is in the step's batch and the data), and returns
`score_responses`' `(scores, extras, other_extras)`; every result goes through `ResultCollector`'s
checks and error messages. `score` returns the function's own scores too, before the manager's
additions (DAPO's overlong penalty): what `algorithm.filter_groups.metric=score` reads, as verl's DAPO
trainer reads the result's `score`.

- `naive`: one call per response, by keyword (`score_responses`).
- `dapo`: naive's calls on the response without a trailing EOS string, with verl's dapo
  `extra_info` (no `num_turns`); a plain score is also the extra `acc`; with
  `overlong_buffer_cfg.enable` DAPO's overlong penalty is added to the score.
- `batch`: one call for all the rows, with lists, and `reward_model.reward_kwargs` as keywords.
- `gdpo`: naive's calls with the run's `experiment_name` in `extra_info` (no `num_turns`); a plain
  score is also the extra `acc`.
- `prime`: one call per response, positionally, in a pool of worker processes (`rewards.pool`)
  with verl's 300 s limit per call; a call that raises, times out or kills its worker scores 0.
"""

from __future__ import annotations

import abc
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rewards.pool import FnSpec, RewardPool
from rewards.registry import (REWARD_FN_ARGS, ResultCollector, RewardError, RewardFn, call_failure, check_lengths,
                              describe_fn, get_reward_fn, load_custom_reward_fn, named_rows, row_extra_info,
                              score_responses)

Scored = tuple[list[float], dict[str, list[float]], dict[str, list[Any]]]

BATCH_FN_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")  # the batch manager's keywords


class RewardManager(abc.ABC):
    """Scores a batch of rows with `compute_score`; `close` releases what the manager holds (prime's processes)."""

    def __init__(self, compute_score: RewardFn):
        self.compute_score = compute_score

    def __call__(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                 extra_infos: Sequence[dict | None], response_lengths: Sequence[int],
                 row_names: Sequence[str] | None = None) -> Scored:
        """`(scores, extras, other_extras)` of the rows (see the module's docstring)."""
        return self.score(data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names)[:3]

    @abc.abstractmethod
    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict | None], response_lengths: Sequence[int],
              row_names: Sequence[str] | None = None) -> tuple[Any, Any, Any, list[float]]:
        """`(scores, extras, other_extras, function_scores)`: `__call__`'s, and the scores as the
        function returned them (the same list where the manager adds nothing)."""

    def close(self) -> None:
        """Nothing to release, unless a manager holds something."""


class NaiveRewardManager(RewardManager):
    """verl's `naive`: `score_responses`; a plain score is also the extra `acc`, as verl's reward
    loop (its default since `reward_model.use_reward_loop`) records it."""

    def score(self, data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names=None):
        scored = score_responses(self.compute_score, data_sources, solution_strs, ground_truths, extra_infos,
                                 plain_key="acc", row_names=row_names)
        return (*scored, scored[0])


class GDPORewardManager(RewardManager):
    """verl's `gdpo` (its gdpo recipe's `reward.reward_manager.name=gdpo`): naive's calls, with the
    run's `trainer.experiment_name` in each call's `extra_info` and no `num_turns`, as verl's gdpo
    manager calls the function; a plain score is also the extra `acc`."""

    def __init__(self, compute_score: RewardFn, experiment_name: str | None):
        super().__init__(compute_score)
        self.experiment_name = experiment_name

    def score(self, data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names=None):
        named = [{**(e or {}), "experiment_name": self.experiment_name} for e in extra_infos]
        scored = score_responses(self.compute_score, data_sources, solution_strs, ground_truths, named,
                                 num_turns=False, plain_key="acc", row_names=row_names)
        return (*scored, scored[0])


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens, verl's formula: 0 up to
    `max_resp_len - buffer_len` tokens, then falling linearly to `-penalty_factor` at `max_resp_len`
    (and on, unclamped, beyond it)."""
    exceed = length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


class DAPORewardManager(RewardManager):
    """verl's `dapo`: a trailing `eos_token` string is cut from each response (verl's manager does;
    the decoding already drops a special EOS), each call's `extra_info` has no `num_turns`, a plain
    score is also recorded as the extra `acc`, and with `overlong_buffer_cfg.enable` (an object with
    verl's `enable`, `len`, `penalty_factor` and `log`) each score gets `overlong_penalty`, logged
    as the extras `overlong_reward` and `overlong` (the penalty is below 0) with `log`."""

    def __init__(self, compute_score: RewardFn, eos_token: str | None, max_resp_len: int | None = None,
                 overlong_buffer_cfg: Any = None):
        super().__init__(compute_score)
        self.eos_token, self.max_resp_len = eos_token, max_resp_len
        self.buffer = overlong_buffer_cfg if overlong_buffer_cfg is not None and overlong_buffer_cfg.enable else None

    def score(self, data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names=None):
        check_lengths(solution_strs=solution_strs, response_lengths=response_lengths)
        eos = self.eos_token
        texts = [s[:-len(eos)] if eos and s.endswith(eos) else s for s in solution_strs]
        scores, extras, others = score_responses(self.compute_score, data_sources, texts, ground_truths, extra_infos,
                                                 num_turns=False, plain_key="acc", row_names=row_names)
        b = self.buffer
        if b is None:
            return scores, extras, others, scores
        penalties = [overlong_penalty(n, self.max_resp_len, b.len, b.penalty_factor) for n in response_lengths]
        penalized = [s + p for s, p in zip(scores, penalties)]
        if b.log:
            extras["overlong_reward"] = penalties
            extras["overlong"] = [float(p < 0) for p in penalties]
        return penalized, extras, others, scores


def _length(results: Any) -> int | None:
    """The number of results in a batch function's return; None for something that is not a sequence of them."""
    if isinstance(results, (str, bytes, dict)):
        return None
    try:
        return len(results)
    except TypeError:  # no length, or a 0-d tensor or array
        return None


def _object_array(values: Sequence) -> np.ndarray:
    """`values` as a 1-d NumPy object array (verl's non-tensor batch columns), whatever the items are."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


class BatchRewardManager(RewardManager):
    """verl's `batch`: one call for all the rows, as verl's manager makes it,

        compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs)

    with the data sources and extra infos as NumPy object arrays (verl's batch columns; each extra
    info a copy with `rollout_reward_scores`), the responses and ground truths as lists. It returns
    one score or dict per row (a list, tuple, array or 1-d tensor), each read as naive reads a result."""

    def __init__(self, compute_score: RewardFn, reward_kwargs: dict[str, Any] | None = None):
        super().__init__(compute_score)
        self.reward_kwargs = dict(reward_kwargs or {})

    def score(self, data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names=None):
        n = check_lengths(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                          extra_infos=extra_infos, **named_rows(row_names))
        name, path = describe_fn(self.compute_score)
        try:
            results = self.compute_score(
                data_sources=_object_array(data_sources), solution_strs=list(solution_strs),
                ground_truths=list(ground_truths),
                extra_infos=_object_array([row_extra_info(e, num_turns=False) for e in extra_infos]),
                **self.reward_kwargs)
        except Exception as err:
            raise RewardError(call_failure(name, f"the batch of {n} responses", err, path)) from err
        count = _length(results)
        if count != n:
            got = f"{type(results).__name__} {results!r:.200}" if count is None else f"{count} results"
            raise RewardError(f"reward function {name} returned {got} for a batch of {n} responses; expected a list of "
                              f"{n} scores or dicts with a 'score' key, one per response")
        collected = ResultCollector(name, data_sources, row_names=row_names)
        for i in range(n):
            collected.add(results[i])
        scored = collected.done()
        return (*scored, scored[0])


PRIME_TIMEOUT_S = 300.0  # verl's prime manager's limit on one call
PRIME_PROCESSES = 64  # verl's prime manager's pool size


class PrimeRewardManager(RewardManager):
    """verl's `prime`: each response scored by `fn(data_source, solution_str, ground_truth, extra_info)`,
    called positionally with the row's own `extra_info` (verl adds nothing), in a `RewardPool` of
    worker processes that load the function of `spec` themselves.

    As in verl, a call that raises, runs past `timeout_s` or kills its worker scores 0, and each
    batch says so (`warn`: one line naming how many calls failed, and the first failure); a tuple
    or list result is scored by its first item. Any other result is read as naive reads it (verl
    scores the whole batch 0 when one result is a dict). Unlike verl, the limit counts from a
    call's start in its worker, not from the batch's start (verl's counts the wait for a free
    worker too), and a crash costs only its own call (verl's process pool breaks: every call
    still waiting scores 0)."""

    def __init__(self, spec: FnSpec, processes: int = PRIME_PROCESSES, timeout_s: float = PRIME_TIMEOUT_S,
                 warn: Callable[[str], None] | None = None, start_timeout_s: float = 300.0):
        # loaded here too: the file's errors and signature are checked before any worker starts
        super().__init__(get_reward_fn(spec.path, spec.name, spec.reward_kwargs, args=REWARD_FN_ARGS, keywords=()))
        self.pool = RewardPool(spec, processes, timeout_s, start_timeout_s)
        self.warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))

    def score(self, data_sources, solution_strs, ground_truths, extra_infos, response_lengths, row_names=None):
        n = check_lengths(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                          extra_infos=extra_infos, **named_rows(row_names))
        name, _ = describe_fn(self.compute_score)
        collected = ResultCollector(name, data_sources, row_names=row_names)
        calls = [(collected.where(i), (data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i]))
                 for i in range(n)]
        failed: list[str] = []
        for i, outcome in enumerate(self.pool.map(calls)):
            if outcome.kind == "ok":
                result = outcome.value
                collected.add(result[0] if isinstance(result, (tuple, list)) and result else result)
                continue
            if outcome.kind == "raised":
                failed.append(outcome.value)
            elif outcome.kind == "timeout":
                failed.append(f"reward function {name} timed out after {self.pool.timeout_s:g} s on {calls[i][0]}")
            else:
                failed.append(f"reward function {name} killed its worker process (exit code {outcome.value}) on "
                              f"{calls[i][0]}")
            collected.add(0.0)
        if failed:
            self.warn(f"reward_manager=prime: {len(failed)} of {n} calls failed and scored 0 (as verl's prime "
                      f"manager scores them); the first: {failed[0]}")
        scored = collected.done()
        return (*scored, scored[0])

    def close(self) -> None:
        """Stop the worker processes."""
        self.pool.close()


REWARD_MANAGERS = ("naive", "dapo", "batch", "prime", "gdpo")


def load_reward_manager(name: str, path: str | os.PathLike | None = None, fn_name: str = "compute_score",
                        fn_kwargs: dict[str, Any] | None = None, manager_kwargs: dict[str, Any] | None = None, *,
                        eos_token: str | None = None, processes: int = PRIME_PROCESSES,
                        warn: Callable[[str], None] | None = None, experiment_name: str | None = None) -> RewardManager:
    """The reward manager `name` around the function `fn_name` of `path` (the built-in
    `default_compute_score` without one) with its `fn_kwargs` (`custom_reward_function`), as verl's
    `load_reward_manager` builds it: `manager_kwargs` are `reward_model.reward_kwargs`, given to the
    manager (dapo: `max_resp_len`, `overlong_buffer_cfg`; batch: added to every call, the function's
    own `fn_kwargs` winning). `eos_token`: the tokenizer's (dapo); `processes` and `warn`: prime's
    pool size and failure report. Raises `RewardError` if the function cannot be loaded or
    cannot take the manager's call."""
    manager_kwargs = dict(manager_kwargs or {})
    if name == "naive":
        return NaiveRewardManager(get_reward_fn(path, fn_name, fn_kwargs))
    if name == "gdpo":
        return GDPORewardManager(get_reward_fn(path, fn_name, fn_kwargs), experiment_name)
    if name == "dapo":
        return DAPORewardManager(get_reward_fn(path, fn_name, fn_kwargs), eos_token, **manager_kwargs)
    if name == "batch":
        if not path:
            raise ValueError("the batch reward manager needs a reward function file or module (path)")
        fn = load_custom_reward_fn(path, fn_name, fn_kwargs, keywords=(*BATCH_FN_ARGS, *manager_kwargs))
        return BatchRewardManager(fn, manager_kwargs)
    if name == "prime":
        return PrimeRewardManager(FnSpec(os.fspath(path) if path else None, fn_name, dict(fn_kwargs or {})),
                                  processes, warn=warn)
    raise ValueError(f"unknown reward manager {name!r}; meshppo has {list(REWARD_MANAGERS)}")
