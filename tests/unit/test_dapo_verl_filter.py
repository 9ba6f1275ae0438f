"""Dynamic sampling (`algorithm.filter_groups`) against verl's rule on hand-made rounds: which prompts
the step keeps (verl's DAPO recipe: a prompt's group kept where its metric's population std is > 0 or it
has one response; the kept rows of the rounds concatenated and cut to train_batch_size prompts), and the
counts verl 0.9.1's default trainer logs: `training/filter_groups/evicted_samples` (prompts dropped for a
metric that did not vary) and `training/filter_groups/discarded_surplus_samples` (varying prompts beyond
the batch)."""

import numpy as np
import torch

import trainer.ppo_trainer as pt
from tests.unit.test_filter_rounds import filter_trainer

N, TARGET = 3, 3  # samples a prompt, prompts a step
# each round's prompts' scores (one row a prompt, one column a sample): rounds of 4 prompts
ROUNDS = [
    [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.25, 0.5]],  # 2 vary, 2 do not
    [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 0.0, 1.0], [-1.0, -1.0, -1.0]],  # 2 vary (1 needed), 2 do not
]


def _trainer():
    drawn = iter(range(len(ROUNDS)))

    def score(ro, texts=None):
        values = torch.tensor([ROUNDS[(p[0] - 1) // 10][(p[0] - 1) % 10][len(r) - 1]
                               for p, r in zip(ro.prompts, ro.responses)])
        return values, {}, {}, values

    # a prompt's tokens name its round and place: (round, prompt) -> [10 * round + prompt + 1]
    return filter_trainer(N, TARGET, len(ROUNDS[0]), lambda: (r := next(drawn), [
        {"input_ids": [10 * r + p + 1]} for p in range(len(ROUNDS[r]))])[1], score)


def _verl_kept():
    """verl's recipe, independently: per round the rows of the prompts whose scores' np.std > 0 (or one
    response), in row order; the rounds concatenated and cut to TARGET * N rows. (round, prompt) per row."""
    batch = []
    for r, prompts in enumerate(ROUNDS):
        rows = [(r, p, s) for p, scores in enumerate(prompts) for s in scores]
        kept = {p for p, scores in enumerate(prompts) if len(scores) == 1 or np.std(scores) > 0}
        batch += [row for row in rows if row[1] in kept]
        if len(batch) >= TARGET * N:
            break
    return batch[:TARGET * N]


def test_the_kept_prompts_and_the_filter_counts_are_verls():
    trainer = _trainer()
    metrics = {}
    full, _, _, scores, _ = trainer._filtered_rollouts(trainer.loader.next_batch(), 0, metrics)
    want = _verl_kept()
    assert [((p[0] - 1) // 10, (p[0] - 1) % 10) for p in full.prompts] == [(r, p) for r, p, _ in want]
    assert scores.tolist() == [s for *_, s in want]
    assert metrics == {"train/num_gen_batches": 2.0,
                       "training/filter_groups/evicted_samples": 4.0,  # 2 a round
                       "training/filter_groups/discarded_surplus_samples": 1.0}  # round 2's second varying prompt


def test_a_group_of_equal_values_is_dropped_whatever_their_std_rounds_to():
    """verl's `np.std > 0` keeps a group of equal values whose std rounds above 0; meshppo compares the values."""
    for value, n in ((0.1, 3), (0.7, 3), (0.7, 7)):
        equal = np.full(n, value)
        assert np.std(equal) > 0 and not pt.group_varies(equal)
    assert pt.group_varies(np.array([0.1, 0.1, 0.1 + 1e-12])) and pt.group_varies(np.array([0.25]))
    assert not pt.group_varies(np.array([1.0, 1.0]))
