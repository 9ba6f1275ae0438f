"""Reward-function extra columns over ranks: every rank reduces the same keys in the same order,
whatever each rank's samples returned (a key on one rank only used to hang the step's reductions,
and a per-process key order added one key's sum to another's)."""

import math

from tests.dist_utils import run_distributed


def _body(rank, world):
    from sharding import comm
    from trainer.ppo_trainer import PPOTrainer

    # rank 0's function returned "parse_fail" for one sample, rank 1's never; their key orders differ
    local = ({"nchars": [3.0, 5.0], "acc": [1.0, 0.0], "parse_fail": [math.nan, 1.0]} if rank == 0
             else {"acc": [1.0, 1.0], "nchars": [2.0, 2.0]})
    extras = PPOTrainer._agreed_extras(local, 2)
    assert list(extras) == ["acc", "nchars", "parse_fail"], extras
    if rank == 1:
        assert all(math.isnan(v) for v in extras["parse_fail"])
    # the per-key reductions line up: acc's mean is acc's, over both ranks
    sums = comm.all_reduce_values([sum(v for v in extras[k] if not math.isnan(v)) for k in extras])
    assert sums == [3.0, 12.0, 1.0], sums


def test_reward_extras_agree_over_ranks():
    run_distributed(_body, 2)
