"""DAPO's dynamic sampling (`algorithm.filter_groups`) through the trainer on 2 CPU ranks (gloo).

The reward function makes the filter's outcome known whatever the model samples: a prompt with
an even answer gets `acc` 1 on every response (a constant group: always dropped), one with an odd
answer gets the parity of the response's length (a group that usually varies). So the step's
batch must hold odd-answer prompts only, each group with a varying `acc`, `train_batch_size`
prompts of `n` rows, and every row's score and extras those of its own output; a metric that never
varies fails after `max_num_gen_batches` rounds."""

import json
import os

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import _config

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    odd = int(ground_truth) % 2
    acc = float(len(solution_str) % 2) if odd else 1.0
    return {"score": acc + len(solution_str) / 100, "acc": acc, "parity": "odd" if odd else "even"}
'''
N, PROMPTS, GEN = 4, 4, 12
# dapo's overlong penalty on every token of the response (buffer = max_resp_len = data.max_response_length, 6 in demo.yaml)
OVERLONG = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=6",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=6",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False"]
FILTER = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.train_batch_size=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"data.gen_batch_size={GEN}", f"actor_rollout_ref.rollout.n={N}"]


def _body(rank, world_size, assets, run_root):
    from data.dataset import PromptDataLoader
    from trainer.errors import UserError
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    namespace = {}
    exec(REWARD, namespace)
    ctx = init_distributed("cpu")
    dump = os.path.join(run_root, "dump")
    trainer = PPOTrainer(_config(assets, run_root, "filtered", *FILTER, f"trainer.rollout_data_dir={dump}",
                                 "trainer.total_training_steps=null", "trainer.total_epochs=2"), ctx)
    # an epoch is the training set's train_batch_size batches, as verl 0.9.1 counts it, not its gen_batch_size rounds
    assert trainer.total_steps == len(trainer.train_ds) // PROMPTS * 2
    rounds = 0
    for step in (1, 2):
        metrics = trainer.step()
        assert metrics["train/num_gen_batches"] >= 1 and metrics["critic/score/mean"] > 0
        rounds += int(metrics["train/num_gen_batches"])
        with open(os.path.join(dump, f"{step}.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == PROMPTS * N
        for g in range(PROMPTS):  # a group's n rows are consecutive
            group = rows[g * N:(g + 1) * N]
            assert len({r["input"] for r in group}) == 1
            assert all(int(r["gts"]) % 2 == 1 for r in group), group  # the even answers' groups never vary
            assert np.std([r["acc"] for r in group]) > 0, group
        for r in rows:  # each row's score and extras are its own output's
            want = namespace["compute_score"](None, r["output"], r["gts"])
            assert (r["score"], r["acc"], r["parity"]) == pytest.approx((want["score"], want["acc"], "odd")), r
    # every round drew its own gen_batch_size prompts from the loader: a later step starts past them all
    fresh = PromptDataLoader(trainer.train_ds, GEN, shuffle=trainer.loader.shuffle, seed=trainer.loader.seed,
                             draws_per_epoch=trainer.loader.draws_per_epoch)
    for _ in range(rounds):
        fresh.next_batch()
    assert trainer.loader.state_dict() == fresh.state_dict()
    # rounds of fewer prompts than a step takes (verl's loop allows it): the step gathers them from several
    small = PPOTrainer(_config(assets, run_root, "small_rounds", *FILTER, "data.gen_batch_size=2",
                               f"trainer.rollout_data_dir={dump}_small"), ctx)
    assert small.step()["train/num_gen_batches"] >= 2
    with open(os.path.join(f"{dump}_small", "1.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == PROMPTS * N and all(int(r["gts"]) % 2 == 1 for r in rows)
    # a first round whose samples gave no extra keys (and one score): all dropped; the step's batch comes
    # from later rounds, whose extras the batch keeps under their names
    varying = PPOTrainer(_config(assets, run_root, "varying", *FILTER, "algorithm.filter_groups.metric=score",
                                 f"trainer.rollout_data_dir={dump}_varying"), ctx)
    real, calls = varying._score, []

    def score(ro, texts=None):
        calls.append(len(ro))
        s, e, o, own = real(ro, texts)
        return (torch.zeros_like(s), {}, {}, torch.zeros_like(own)) if len(calls) == 1 else (s, e, o, own)

    varying._score = score
    assert varying.step()["train/num_gen_batches"] >= 2
    with open(os.path.join(f"{dump}_varying", "1.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert all(r["acc"] == namespace["compute_score"](None, r["output"], r["gts"])["acc"] for r in rows)
    # a metric that never varies: every round drops every prompt
    never = PPOTrainer(_config(assets, run_root, "never", *FILTER, "algorithm.filter_groups.metric=parity_acc",
                               "algorithm.filter_groups.max_num_gen_batches=2"), ctx)
    with pytest.raises(UserError, match="parity_acc is not one of the reward function's numeric results"):
        never.step()
    constant = PPOTrainer(_config(assets, run_root, "constant", *FILTER, "algorithm.filter_groups.metric=acc",
                                  "algorithm.filter_groups.max_num_gen_batches=2",
                                  f"custom_reward_function.path={run_root}/constant.py"), ctx)
    with pytest.raises(UserError, match="2 generation rounds of data.gen_batch_size=12 prompts kept 0 of the 4"):
        constant.step()
    # metric=score is the function's own score (verl's DAPO trainer reads the result's 'score'), not the
    # score after dapo's overlong penalty, which here differs with every length: constant groups, all dropped
    penalized = PPOTrainer(_config(assets, run_root, "penalized", *FILTER, "algorithm.filter_groups.metric=score",
                                   "algorithm.filter_groups.max_num_gen_batches=2",
                                   f"custom_reward_function.path={run_root}/constant.py", *OVERLONG), ctx)
    real, seen = penalized._score, []
    penalized._score = lambda ro, texts=None: seen.append(real(ro, texts)) or seen[-1]
    with pytest.raises(UserError, match="2 generation rounds of data.gen_batch_size=12 prompts kept 0 of the 4"):
        penalized.step()
    scores = torch.cat([s for s, *_ in seen])  # the penalty did vary the scores a filter on them would keep
    assert torch.all(torch.cat([own for *_, own in seen]) == 1.0) and len(set(scores.tolist())) > 1


def test_dynamic_sampling_keeps_varying_groups(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(REWARD)
    (tmp_path / "constant.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'acc': 1.0}\n")
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def test_dynamic_sampling_config_errors():
    from trainer.config import PPOConfig, validate
    from trainer.configlib import ConfigError, load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def cfg(*overrides):
        return load_config(PPOConfig, os.path.join(root, "configs", "demo.yaml"), list(overrides))

    for overrides, message in (
            (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"],
             "needs algorithm.filter_groups.metric"),
            (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
              "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=false"],
             "metric=seq_final_reward with algorithm.use_kl_in_reward=true"),
            (["data.gen_batch_size=64"], "only dynamic sampling generates in rounds of gen_batch_size"),
            (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
              "algorithm.adv_estimator=remax"], "filter_groups with algorithm.adv_estimator=remax"),
            # a round's rows split unevenly over the ranks: an all-gather of unequal shapes (a hang on NCCL)
            (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.gen_batch_size=3",
              "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
             r"data.gen_batch_size x rollout.n \(3\) must be a multiple of the world size \(2\)")):
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides))
    for gen in (64, 16):  # rounds of more prompts than a step's, or of fewer (verl's loop takes both)
        validate(cfg("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                     f"data.gen_batch_size={gen}"))
    assert cfg().data.gen_batch_size == cfg().data.train_batch_size
