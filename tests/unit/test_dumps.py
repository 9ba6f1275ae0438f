"""The training sample dump (`trainer.rollout_data_dir`) written by `PPOTrainer._dump_rollouts`,
on a stand-in trainer (the attributes it reads): its advantage column under rollout rejection, its reward extras."""

import json
import math
from types import SimpleNamespace

import torch

from rewards import NaiveRewardManager
from trainer.ppo_trainer import PPOTrainer
from trainer.rollout_batch import RolloutBatch


class DigitTokenizer:
    """Decodes a sequence to its first id as text: a response of row i made of i's reads "i"."""

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [str(s[0]) if s else "" for s in sequences]


def dump_trainer(dump_dir, rank: int = 0, reward_fn=None) -> PPOTrainer:
    """A `PPOTrainer` with only what scoring and `_dump_rollouts` read, at step 0 (it dumps `1.jsonl`)."""
    trainer = object.__new__(PPOTrainer)
    trainer.cfg = SimpleNamespace(trainer=SimpleNamespace(rollout_data_dir=str(dump_dir)),
                                  reward_model=SimpleNamespace(enable=False))
    trainer.ctx = SimpleNamespace(rank=rank, is_main=rank == 0)
    trainer.device, trainer.global_step = torch.device("cpu"), 0
    trainer.tokenizer, trainer.reward_manager = DigitTokenizer(), NaiveRewardManager(reward_fn)
    return trainer


def rows_of(lengths: list[int]) -> RolloutBatch:
    """A batch whose row i has a response of `lengths[i]` tokens, each the id i."""
    n = len(lengths)
    return RolloutBatch([[7, 8]] * n, [[i] * m for i, m in enumerate(lengths)], list(range(n)), ["d"] * n,
                        ["g"] * n, [{}] * n, ["stop"] * n, [[0.0] * m for m in lengths], max(lengths),
                        torch.device("cpu"))


