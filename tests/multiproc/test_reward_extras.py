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


def _row_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Row i's response reads "i" (tests.unit.test_dumps.DigitTokenizer): each row its own extras."""
    i = int(solution_str)
    out = {"score": float(i), "pred": f"row {i}"}
    if i % 2:
        out["parsed"] = [i, {"half": i // 2}]
    if i in (0, 2, 4):  # a string on rank 0's row 0, numbers on the others: in both columns on rank 0 only
        out["mixed"] = "zero" if i == 0 else i
    if i == 5:
        out["fn"] = _row_reward  # not JSON (nor picklable by value): its str() crosses the ranks
    return out


# rank 0 holds rows 4, 0, 3 and rank 1 rows 1, 5, 2: neither a contiguous block nor in order
PARTS = [[4, 0, 3], [1, 5, 2]]


def _dump_body(rank, world, dump_dir):
    import json

    import torch

    from tests.unit.test_dumps import dump_trainer, rows_of

    full = rows_of([1, 2, 3, 1, 2, 3])
    ro = full.take(PARTS[rank])
    trainer = dump_trainer(dump_dir, rank, _row_reward)
    scores, extras, ro.other_extras, _ = trainer._score(ro)
    assert list(ro.other_extras) == (["pred", "mixed", "parsed"] if rank == 0 else ["pred", "parsed", "fn"])
    ro.advantages, ro.token_level_rewards = torch.zeros(3, 3), torch.zeros(3, 3)
    trainer._dump_rollouts(full, ro, PARTS, scores, extras)
    if rank != 0:
        return
    with open(f"{dump_dir}/1.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    assert [row["output"] for row in dumped] == [str(i) for i in range(6)]  # the batch's order
    assert [row["score"] for row in dumped] == [float(i) for i in range(6)]
    assert [row["pred"] for row in dumped] == [f"row {i}" for i in range(6)]
    assert [row["parsed"] for row in dumped] == [None, [1, {"half": 0}], None, [3, {"half": 1}], None,
                                                 [5, {"half": 2}]]
    # rank 1's row 2 gave a number only: its number (a float); rank 0's rows as returned
    assert [row["mixed"] for row in dumped] == ["zero", None, 2.0, None, 4, None]
    assert [row["fn"] is None for row in dumped] == [True] * 5 + [False]
    assert dumped[5]["fn"].startswith("<function _row_reward at ")


def test_the_rollout_dump_gathers_every_ranks_other_extras_in_row_order(tmp_path):
    """Each rank scores its own rows, and its rows give their own extras that are not numbers: rank 0
    writes every row's, in the batch's row order, with null where a row did not return a key."""
    run_distributed(_dump_body, 2, str(tmp_path))
