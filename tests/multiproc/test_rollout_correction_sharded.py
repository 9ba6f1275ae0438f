"""Decoupled rollout correction with the batch's rows spread over 2 and 3 gloo ranks: each rank computes
the weights and the rejection mask of its own rows, and every `rollout_corr/*` and
`training/rollout_probs_diff_*` figure from the ranks' reduced totals (`all_reduce` with
`global_metrics`) equals the single-process computation on the concatenated rows (the same functions,
no `all_reduce`), as do the weights and the mask rows. The rows are split unevenly, one rank holds
only an empty response (no valid token: it must not pull a max or min to 0). Then the trainer's pass
(`PPOTrainer._old_log_probs`): the same figures and rows, and of the per-token tensors only the 1-byte
keep mask is all-gathered."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.unit.test_rollout_correction import no_work

RTOL = ATOL = 1e-6  # sums in float64 in another order; the figures are O(0.01..10), the ranks' own ones far off

CONFIGS = [  # (rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
    ("token", 2.0, False, "token_k1", 2.0),
    ("sequence", 3.0, True, "seq_mean_k3", 0.05),
    ("token", "0.5_2.0", True, "token_k2,seq_sum_k1,seq_max_k3", "0.3,3.0,0.8"),
    ("sequence", "0.5_5.0", False, "seq_mean_k1,token_k3,seq_sum_k2,seq_max_k2,seq_mean_k2,seq_sum_k3,token_k1",
     "1.5,0.4,1.0,0.3,0.1,0.9,0.5_2.0"),
    (None, 2.0, False, None, None),
]

LENGTHS = (7, 3, 0, 5, 1, 6, 2, 7, 4, 0, 6, 3)
# rank 0: four rows with an empty one; rank 1 of 3: only the empty row 9; the rest uneven
PARTS = {2: [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]],
         3: [[0, 1, 2, 3, 4, 5], [9], [6, 7, 8, 10, 11]]}


def _batch(seed: int, shift: float):
    """float32 log-probs as the trainer has them, junk at the padding; log pi_old - log pi_rollout is
    N(0, 0.5), or with a `shift`, shift + |N(0, 0.5)|: every ratio above 1, so that verl's k1 statistic
    (-delta) and each sequence's log_ppl_diff are negative (a 0 from a rank without tokens would show
    in their maxima)."""
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    rollout = -torch.rand(len(LENGTHS), width, generator=g) * 3
    noise = torch.randn(len(LENGTHS), width, generator=g) * 0.5
    old = rollout + (shift + noise.abs() if shift else noise)
    old = torch.where(mask.bool(), old, 50.0)
    return old, torch.where(mask.bool(), rollout, -50.0), mask


def _correction(config, old, rollout, mask, all_reduce=None):
    from ppo.core_algos import (compute_rollout_correction, parse_rollout_is_threshold, parse_rollout_rs,
                                rollout_probs_diff_metrics)

    level, is_threshold, normalize, rs, rs_threshold = config
    rejection = parse_rollout_rs(rs, rs_threshold) if rs else ()
    ranks = {} if all_reduce is None else {"all_reduce": all_reduce}  # none: the single-process call
    weights, keep, metrics = compute_rollout_correction(
        old, rollout, mask, level, *parse_rollout_is_threshold(is_threshold), rejection, normalize,
        **ranks, **({"global_metrics": True} if ranks else {}))
    metrics.update(rollout_probs_diff_metrics(old, rollout, mask, **ranks))
    return weights, keep, {k: float(v) for k, v in metrics.items()}


def _assert_same_figures(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL, nan_ok=True), key


def _function_body(rank, world_size):
    from sharding import comm

    rows = PARTS[world_size][rank]
    every_key, far_off, negative_maxima = set(), set(), set()
    for seed, shift in ((0, 0.0), (1, 0.3)):
        old, rollout, mask = _batch(seed, shift)
        for config in CONFIGS:
            w_all, k_all, whole = _correction(config, old, rollout, mask)
            weights, keep, mine = _correction(config, old[rows], rollout[rows], mask[rows], comm.all_reduce)
            _assert_same_figures(mine, whole)
            if w_all is not None:
                torch.testing.assert_close(weights, w_all[rows], rtol=1e-6, atol=1e-7)
            if k_all is not None:
                assert torch.equal(keep, k_all[rows])
            # the check has teeth: this rank's rows alone give other figures
            _, _, alone = _correction(config, old[rows], rollout[rows], mask[rows])
            far_off |= {k for k, v in whole.items() if not alone[k] == pytest.approx(v, rel=1e-3, abs=1e-3,
                                                                                      nan_ok=True)}
            every_key |= set(whole)
            negative_maxima |= {k for k, v in whole.items() if k.endswith("_max") and v < 0}
    assert len(far_off) > len(every_key) / 2, sorted(every_key - far_off)  # some are 0 on any rows (k2's fraction_low)
    # a rank without a valid token contributing 0 would show in maxima below 0 (and in minima above 0, such
    # as the weights')
    assert {"rollout_corr/rollout_rs_token_k1_max", "rollout_corr/log_ppl_diff_max"} <= negative_maxima


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_ranks_rows_give_the_whole_batchs_figures(world_size):
    run_distributed(_function_body, world_size)


TRAINER_CONFIG = ("token", "0.5_2.0", True, "token_k2,seq_sum_k1,seq_max_k3", "0.3,3.0,0.8")
# the trainer's partition: equally many rows on each rank; an empty response (row 2) on rank 0
TRAINER_PARTS = {2: [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]],
                 3: [[2, 9, 0, 5], [1, 4, 7, 10], [3, 6, 8, 11]]}


def _trainer_body(rank, world_size):
    from sharding import comm
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    level, is_threshold, normalize, rs, rs_threshold = TRAINER_CONFIG
    cfg = load_config(PPOConfig, None, [
        "data.train_batch_size=12", "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"algorithm.rollout_correction.rollout_is={level}",
        f"algorithm.rollout_correction.rollout_is_threshold={is_threshold!r}",
        f"algorithm.rollout_correction.rollout_is_batch_normalize={str(normalize).lower()}",
        f"algorithm.rollout_correction.rollout_rs={rs}",
        f"algorithm.rollout_correction.rollout_rs_threshold={rs_threshold!r}"])
    old, rollout, mask = _batch(1, 0.0)
    old, rollout = old * mask, rollout * mask
    lengths = list(LENGTHS)
    engine = [rollout[i, :n].tolist() for i, n in enumerate(lengths)]
    full = RolloutBatch([[3, 4]] * 12, [[5] * n for n in lengths], list(range(12)), [None] * 12, [None] * 12,
                        [{}] * 12, ["stop"] * 12, engine, mask.shape[1], torch.device("cpu"))
    parts = TRAINER_PARTS[world_size]
    ro = full.take(parts[rank])
    mine = old[parts[rank]]
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=rank)
    trainer.actor = SimpleNamespace(count_work=no_work, log_probs=lambda ro, with_entropy, with_sum_pi_squared: (
        mine, torch.zeros_like(mine)))
    gathered = []
    all_gather = comm.all_gather

    def recording_all_gather(t, group=None):
        gathered.append(t.dtype)
        return all_gather(t, group)

    comm.all_gather = recording_all_gather
    metrics = {}
    trainer._old_log_probs(full, ro, parts, metrics)
    comm.all_gather = all_gather
    weights, keep, whole = _correction(TRAINER_CONFIG, old, full.padded(engine), mask)
    assert gathered == [torch.bool], gathered  # the keep mask only: no [N, R] float array on every rank
    _assert_same_figures({k: v for k, v in metrics.items() if k.startswith(("rollout_corr/", "training/"))}, whole)
    torch.testing.assert_close(ro.rollout_is_weights, weights[parts[rank]], rtol=1e-6, atol=1e-7)
    assert torch.equal(ro.rollout_rs_mask, keep[parts[rank]])
    assert torch.equal(full.rollout_rs_mask, keep)  # the advantages' loss mask over the whole batch
    assert 0 < float(keep.sum()) < float(mask.sum())
    assert not math.isnan(metrics["training/rollout_actor_probs_pearson_corr"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_trainer_gathers_only_the_keep_mask(world_size):
    run_distributed(_trainer_body, world_size)
