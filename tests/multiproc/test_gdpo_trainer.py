"""`algorithm.adv_estimator=gdpo` through the trainer: one step of the demo recipe on the tiny assets on 2
gloo ranks with `trainer.balance_batch` (each rank's rows a permutation's share, not a block), a reward file
returning {"score", "a", "b"} and gdpo_reward_keys=[a, b] weighted [1.0, 0.3]. The gathered components are
the file's numbers of each row's decoded response, the advantages equal a float64 run of
`ppo.core_algos.compute_gdpo_outcome_advantage` on them, and the step logs verl's gdpo/{a,b}/{mean,std,max,min}
of them (numpy's figures: the population std)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed

# two components of different spread: the share of odd characters, and the length
COMPONENTS_REWARD = '''
def components(solution_str):
    return sum(ord(c) % 2 for c in solution_str) / max(len(solution_str), 1), float(len(solution_str))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    a, b = components(solution_str)
    return {"score": a + b, "a": a, "b": b}
'''
WEIGHTS = [1.0, 0.3]


def _expected_components(texts: list[str]) -> torch.Tensor:
    """`COMPONENTS_REWARD`'s (a, b) of each response, `[N, 2]` float64."""
    namespace: dict = {}
    exec(COMPONENTS_REWARD, namespace)
    return torch.tensor([namespace["components"](t) for t in texts], dtype=torch.float64)


def _body(rank, world, assets, run_dir, reward):
    from models.tokenizer import decode_batch
    from ppo.core_algos import compute_gdpo_outcome_advantage
    from tests.e2e.conftest import demo_trainer, read_metrics

    trainer = demo_trainer(assets, run_dir, reward, "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]",
                           f"algorithm.gdpo_reward_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]", "trainer.balance_batch=true",
                           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=1",
                           "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[jsonl]")
    seen = {}
    compute = trainer._compute_advantages

    def checked(full, ro, parts, metrics, baselines):
        compute(full, ro, parts, metrics, baselines)
        gather = lambda t: trainer._gather_rows(t, parts, len(full)).double()  # noqa: E731
        seen["parts"] = parts
        seen["components"] = gather(ro.reward_components)
        seen["texts"] = decode_batch(trainer.tokenizer, full.responses)
        seen["want"] = compute_gdpo_outcome_advantage(
            torch.zeros_like(full.loss_mask, dtype=torch.float64), full.loss_mask.double(), np.asarray(full.uids),
            reward_components=seen["components"], reward_weights=WEIGHTS)[0]
        seen["got"] = gather(ro.advantages)

    trainer._compute_advantages = checked
    assert trainer.train() == 0
    # balancing gave each rank rows that are not one consecutive block of the batch
    assert any(part != list(range(part[0], part[0] + len(part))) for part in seen["parts"]), seen["parts"]
    components = seen["components"]
    torch.testing.assert_close(components, _expected_components(seen["texts"]), rtol=0, atol=1e-6)
    assert (components.std(0) > 0).all(), components  # both vary: each reaches the advantages
    torch.testing.assert_close(seen["got"], seen["want"], rtol=0, atol=1e-5)
    assert seen["want"].abs().max() > 0.1
    if rank != 0:
        return
    (row,) = read_metrics(run_dir)
    for k, key in enumerate(("a", "b")):
        column = components[:, k].numpy()
        for stat, want in (("mean", column.mean()), ("std", column.std()), ("max", column.max()),
                           ("min", column.min())):
            assert row[f"gdpo/{key}/{stat}"] == pytest.approx(want, rel=1e-6, abs=1e-6), (key, stat)


def test_gdpo_trains_a_step_on_two_ranks(tiny_assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(COMPONENTS_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path / "run"), str(reward), timeout=600)
