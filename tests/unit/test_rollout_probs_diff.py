"""verl's rollout-vs-actor debug metrics (`training/rollout_probs_diff_*`,
`training/rollout_actor_probs_pearson_corr`): in probability space over the response mask, a
sample standard deviation, Pearson's r; from the trainer's recompute pass over the whole batch,
so on 2 gloo ranks they are the figures of the concatenated rows, not one rank's."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from ppo.core_algos import rollout_probs_diff_metrics
from tests.dist_utils import run_distributed
from tests.unit.test_rollout_correction import no_work

F64 = torch.float64
KEYS = ("training/rollout_probs_diff_valid", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr")


def _reference(old, rollout, mask) -> dict[str, float]:
    """verl's `calculate_debug_metrics`, written out over Python floats: the masked tokens' probabilities
    in float64, then max, mean, the sample standard deviation and Pearson's r (`statistics`)."""
    x, y = [], []
    for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), mask.tolist()):
        for o, r, m in zip(o_row, r_row, m_row):
            if m:
                x.append(math.exp(o))
                y.append(math.exp(r))
    d = [abs(a - b) for a, b in zip(x, y)]
    return dict(zip(KEYS, (1.0, max(d), statistics.fmean(d), statistics.stdev(d), statistics.correlation(x, y))))


def _batch(seed=0):
    """Six rows of 7 tokens (one empty, padding holding junk), float32 log-probs as the trainer has them,
    the engine's within 0.05 nats of the actor's in rows 0, 2 and 4, 0.5 in rows 1, 3 and 5."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 7, generator=g) * 3
    gap = torch.tensor([0.05, 0.5, 0.05, 0.5, 0.05, 0.5])[:, None]
    old = rollout + (torch.rand(6, 7, generator=g) * 2 - 1) * gap
    lengths = torch.tensor([7, 3, 0, 5, 1, 6])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).float()
    old = torch.where(mask.bool(), old, 5.0)  # junk outside the mask: exp(5) would dominate every figure
    return old, rollout, mask


def _assert_matches(got: dict, want: dict):
    assert set(KEYS) <= set(got)
    for k in KEYS:
        assert math.isclose(float(got[k]), want[k], rel_tol=1e-12, abs_tol=1e-15), (k, float(got[k]), want[k])


def test_hand_computed_three_tokens():
    """Probabilities old (0.5, 0.25, 1), rollout (0.25, 0.25, 0.5): d = (0.25, 0, 0.5), max 0.5, mean
    0.25, sample std sqrt((0.0625 + 0.0625) / 2) = 0.25 (the population one would be 0.204); r: x̄ =
    7/12, ȳ = 1/3, deviations (-1, -4, 5)/12 and (-1, -1, 2)/12, r = 15 / sqrt(42 · 6) = 0.9449."""
    old = torch.tensor([[math.log(0.5), math.log(0.25), 0.0, 3.0]], dtype=F64)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25), math.log(0.5), -2.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = rollout_probs_diff_metrics(old, rollout, mask)
    dx, dy = (-1 / 12, -1 / 3, 5 / 12), (-1 / 12, -1 / 12, 1 / 6)
    r = sum(a * b for a, b in zip(dx, dy)) / math.sqrt(sum(a * a for a in dx) * sum(b * b for b in dy))
    want = dict(zip(KEYS, (1.0, 0.5, 0.25, 0.25, r)))
    assert abs(r - 0.9449111825230679) < 1e-12
    _assert_matches(got, want)


def test_matches_a_float64_reference_on_a_padded_batch():
    old, rollout, mask = _batch()
    _assert_matches(rollout_probs_diff_metrics(old, rollout, mask), _reference(old, rollout, mask))


def test_undefined_figures_are_nan():
    old, rollout, mask = _batch()
    none = rollout_probs_diff_metrics(old, rollout, torch.zeros_like(mask))
    assert float(none["training/rollout_probs_diff_valid"]) == 1.0
    assert all(math.isnan(float(none[k])) for k in KEYS[1:])
    one = torch.zeros_like(mask)
    one[0, 2] = 1
    single = rollout_probs_diff_metrics(old, rollout, one)
    alone = abs(math.exp(old[0, 2]) - math.exp(rollout[0, 2]))
    assert math.isclose(float(single["training/rollout_probs_diff_max"]), alone, rel_tol=1e-12)
    assert float(single["training/rollout_probs_diff_mean"]) == float(single["training/rollout_probs_diff_max"])
    assert math.isnan(float(single["training/rollout_probs_diff_std"]))  # n - 1 = 0, as torch.std
    assert math.isnan(float(single["training/rollout_actor_probs_pearson_corr"]))


def _trainer_pass(rank: int, world_size: int, parts: list[list[int]]):
    """`PPOTrainer._old_log_probs` with `rollout.calculate_log_probs` on this rank's rows `parts[rank]`
    of `_batch`'s: the engine's log-probs are `rollout`, the actor's recompute `old`."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    old, rollout, mask = _batch()
    lengths = mask.sum(-1).long().tolist()
    cfg = load_config(PPOConfig, None, ["data.train_batch_size=6", "actor_rollout_ref.rollout.calculate_log_probs=true"])
    engine = [rollout[i, :n].tolist() for i, n in enumerate(lengths)]
    full = RolloutBatch([[3, 4]] * 6, [[5] * n for n in lengths], list(range(6)), [None] * 6, [None] * 6,
                        [{}] * 6, ["stop"] * 6, engine, 7, torch.device("cpu"))
    ro = full.take(parts[rank])
    mine = old[parts[rank]] * ro.response_mask
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=rank)
    trainer.actor = SimpleNamespace(count_work=no_work,
                                    log_probs=lambda ro, with_entropy, with_sum_pi_squared: (mine, torch.zeros_like(mine)))
    metrics = {}
    trainer._old_log_probs(full, ro, parts, metrics)
    return metrics, (old, rollout, mask)