def read_dump(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_advantage_column_is_the_mean_over_the_tokens_rejection_kept(tmp_path):
    """With rollout rejection the advantages are computed over `loss_mask`: a row's `advantage` is
    the mean over its kept tokens (a rejected token's value, here not 0, does not count, nor does it
    count in the divisor), null for a row that has none left; without rejection, over its response."""
    lengths = [5, 3, 4, 2]
    full = rows_of(lengths)
    ro, parts = full.take([0, 1, 2, 3]), [[0, 1, 2, 3]]
    keep = [[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    ro.rollout_rs_mask = full.rollout_rs_mask = torch.tensor(keep, dtype=torch.float32)
    adv = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)) * ro.response_mask
    ro.advantages, ro.token_level_rewards = adv, torch.zeros(4, 5)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    trainer = dump_trainer(tmp_path)
    trainer._dump_rollouts(full, ro, parts, scores, {})
    dumped = read_dump(tmp_path / "1.jsonl")
    values = adv.tolist()
    for i, row in enumerate(dumped):
        kept = [values[i][t] for t in range(5) if keep[i][t]]
        if kept:
            assert abs(row["advantage"] - sum(kept) / len(kept)) < 1e-6, (i, row["advantage"], kept)
        else:
            assert row["advantage"] is None, row
    assert [row["score"] for row in dumped] == scores.tolist()

    ro.rollout_rs_mask = full.rollout_rs_mask = None
    trainer._dump_rollouts(full, ro, parts, scores, {})
    for i, row in enumerate(read_dump(tmp_path / "1.jsonl")):
        assert abs(row["advantage"] - sum(values[i][:lengths[i]]) / lengths[i]) < 1e-6


def test_a_single_rank_dump_writes_the_other_extras_as_returned(tmp_path):
    """Every key of the reward function's result reaches the dump: the numbers as floats (null where
    a sample gave none), the others as returned (null where a sample did not return the key), a
    value json cannot write as its str(); the numeric and non-numeric values of one key interleave."""
    def reward(data_source, solution_str, ground_truth, extra_info=None):
        i = int(solution_str)
        out = {"score": float(i), "pred": f"answer {i}", "ok": i % 2 == 0}
        if i == 1:
            out.update(parsed=[1, {"a": None}], pair=(1, 2), odd={(1, 2): "tuple key"})
        out["mixed"] = i if i != 2 else "two"
        return out

    full = rows_of([2, 1, 3])
    ro, parts = full.take([0, 1, 2]), [[0, 1, 2]]
    trainer = dump_trainer(tmp_path, reward_fn=reward)
    scores, extras, ro.other_extras, _ = trainer._score(ro)
    ro.advantages, ro.token_level_rewards = torch.zeros(3, 3), torch.zeros(3, 3)
    trainer._dump_rollouts(full, ro, parts, scores, extras)
    dumped = read_dump(tmp_path / "1.jsonl")
    assert [row["pred"] for row in dumped] == ["answer 0", "answer 1", "answer 2"]
    assert [row["ok"] for row in dumped] == [1.0, 0.0, 1.0]  # a number: a metric, written as before
    assert [row["parsed"] for row in dumped] == [None, [1, {"a": None}], None]
    assert [row["pair"] for row in dumped] == [None, [1, 2], None]
    assert [row["odd"] for row in dumped] == [None, "{(1, 2): 'tuple key'}", None]
    assert [row["mixed"] for row in dumped] == [0, 1, "two"]
    assert math.isnan(extras["mixed"][2]) and extras["mixed"][:2] == [0.0, 1.0]


def test_a_validation_dump_row_has_verls_keys_with_the_score_as_reward():
    """verl 0.9.1's validation dump: `input`, `output`, `gts`, `score`, `step`, then its
    `reward_extra_infos_dict`, which holds the scores again as `reward` and the reward function's
    extras. meshppo's rows hold every one of them (`reward` the score), plus its own `data_source`,
    `response_length` and `finish_reason`."""
    from trainer.ppo_trainer import validation_dump_rows

    ro = rows_of([2, 3])
    rows = validation_dump_rows(ro, ["p0", "p1"], ["o0", "o1"], 3, [1.0, 0.25], {"acc": [1.0, 0.0]},
                                {"pred": ["72", None]})
    verl = {"input", "output", "gts", "score", "step", "reward", "acc", "pred"}
    assert [set(row) - verl for row in rows] == [{"data_source", "response_length", "finish_reason"}] * 2
    assert [set(row) & verl for row in rows] == [verl] * 2
    assert [(row["score"], row["reward"], row["acc"], row["pred"]) for row in rows] == [(1.0, 1.0, 1.0, "72"),
                                                                                      (0.25, 0.25, 0.0, None)]


def test_the_rollout_dump_decodes_each_prompt_once(tmp_path):
    """A prompt's n rows share its ids: the dump decodes each group's prompt once (16,384 rows of 1,024
    prompts took 1.7 s against 0.1 s), and every row's `input` is still its own prompt's text."""
    decoded = []

    class CountingTokenizer(DigitTokenizer):
        def batch_decode(self, sequences, skip_special_tokens=True):
            decoded.extend(map(list, sequences))
            return super().batch_decode(sequences, skip_special_tokens)

    n, prompts = 4, [[3, 1], [5], [9, 9, 9]]
    full = RolloutBatch([p for p in prompts for _ in range(n)], [[1]] * 12, [g for g in range(3) for _ in range(n)],
                        ["d"] * 12, ["g"] * 12, [{}] * 12, ["stop"] * 12, [[0.0]] * 12, 1, torch.device("cpu"))
    ro, parts = full.take(list(range(12))), [list(range(12))]
    ro.advantages, ro.token_level_rewards = torch.zeros(12, 1), torch.zeros(12, 1)
    trainer = dump_trainer(tmp_path)
    trainer.tokenizer = CountingTokenizer()
    trainer._dump_rollouts(full, ro, parts, torch.zeros(12), {})
    assert [row["input"] for row in read_dump(tmp_path / "1.jsonl")] == [str(p[0]) for p in prompts for _ in range(n)]
    assert [p for p in decoded if p != [1]] == prompts  # (the 12 responses [1] aside)
