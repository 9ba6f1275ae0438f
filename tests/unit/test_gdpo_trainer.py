"""gdpo in the trainer (`PPOTrainer._compute_advantages`): each row's reward components are the reward
function's numbers under `algorithm.gdpo_reward_keys` (its dict result's entries, as verl reads them from
the reward extras; a plain score is naive's `acc`), passed to the estimator with
`algorithm.gdpo_reward_weights`; the advantages are checked against ppo.core_algos' gdpo run in float64 on
the components written out here, on the step's path and filter_groups' (`_filtered_rollouts`), with
verl's `gdpo/{key}/{mean,std,max,min}` metrics. A row without a number under a key (missing, not a
number, NaN) is refused naming the key, the row (`reward_row_names`) and the reward function: verl's
estimator fails on a missing key too (and turns a NaN into NaN advantages for the whole batch)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ppo.core_algos import compute_gdpo_outcome_advantage
from rewards import NaiveRewardManager
from tests.unit.test_dumps import DigitTokenizer, rows_of
from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.errors import UserError
from trainer.ppo_trainer import PPOTrainer, reward_row_names
from trainer.tracking import Timer

# row i's (format_reward, accuracy_reward): groups of 3, 3 and 2 responses; ties within a group, and an
# accuracy of a wider spread than the format's (normalised apart, neither drowns the other)
COMPONENTS = [(1.0, 0.0), (0.0, 10.0), (1.0, 4.0), (1.0, 3.0), (0.0, 3.0), (0.5, 7.0), (1.0, -2.0), (1.0, 5.0)]
UIDS = [0, 0, 0, 1, 1, 1, 2, 2]
LENGTHS = [3, 1, 4, 2, 5, 3, 1, 2]
KEYS = ["format_reward", "accuracy_reward"]
WEIGHTS = [1.0, 0.5]
ITEMS = [{"where": f"data/train.jsonl:{u + 1}"} for u in range(3)]
GDPO = ["algorithm.adv_estimator=gdpo", f"algorithm.gdpo_reward_keys=[{','.join(KEYS)}]",
        f"algorithm.gdpo_reward_weights=[{','.join(map(str, WEIGHTS))}]"]


def _components(data_source, solution_str, ground_truth, extra_info=None):
    fmt, acc = COMPONENTS[int(solution_str)]  # (row i's response decodes to "i")
    return {"score": fmt + acc, "format_reward": fmt, "accuracy_reward": acc, "judge": "ok"}


def _trainer(reward_fn, *overrides) -> PPOTrainer:
    """A `PPOTrainer` with what scoring and `_compute_advantages` read, one rank."""
    trainer = object.__new__(PPOTrainer)
    trainer.cfg = load_config(PPOConfig, None, list(overrides))
    trainer.device, trainer.timer = torch.device("cpu"), Timer(torch.device("cpu"))
    trainer.ctx = SimpleNamespace(rank=0, world_size=1)
    trainer.tokenizer, trainer.reward_manager = DigitTokenizer(), NaiveRewardManager(reward_fn)
    return trainer


def _batch():
    full = rows_of(LENGTHS)
    full.uids = list(UIDS)
    return full


def _step_advantages(trainer):
    """The step's path: the whole batch named and scored as this rank's share, then the advantages."""
    full = _batch()
    full.row_names = reward_row_names(full, ITEMS, "the step's batch")
    parts = [list(range(len(full)))]
    ro = full.take(parts[0])
    trainer._reward(ro)
    metrics = {}
    trainer._compute_advantages(full, ro, parts, metrics)
    return ro.advantages, metrics


def _reference(components, weights, lengths=LENGTHS, uids=UIDS):
    mask = rows_of(lengths).response_mask.double()
    return compute_gdpo_outcome_advantage(torch.zeros_like(mask), mask, np.asarray(uids),
                                          reward_components=torch.tensor(components, dtype=torch.float64),
                                          reward_weights=weights)[0]


def test_the_components_are_the_reward_functions_keys_weighted():
    advantages, metrics = _step_advantages(_trainer(_components, *GDPO))
    want = _reference(COMPONENTS, WEIGHTS)
    torch.testing.assert_close(advantages.double(), want, rtol=0, atol=1e-5)
    # (not what the summed score, gdpo's one component without keys, or the unweighted keys give)
    summed = _reference([[a + b] for a, b in COMPONENTS], [1.0])
    assert (want - summed).abs().max() > 0.1 and (want - _reference(COMPONENTS, [1.0, 1.0])).abs().max() > 0.1
    for k, key in enumerate(KEYS):  # verl's figures of each component: numpy's mean, population std, max, min
        values = np.array([c[k] for c in COMPONENTS])
        for stat, want_stat in (("mean", values.mean()), ("std", values.std()), ("max", values.max()),
                                ("min", values.min())):
            assert metrics[f"gdpo/{key}/{stat}"] == pytest.approx(want_stat, rel=1e-6, abs=1e-6), (key, stat)


def test_a_plain_score_is_the_component_acc():
    """A plain (not dict) result is recorded as `acc` (naive's, as verl's reward loop records it): the
    one component of gdpo_reward_keys=[acc]."""
    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return COMPONENTS[int(solution_str)][1]

    advantages, _ = _step_advantages(_trainer(plain, "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]"))
    torch.testing.assert_close(advantages.double(), _reference([[c[1]] for c in COMPONENTS], None), rtol=0, atol=1e-5)


def test_the_filter_groups_rounds_carry_the_components():
    """`_filtered_rollouts`: one round whose groups all vary keeps them all; the kept rows' components
    reach the estimator as on the step's path."""
    trainer = _trainer(_components, *GDPO, "algorithm.filter_groups.enable=true",
                       "algorithm.filter_groups.metric=seq_reward", "data.train_batch_size=3",
                       "actor_rollout_ref.rollout.n=3")
    trainer.cfg.trainer.balance_batch = False
    trainer._generate_all = lambda items, validate, seed: _batch()
    trainer.actor = SimpleNamespace(sp_size=1, share_prefix=False)
    metrics = {}
    full, ro, parts, _, _ = trainer._filtered_rollouts(ITEMS, seed=0, metrics=metrics)
    assert metrics["train/num_gen_batches"] == 1 and full.uids == UIDS
    trainer._compute_advantages(full, ro, parts, metrics)
    torch.testing.assert_close(ro.advantages.double(), _reference(COMPONENTS, WEIGHTS), rtol=0, atol=1e-5)


