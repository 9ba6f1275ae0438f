"""`algorithm.adv_estimator=remax` through the trainer (2 CPU ranks, gloo): each step also decodes
one greedy response per prompt (`timing_s/gen_max`), and every sampled response's advantage is its
return minus its prompt's greedy score. Checked against greedy responses decoded here by the same
engine outside the step and scored by the reward function itself."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import _config

# The untrained model's greedy responses are mostly empty: the ground truth's share makes the prompts'
# greedy scores differ, so a baseline given to another prompt's rows would not cancel it.
DENSE_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (int(ground_truth) % 7) / 7 + len(solution_str) / 10
'''


def _remax_body(rank, world_size, assets, run_root):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer, decode_batch

    namespace = {}
    exec(DENSE_REWARD, namespace)
    ctx = init_distributed("cpu")
    trainer = PPOTrainer(_config(assets, run_root, "remax", "algorithm.adv_estimator=remax",
                                 "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=false"), ctx)
    seen = {}
    compute = trainer._compute_advantages

    def checked(full, ro, parts, metrics, baselines):
        # before the update: the engine still has the weights the step's greedy responses came from
        first = {u: i for i, u in reversed(list(enumerate(full.uids)))}
        prompts = [full.prompts[first[u]] for u in sorted(first)]
        outs = trainer.rollout.generate(prompts, max_tokens=trainer.cfg.response_length, eos_ids=trainer.eos_ids,
                                        ignore_eos=False, seed=11, n=1, temperature=0.0, top_p=1.0, top_k=-1)
        texts = decode_batch(trainer.tokenizer, outs.token_ids)
        greedy = [namespace["compute_score"](None, t, full.ground_truths[first[u]]) for u, t in zip(sorted(first), texts)]
        assert len(set(greedy)) > 1, greedy  # the prompts' baselines differ: the mapping to rows is exercised
        want = torch.tensor([greedy[u] for u in full.uids], dtype=baselines.dtype)
        torch.testing.assert_close(baselines.cpu(), want, rtol=1e-6, atol=1e-7)
        compute(full, ro, parts, metrics, baselines)
        seen["ro"], seen["baselines"] = ro, baselines[torch.tensor(parts[rank])]

    trainer._compute_advantages = checked
    metrics = trainer.step()
    assert metrics["timing_s/gen_max"] > 0
    ro, baselines = seen["ro"], seen["baselines"]
    scores = ro.token_level_scores.sum(-1)
    # the score sits on the last token and there is no KL in the reward: every token's return is the score
    want = (scores - baselines.to(scores.dtype))[:, None] * ro.response_mask
    torch.testing.assert_close(ro.advantages, want, rtol=1e-6, atol=1e-7)
    assert (want.abs().sum(-1) > 0).any()


def test_remax_subtracts_the_greedy_score(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_remax_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def test_remax_needs_sampling():
    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, load_config
    from trainer.config import validate
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(PPOConfig, os.path.join(root, "configs", "demo.yaml"),
                      ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.temperature=0"])
    with pytest.raises(ConfigError, match="remax's greedy baseline"):
        validate(cfg)


def _reward_model_body(rank, world_size, assets, run_root, rm):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    trainer = PPOTrainer(_config(assets, run_root, "remax_rm", "algorithm.adv_estimator=remax",
                                 "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=false",
                                 "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "reward_model.enable=true",
                                 f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=1"), ctx)
    seen = {"rm_rows": []}
    generate, scores, compute = trainer._generate_all, trainer.reward_model.scores, trainer._compute_advantages

    def generated(items, validate, seed, sampling=None):
        ro = generate(items, validate, seed, sampling)
        if sampling is not None:
            seen["greedy"] = ro
        return ro

    def scored(ro):
        seen["rm_rows"].append(len(ro))
        return scores(ro)

    def checked(full, ro, parts, metrics, baselines):
        # the former way, before the update: every rank scores every greedy response
        calls = list(seen["rm_rows"])
        greedy = scores(trainer.reward_model.model_batch(seen["greedy"]))
        assert len(greedy) == 3 and greedy.max() - greedy.min() > 1e-3, greedy  # the prompts' baselines differ
        torch.testing.assert_close(baselines, greedy[torch.tensor(full.uids)], rtol=0, atol=1e-6)
        seen["calls"] = calls
        compute(full, ro, parts, metrics, baselines)

    trainer._generate_all, trainer.reward_model.scores, trainer._compute_advantages = generated, scored, checked
    metrics = trainer.step()
    assert metrics["timing_s/gen_max"] > 0
    # the greedy responses (3 prompts, padded to 4 rows: 2 a rank), then this rank's 3 samples
    assert seen["calls"] == [2, 3], seen["calls"]


def test_remax_scores_the_greedy_responses_once_over_the_ranks(tiny_assets, tmp_path):
    """With a reward model (`micro_batch_size_per_gpu=1`: a forward a row) and 3 prompts on 2 ranks,
    each rank runs the reward model on its share of the greedy responses (as many rows on each, so
    as many FSDP forwards), and every rank's baselines are the scores of every greedy response."""
    from tests.unit.test_reward_model import llama_reward_model, other_tokenizer

    rm = tmp_path / "rm"
    other = other_tokenizer()
    llama_reward_model(rm, len(other))
    other.save_pretrained(rm)
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_reward_model_body, 2, str(tiny_assets), str(tmp_path), str(rm), timeout=600)