def test_trainer_logs_them_over_the_batch():
    metrics, (old, rollout, mask) = _trainer_pass(0, 1, [list(range(6))])
    _assert_matches(metrics, _reference(old, rollout, mask))


# rank 0: rows 0, 4 and the empty 2 (8 tokens), rank 1: the other three (14 tokens); equal row counts, as the
# trainer partitions a batch
PARTS = [[0, 4, 2], [1, 3, 5]]


def _two_ranks_body(rank, world_size):
    metrics, (old, rollout, mask) = _trainer_pass(rank, world_size, PARTS)
    _assert_matches(metrics, _reference(old, rollout, mask))
    # one rank's rows alone give other figures (the check has teeth; rank 1 holds the batch's max)
    rows = PARTS[rank]
    alone = _reference(old[rows], rollout[rows], mask[rows])
    whole = _reference(old, rollout, mask)
    for k in KEYS[1 + rank:]:
        assert abs(alone[k] - whole[k]) > 0.01 * abs(whole[k]), k


def test_two_ranks_give_the_figures_of_the_concatenated_batch():
    run_distributed(_two_ranks_body, 2)


@pytest.mark.parametrize("bypass", [True, False])
def test_not_logged_without_a_recompute_or_rollout_log_probs(bypass):
    """verl computes them where the batch has rollout log-probs and the old ones are recomputed: not in
    bypass mode (old = rollout) nor without rollout log-probs."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    extra = (["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true"]
             if bypass else ["actor_rollout_ref.actor.ppo_mini_batch_size=1"])
    cfg = load_config(PPOConfig, None, ["data.train_batch_size=2", *extra])
    full = RolloutBatch([[3, 4]] * 2, [[5, 6]] * 2, [0, 1], [None] * 2, [None] * 2, [{}] * 2, ["stop"] * 2,
                        [[-1.0, -2.0]] * 2, 2, torch.device("cpu"))
    ro = full.take([0, 1])
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx, trainer.global_step = Timer(trainer.device), SimpleNamespace(rank=0), 0
    trainer.actor = SimpleNamespace(count_work=no_work,
                                    log_probs=lambda ro, with_entropy, with_sum_pi_squared: (torch.full((2, 2), -1.5), torch.zeros(2, 2)))
    metrics = {}
    trainer._old_log_probs(full, ro, [[0, 1]], metrics)
    assert not any(k.startswith("training/") for k in metrics)
