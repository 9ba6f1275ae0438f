"""remax's greedy baselines over 2 ranks (gloo): each rank scores only its share of the greedy
responses, with the reward function and the reward model, and every rank ends with every row's
baseline, equal to the greedy scores computed by hand, and to every rank scoring every greedy
response (the trainer's former way). The prompt counts include ones that do not divide over the
ranks (3) and fewer prompts than ranks (1): `data.train_batch_size` need not be a multiple of the
world size, only `data.train_batch_size` x `rollout.n`."""

from types import SimpleNamespace

import pytest

from tests.dist_utils import run_distributed

# Greedy row i's response is i's id `i + 1` times (`tests.unit.test_dumps.rows_of`), which decodes to "i":
# the function gives i^2 / 8, the reward model (i + 1) / 16 + i / 4. Both exact in float32, so sums compare exactly.
RULE = lambda i: i * i / 8  # noqa: E731
MODEL = lambda i, length: length / 16 + i / 4  # noqa: E731


class _CountingRewardModel:
    """`RewardModel.scores` of a stand-in model: the real micro-batch loop (fixed size 1, as
    `reward_model.micro_batch_size_per_gpu=1` cuts the rows), recording the rows it scores and how
    many forwards it runs."""

    def __init__(self):
        import torch

        self.rows, self.forwards, self.model = [], 0, torch.nn.Linear(1, 1)

    def model_batch(self, ro):
        return ro

    def scores(self, ro):
        import torch

        from trainer.roles import MicroBatching, forward_micro_batches

        def forward(sub):
            self.forwards += 1
            ids = [r[0] for r in sub.responses]
            self.rows += ids
            return (torch.tensor([MODEL(i, len(r)) for i, r in zip(ids, sub.responses)]),)

        return forward_micro_batches(ro, MicroBatching(1, False, 0), forward, self.model)[0]


def _trainer(rank, world, prompts, balance):
    from rewards.managers import NaiveRewardManager
    from tests.unit.test_dumps import DigitTokenizer, rows_of
    from trainer.ppo_trainer import PPOTrainer
    from trainer.tracking import Timer

    import torch

    seen = []

    def rule(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(int(solution_str))
        return RULE(int(solution_str))

    trainer = object.__new__(PPOTrainer)
    trainer.cfg = SimpleNamespace(algorithm=SimpleNamespace(adv_estimator="remax"),
                                  trainer=SimpleNamespace(balance_batch=balance),
                                  reward_model=SimpleNamespace(enable=True, combine="add"))
    trainer.ctx = SimpleNamespace(rank=rank, world_size=world, is_main=rank == 0)
    trainer.device = torch.device("cpu")
    trainer.timer = Timer(trainer.device)
    trainer.tokenizer, trainer.reward_manager = DigitTokenizer(), NaiveRewardManager(rule)
    trainer.reward_model = _CountingRewardModel()
    greedy = rows_of([i + 1 for i in range(prompts)])

    def generate(items, validate, seed, sampling):
        assert sampling["n"] == 1 and sampling["temperature"] == 0.0 and len(items) == prompts
        return greedy

    trainer._generate_all = generate
    return trainer, greedy, seen


def _body(rank, world, prompts, balance):
    import torch

    from sharding import comm
    from tests.unit.test_dumps import rows_of

    trainer, greedy, seen = _trainer(rank, world, prompts, balance)
    # the step's rows: 2 samples a prompt, in the engine's order (prompt i's samples together)
    full = rows_of([1] * 2 * prompts)
    full.uids = [i // 2 for i in range(2 * prompts)]
    baselines = trainer._greedy_baselines([{}] * prompts, full)
    assert "gen_max" in trainer.timer.times
    want = torch.tensor([RULE(u) + MODEL(u, u + 1) for u in full.uids])
    assert torch.equal(baselines, want), (baselines, want)

    # this rank's share only, as many rows (and reward-model forwards) on every rank, each greedy
    # response scored at least once over the ranks and at most once more (the padding's copies)
    share = -(-prompts // world)
    rm = trainer.reward_model
    assert sorted(seen) == sorted(rm.rows) and len(seen) == share, (seen, rm.rows)
    assert rm.forwards == share
    every = [[int(c) for c in p.tolist()] for p in comm.all_gather(torch.tensor(seen))]
    scored = [i for p in every for i in p]
    assert sorted(set(scored)) == list(range(prompts)) and len(scored) == share * world, every
    if prompts % world == 0:
        assert sorted(scored) == list(range(prompts)), every

    # the former way: every rank scores every greedy response
    old, *_ = trainer._score(greedy)
    assert torch.equal(baselines, old[torch.tensor(full.uids)])


@pytest.mark.parametrize("prompts", [4, 3, 1])
@pytest.mark.parametrize("balance", [True, False])
def test_each_rank_scores_its_share_of_the_greedy_responses(prompts, balance):
    run_distributed(_body, 2, prompts, balance, timeout=120)
