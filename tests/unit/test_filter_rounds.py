"""Dynamic sampling (`algorithm.filter_groups`) keeps only each generation round's kept rows: a round's
whole batch is dropped once it is filtered, so the rows alive when the step's batch is put together are
the kept ones, however many rounds it took (verl's DAPO recipe filters each round at once too)."""

import gc
from types import SimpleNamespace

import torch

import trainer.ppo_trainer as pt
from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.rollout_batch import RolloutBatch
from trainer.tracking import Timer

N, TARGET, GEN = 4, 4, 8  # samples a prompt, prompts a step, prompts a round (one of them varies)


def filter_trainer(n: int, target: int, gen: int, next_batch, score):
    """A stand-in trainer for dynamic sampling (`metric=seq_reward`): `n` samples a prompt, `target` prompts a
    step, rounds of `gen` prompts from `next_batch()`; sample k of a prompt has k + 1 response tokens, and
    `score(ro, texts=None)` stands for the trainer's scoring. The tests of the filter share it."""
    cfg = load_config(PPOConfig, None, [
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
        f"data.train_batch_size={target}", f"actor_rollout_ref.actor.ppo_mini_batch_size={target}",
        f"data.gen_batch_size={gen}", f"actor_rollout_ref.rollout.n={n}"])
    trainer = object.__new__(pt.PPOTrainer)
    trainer.cfg, trainer.device, trainer.global_step = cfg, torch.device("cpu"), 0
    trainer.ctx = SimpleNamespace(rank=0, world_size=1)
    trainer.timer = Timer(trainer.device)
    trainer.actor = SimpleNamespace(sp_size=1, share_prefix=False)
    trainer.loader = SimpleNamespace(next_batch=next_batch)

    def generate_all(items, validate, seed):
        responses = [[7] * (k + 1) for _ in items for k in range(n)]
        return RolloutBatch([list(it["input_ids"]) for it in items for _ in range(n)], responses,
                            [i for i in range(len(items)) for _ in range(n)], ["d"] * len(responses),
                            [None] * len(responses), [{} for _ in responses], ["stop"] * len(responses),
                            [[0.0] * len(r) for r in responses], n, trainer.device)

    trainer._generate_all, trainer._score = generate_all, score
    return trainer


def _trainer():
    drawn = iter(range(1000))

    def score(ro, texts=None):
        # only a round's first prompt has varying scores
        values = torch.tensor([float(len(r)) if u == 0 else 1.0 for u, r in zip(ro.uids, ro.responses)])
        return values, {"acc": values.tolist()}, {}, values

    return filter_trainer(N, TARGET, GEN, lambda: [{"input_ids": [next(drawn) + 1] * 3} for _ in range(GEN)], score)


def test_only_the_kept_rows_of_each_round_stay_alive(monkeypatch):
    trainer = _trainer()
    alive = []
    concat = RolloutBatch.concat

    def counting_concat(batches):
        gc.collect()
        alive.append(sum(len(o) for o in gc.get_objects() if type(o) is RolloutBatch
                         and o.row_names and "generation round" in o.row_names[0]))
        return concat(batches)

    monkeypatch.setattr(RolloutBatch, "concat", staticmethod(counting_concat))
    metrics = {}
    full, ro, parts, scores, extras = trainer._filtered_rollouts(trainer.loader.next_batch(), 0, metrics)
    assert metrics["train/num_gen_batches"] == TARGET  # one varying prompt a round
    # the step's batch: each round's varying prompt, its rows' scores their own (1..N)
    assert len(full) == TARGET * N and full.uids == [g for g in range(TARGET) for _ in range(N)]
    assert scores.tolist() == [1.0, 2.0, 3.0, 4.0] * TARGET and extras["acc"] == scores.tolist()
    # at the concatenation only the kept rows are alive (before: every round's whole batch, 4 x 32 rows more)
    assert alive == [TARGET * N]
