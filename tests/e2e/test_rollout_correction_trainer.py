"""Rollout correction in the trainer (2 CPU ranks, gloo, fp32): the engine's log-probs equal
the actor's recomputed ones, so bypass mode (no recompute pass) must train exactly like the
default mode, with the same entropy, reference KL and KL-in-reward."""

import os

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DENSE_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count("1") / max(len(solution_str), 1)
'''

# One mini-batch per step: every forward of the update runs before its optimizer step, so the
# bypass update's first mini-batch is the whole batch under the actor the recompute would use.
# AdamW with eps=1 is close to SGD (step = lr g / (|g| + 1)): parameter gaps then follow the
# fp32 gradient gaps, where the default eps would blow a near-zero gradient's noise up to lr.
COMMON = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
          "data.val_files=[]", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1.0",
          "actor_rollout_ref.actor.optim.eps=1.0", "actor_rollout_ref.rollout.calculate_log_probs=true",
          "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.9",
          "actor_rollout_ref.rollout.top_k=20", "trainer.resume_mode=disable", "trainer.export_hf_at_end=false",
          "trainer.logger=[jsonl]"]
CASES = {
    "grpo_kl_loss": [],
    "rloo_kl_in_reward": ["algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.use_kl_loss=false",
                          "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05"],
}
SAME = ["actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/ref_kl", "critic/score/mean",
        "critic/rewards/mean", "critic/advantages/mean", "rollout/logprob_diff"]


def _config(assets, run_root, name, *overrides):
    """The run `name` under `run_root`, which holds the reward function."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config

    return load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.train_files=[{assets}/train.jsonl]", f"actor_rollout_ref.model.path={assets}/sft_model",
        f"custom_reward_function.path={run_root}/dense_reward.py", f"trainer.default_local_dir={run_root}/{name}",
        *COMMON, *overrides])


def _shards(trainer) -> dict:
    return {k: v.to_local().detach().clone() for k, v in trainer.actor.model.state_dict().items()}


def _train_body(rank, world_size, assets, run_root, case):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    runs = {}
    for mode in ("recompute", "bypass", "bypass_is"):
        extra = {"recompute": [], "bypass": ["algorithm.rollout_correction.bypass_mode=true"],
                 # verl's ppo_clip in bypass mode computes rollout_is's weights for their metrics only
                 "bypass_is": ["algorithm.rollout_correction.bypass_mode=true",
                               "algorithm.rollout_correction.rollout_is=token"]}[mode]
        trainer = PPOTrainer(_config(assets, run_root, f"{case}_{mode}", *CASES[case], *extra), ctx)
        start = _shards(trainer)
        if mode != "recompute":
            def no_recompute(*args, **kwargs):
                raise AssertionError("bypass mode ran the old-log-prob pass")
            trainer.actor.log_probs = no_recompute
        runs[mode] = [trainer.step() for _ in range(2)], _shards(trainer)
    (plain, plain_params), (bypass, bypass_params) = runs["recompute"], runs["bypass"]
    moved = max((plain_params[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3, moved
    gap = max((plain_params[k] - bypass_params[k]).abs().max().item() for k in start)
    assert gap < 1e-5, f"rank {rank}: bypass parameters differ by {gap} (the update moved them by {moved})"
    keys = SAME + (["actor/reward_kl_penalty"] if case == "rloo_kl_in_reward" else [])
    for step, (a, b) in enumerate(zip(plain, bypass), 1):
        assert "timing_s/old_log_prob" in a and "timing_s/old_log_prob" not in b
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-6 + 1e-5 * abs(a[k]), (step, k, a[k], b[k])
    # the second step's KL is not trivially 0: the actor has left the reference
    kl_key = "actor/reward_kl_penalty" if case == "rloo_kl_in_reward" else "actor/ref_kl"
    assert plain[1][kl_key] > 1e-4, plain[1][kl_key]
    assert plain[0]["rollout/logprob_diff"] < 1e-6 and bypass[0]["rollout_corr/kl"] == pytest.approx(0, abs=1e-6)
    # the weights of ppo_clip's bypass mode are metrics only: the same update, bit for bit, and their metrics
    weighted, weighted_params = runs["bypass_is"]
    assert all(torch.equal(bypass_params[k], weighted_params[k]) for k in bypass_params)
    assert [m["actor/pg_loss"] for m in weighted] == [m["actor/pg_loss"] for m in bypass]
    assert all(m["rollout_corr/rollout_is_mean"] > 0 for m in weighted)
    assert not any("rollout_corr/rollout_is_mean" in m for m in bypass)


def _logprob_body(rank, world_size, assets, run_root):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    for engine in ("native", "hf"):
        trainer = PPOTrainer(_config(assets, run_root, f"lp_{engine}", f"actor_rollout_ref.rollout.name={engine}"),
                             ctx)
        full = trainer._generate_all(trainer.loader.next_batch(), validate=False, seed=3)
        ro, _ = trainer._partition(full)
        old, _ = trainer.actor.log_probs(ro)  # micro-batches of 8 (COMMON)
        gaps = [abs(a - b) for i, lps in enumerate(ro.engine_log_probs) for a, b in zip(lps, old[i].tolist())]
        assert len(gaps) > 100 and max(gaps) < 1e-5, (engine, max(gaps))
        assert any(x < -0.1 for lps in ro.engine_log_probs for x in lps)  # sampled, not all near-certain


def test_engine_log_probs_equal_the_recomputed_ones_in_fp32(tiny_assets, tmp_path):
    """At temperature 0.7 with top-k / top-p: both engines report log softmax(logits / T) of
    the untruncated distribution, which is what the actor recomputes."""
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_logprob_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_bypass_mode_trains_like_the_recompute(tiny_assets, tmp_path, case):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_train_body, 2, str(tiny_assets), str(tmp_path), case, timeout=600)


def _fp8_body(rank, world_size, assets, run_root):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    gaps = {}
    for quant, kv in (("null", "auto"), ("fp8", "auto"), ("null", "fp8")):
        trainer = PPOTrainer(_config(assets, run_root, f"q_{quant}_{kv}", f"actor_rollout_ref.rollout.quantization={quant}",
                                     f"actor_rollout_ref.rollout.kv_cache_dtype={kv}",
                                     "algorithm.rollout_correction.rollout_is=token"), ctx)
        metrics = [trainer.step() for _ in range(2)]
        assert bool(trainer.engine.model.fp8_layers) == (quant == "fp8")
        assert trainer.engine.runner.kv_fp8 == (kv == "fp8")
        if quant == "fp8":  # every reshard wrote new weights: each step's generate quantized them again
            assert trainer.engine.last_stats["quantize_s"] > 0 and not trainer.engine.model.fp8_stale
        gaps[quant, kv] = [m["rollout/logprob_diff"] for m in metrics]
        assert all(m["rollout_corr/rollout_is_mean"] > 0 for m in metrics)
    # the e4m3 engines sample from another distribution than the actor's, the fp32 one from the same (mean
    # |gaps| measured: fp8 projections 1.1e-3, e4m3 cache 6.1e-4, fp32 3e-8)
    assert max(gaps["null", "auto"]) < 1e-6 and min(gaps["fp8", "auto"]) > 1e-4 and min(gaps["null", "fp8"]) > 1e-4, gaps


def test_fp8_rollout_in_the_trainer(tiny_assets, tmp_path):
    """`actor_rollout_ref.rollout.quantization=fp8` reaches the engine, is requantized after every reshard, and
    its log-probs differ from the actor's recomputed ones (which rollout correction then weighs); so does
    `kv_cache_dtype=fp8` (an e4m3 KV cache)."""
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_fp8_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def _on_policy_body(rank, world_size, assets, run_root):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    runs = {}
    # COMMON is on-policy (one mini-batch, one epoch) and asks for the engine's log-probs, whose
    # diagnostics need the recompute pass; without them nothing before the update needs it
    for mode in ("recompute", "skipped"):
        extra = ["actor_rollout_ref.rollout.calculate_log_probs=false"] if mode == "skipped" else []
        trainer = PPOTrainer(_config(assets, run_root, f"on_policy_{mode}", *extra), ctx)
        start = _shards(trainer)
        if mode == "skipped":
            def no_recompute(*args, **kwargs):
                raise AssertionError("an on-policy step ran the old-log-prob pass")
            trainer.actor.log_probs = no_recompute
        runs[mode] = [trainer.step() for _ in range(2)], _shards(trainer)
    (plain, plain_params), (skipped, skipped_params) = runs["recompute"], runs["skipped"]
    assert max((plain_params[k] - start[k]).abs().max().item() for k in start) > 1e-3
    for k in start:  # the pass's log-probs are not the ratio's on-policy: skipping it changes no bit
        assert torch.equal(plain_params[k], skipped_params[k]), k
    for step, (a, b) in enumerate(zip(plain, skipped), 1):
        assert "timing_s/old_log_prob" in a and "timing_s/old_log_prob" not in b
        for m in (a, b):  # the ratio is exactly 1 (verl's on_policy)
            assert m["actor/pg_clipfrac"] == 0.0 and m["actor/ppo_kl"] == 0.0, (step, m["actor/ppo_kl"])
        for k in ("actor/entropy", "actor/ref_kl", "actor/pg_loss", "critic/advantages/mean"):
            assert abs(a[k] - b[k]) <= 1e-6 + 1e-5 * abs(a[k]), (step, k, a[k], b[k])
    assert plain[1]["actor/ref_kl"] > 1e-4, plain[1]["actor/ref_kl"]


def test_on_policy_step_skips_the_recompute_pass(tiny_assets, tmp_path):
    """One optimizer step a batch: the update's own forward gives the ratio's old log-probs, so the
    trainer skips the recompute pass; the parameters are bitwise those of a run that makes it, and
    the pass's metrics (entropy, reference KL) come from the update."""
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_on_policy_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def _pf_ppo_body(rank, world_size, assets, run_root):
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    gae = ["actor_rollout_ref.rollout.calculate_log_probs=false", "algorithm.adv_estimator=gae",
           "critic.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=1"]
    plain = PPOTrainer(_config(assets, run_root, "pf_off", *gae), ctx).step()
    pf = PPOTrainer(_config(assets, run_root, "pf_on", *gae, "algorithm.use_pf_ppo=true"), ctx).step()
    # the same generation (same seed, no update before it); the redraw changed the batch the update saw
    assert "timing_s/old_log_prob" not in plain and "timing_s/old_log_prob" in pf
    assert abs(plain["critic/score/mean"] - pf["critic/score/mean"]) > 1e-3, (plain, pf)
    # the entropy of the batch before the redraw (the skipped run's update measured that batch): 6e-8
    # apart, where the redrawn batch's (the update's forward) was 5e-4 apart (3.14089 against 3.13925)
    assert abs(plain["actor/entropy"] - pf["actor/entropy"]) <= 1e-5 * plain["actor/entropy"], (plain, pf)


def test_pf_ppo_on_policy_step_measures_the_batch_before_the_redraw(tiny_assets, tmp_path):
    """PF-PPO with an on-policy update (one mini-batch, one epoch): the recompute pass is not skipped,
    so actor/entropy (verl's, of its old-log-prob pass) is of the batch before the redraw, as verl logs
    it (and actor/ref_kl too); skipped, they came from the update's forward over the redrawn batch."""
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_pf_ppo_body, 2, str(tiny_assets), str(tmp_path), timeout=600)

