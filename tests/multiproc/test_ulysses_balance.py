"""`trainer.balance_batch` under Ulysses sequence parallelism balances the step's rows over the actor's
data-parallel groups (world / ulysses_sequence_parallel_size), as verl balances over its dp size: the ranks
of a group pool their rows anyway. One PPO step (GAE, 4 responses a prompt) on 4 gloo ranks in actor
Ulysses groups of 2 (2 data-parallel groups; the critic without Ulysses) with prefix sharing and 6 prompt
groups (which the 2 groups divide, the 4 ranks do not), against the same step on 2 ranks without Ulysses:
the generation does not depend on the layout, so both train on the same rollouts, and with the same
partition both log the same `global_seqlen/*` figures (verl's, per data-parallel part: integer token sums)
and keep every prompt's rows in one group (the same `perf/prefix_tokens_saved`: the token budget holds a
whole group in both). A run in one actor group of 4 (one data-parallel part; the critic in groups of 2)
logs the figures of a single part: each is the step's tokens. One mini-batch, so both models' gradients
are taken before any optimizer step and are the same on every layout (float32 rounding apart): the
critic's groups, of another size than the actor's, pool consecutive rows of the same partition."""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_distributed
from tests.e2e.conftest import read_metrics
from tests.gpu.multi_gpu_checks import PARITY_REWARD

SEQLEN = [f"global_seqlen/{k}" for k in ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")]
RTOL = 2e-4


def _run(run_dir, world_size, assets, reward, sp, critic_sp, share):
    from tests.e2e.conftest import demo_trainer

    A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    trainer = demo_trainer(
        assets, run_dir, reward, "trainer.logger=[jsonl]", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.save_freq=0", "data.train_batch_size=6",
        "data.max_response_length=6", f"{R}.n=4", f"{A}.ppo_mini_batch_size=6", f"{A}.use_dynamic_bsz=true",
        f"{A}.ppo_max_token_len_per_gpu=4096", f"{R}.log_prob_use_dynamic_bsz=true",
        f"{R}.log_prob_max_token_len_per_gpu=4096", f"{A}.use_prefix_grouper={share}",
        f"{A}.ulysses_sequence_parallel_size={sp}", "algorithm.adv_estimator=gae",
        "critic.ppo_max_token_len_per_gpu=4096", f"critic.ulysses_sequence_parallel_size={critic_sp}",
        f"trainer.n_gpus_per_node={world_size}")
    assert trainer.train() == 0


def _four_ranks(rank, world_size, assets, run_root, reward):
    _run(f"{run_root}/sp2", world_size, assets, reward, 2, 1, "true")
    _run(f"{run_root}/sp4", world_size, assets, reward, 4, 2, "false")


def _two_ranks(rank, world_size, assets, run_root, reward):
    _run(f"{run_root}/dp2", world_size, assets, reward, 1, 1, "true")


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("ulysses_balance")
    reward = root / "reward.py"
    reward.write_text(PARITY_REWARD)  # varies within groups: nonzero advantages and gradients
    run_distributed(_four_ranks, 4, str(tiny_assets), str(root), str(reward), timeout=900)
    run_distributed(_two_ranks, 2, str(tiny_assets), str(root), str(reward), timeout=600)
    return {name: read_metrics(root / name)[0] for name in ("sp2", "sp4", "dp2")}


def test_seqlen_figures_are_the_data_parallel_groups(runs):
    split, plain = runs["sp2"], runs["dp2"]
    assert split["response_length/mean"] == plain["response_length/mean"]  # the same rollouts
    assert {k: split[k] for k in SEQLEN} == {k: plain[k] for k in SEQLEN}
    # one data-parallel group: its one part holds every token, before and after balancing
    one = runs["sp4"]
    tokens = one["perf/total_num_tokens"]
    assert tokens > 0 and one["global_seqlen/minmax_diff"] == 0
    for k in ("min", "max", "balanced_min", "balanced_max", "mean"):
        assert one[f"global_seqlen/{k}"] == tokens, k


def test_prompt_groups_stay_whole_in_their_data_parallel_group(runs):
    split, plain = runs["sp2"], runs["dp2"]
    assert 0.2 < plain["perf/prefix_tokens_saved"] < 0.9
    assert split["perf/prefix_tokens_saved"] == pytest.approx(plain["perf/prefix_tokens_saved"], abs=1e-9)


@pytest.mark.parametrize("layout", ["sp2", "sp4"])
@pytest.mark.parametrize("key", ["actor/grad_norm", "critic/grad_norm"])
def test_every_layout_takes_the_same_gradients(runs, layout, key):
    a, b = runs["dp2"][key], runs[layout][key]
    assert runs["dp2"]["response_length/mean"] == runs[layout]["response_length/mean"]  # the same rollouts
    assert math.isfinite(a) and a > 1e-3 and abs(a - b) <= RTOL * a, (a, b)