def _missing(data_source, solution_str, ground_truth, extra_info=None):
    result = _components(data_source, solution_str, ground_truth)
    if solution_str == "4":
        del result["accuracy_reward"]
    return result


def _not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    result = _components(data_source, solution_str, ground_truth)
    return {**result, "accuracy_reward": "high"} if solution_str == "4" else result


def _nan(data_source, solution_str, ground_truth, extra_info=None):
    result = _components(data_source, solution_str, ground_truth)
    return {**result, "accuracy_reward": math.nan} if solution_str == "4" else result


@pytest.mark.parametrize("fn", [_missing, _not_a_number, _nan])
def test_a_row_without_a_number_under_a_key_is_refused_by_name(fn):
    with pytest.raises(UserError) as raised:
        _step_advantages(_trainer(fn, *GDPO))
    assert (f"algorithm.gdpo_reward_keys: reward function {fn.__module__}.{fn.__qualname__} returned no number "
            "for 'accuracy_reward' on sample 4 of the step's batch: prompt 1's response 2 of 3, data row "
            "data/train.jsonl:2 (data_source='d')") in str(raised.value), raised.value


def test_a_key_the_function_never_returns_is_refused_at_the_first_row():
    with pytest.raises(UserError, match=r"returned no number for 'format' on sample 0 of the step's batch: prompt 0's "):
        _step_advantages(_trainer(_components, "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format]"))
