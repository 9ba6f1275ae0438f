"""Preemption: the decision to abandon a step is the same on every rank. Each rank timed its own
updates of the previous step; a grace period between the two ranks' totals used to send one rank
to write the checkpoint and the other into the update's collectives (both then hung until the
collective timeout). Both times are now the largest rank's."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.dist_utils import run_distributed


def _body(rank, world):
    from sharding import comm
    from trainer.ppo_trainer import PPOTrainer, _AbandonStep

    signalled_at = time.monotonic() - 10.0  # rank 0 was signalled 10 s ago; rank 1 was not
    # (rank 0's update time, rank 1's, grace): totals ~11 s and ~13 s, seconds from every grace
    cases = [(1.0, 3.0, 12.0),   # rank 0's total below the grace, rank 1's above: every rank abandons
             (1.0, 3.0, 20.0),   # both below: no rank abandons
             (1.0, 3.0, 5.0)]    # both above: every rank abandons
    for own0, own1, grace in cases:
        fake = SimpleNamespace(_stop_signal="SIGTERM" if rank == 0 else None, _stop_time=signalled_at,
                               _last_update_s=own0 if rank == 0 else own1,
                               cfg=SimpleNamespace(trainer=SimpleNamespace(preemption_grace_s=grace)))
        try:
            PPOTrainer._check_abandon(fake)
            abandoned = 0.0
        except _AbandonStep:
            abandoned = 1.0
        lo, hi = comm.all_reduce_values([abandoned, -abandoned], "max")
        assert lo == -hi, f"grace {grace}: the ranks took different branches"
        assert bool(lo) == (grace < 13.0), (grace, lo)


def test_every_rank_abandons_or_none_does():
    run_distributed(_body, 2)
