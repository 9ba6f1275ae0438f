"""`rollout_is_batch_normalize` with the batch split over 2 gloo ranks: with the ranks' sums
all-reduced (`sharding.comm.all_reduce`, as the actor passes in bypass mode) each rank's
normalised weights are its rows of the single-process result on the whole batch, at token and
sequence level. The split is uneven (rank 1 has short rows and an empty one), so a per-rank
mean would differ. Then the same in the actor's bypass update (a rank with empty micro-batches)
and in the trainer's decoupled pass."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.unit.test_rollout_correction import no_work

F64 = torch.float64


def _batch():
    """Eight rows of 6 tokens, log-ratios in [-1, 1]; rows 0-2 go to rank 0, 3-7 to rank 1."""
    g = torch.Generator().manual_seed(5)
    rollout = -torch.rand(8, 6, generator=g, dtype=F64) * 3
    old = rollout + (torch.rand(8, 6, generator=g, dtype=F64) * 2 - 1)
    lengths = torch.tensor([6, 5, 6, 1, 2, 0, 1, 3])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(F64)
    return old, rollout, mask


SPLIT = 3


def _body(rank, world_size, level):
    from ppo.core_algos import compute_rollout_correction
    from sharding import comm

    old, rollout, mask = _batch()
    whole, _, m_whole = compute_rollout_correction(old, rollout, mask, level, None, 1.5, batch_normalize=True)
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    mine, _, m_mine = compute_rollout_correction(old[rows], rollout[rows], mask[rows], level, None, 1.5,
                                                 batch_normalize=True, all_reduce=comm.all_reduce)
    torch.testing.assert_close(mine, whole[rows], rtol=1e-12, atol=1e-12)
    factor = float(m_mine["rollout_corr/rollout_is_batch_norm_factor"])
    assert abs(factor - float(m_whole["rollout_corr/rollout_is_batch_norm_factor"])) < 1e-12
    # the whole batch's normalised weights average 1 over its tokens / sequences
    if level == "token":
        assert abs(float(whole.sum() / mask.sum()) - 1.0) < 1e-12
    else:
        nonempty = mask.sum(-1) > 0
        assert abs(float(whole.max(-1).values[nonempty].mean()) - 1.0) < 1e-12
    # a per-rank mean would not give the same weights
    alone, _, _ = compute_rollout_correction(old[rows], rollout[rows], mask[rows], level, None, 1.5,
                                             batch_normalize=True)
    assert (alone - whole[rows]).abs().max() > 1e-3


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_normalised_weights_over_two_ranks_equal_the_whole_batch(level):
    run_distributed(_body, 2, level)


def _bypass_body(rank, world_size):
    """Bypass mode, reinforce, dynamic micro-batches: rank 0's one sequence fills one micro-batch,
    rank 1's three need three, so rank 0 runs two empty ones, where its share of the normalising
    sum is zeros (`Actor.update`'s `join`); without it the ranks' collectives fall out of step."""
    from types import SimpleNamespace

    from models import ModelArgs
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts
    from tests.unit.test_batching import _actor_cfg
    from trainer.roles import Actor

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(7 + rank)
    n = 1 if rank == 0 else 3
    prompts = [torch.randint(2, args.vocab_size, (8,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(2, args.vocab_size, (10,), generator=g).tolist() for _ in range(n)]
    ro = _rollouts(prompts, responses, 10, cpu)
    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                             device=cpu, seed=0)
    worker = Actor(model, torch.optim.SGD(model.parameters(), lr=0.0), None, packed=True, temperature=1.0,
                   pad_token_id=0, device=cpu, world_size=world_size, response_length=10)
    mask = ro.response_mask
    # engine log-probs far below any model's: every ratio is truncated to 1.02, the mean of every micro-batch
    ro.rollout_log_probs = ro.old_log_probs = -30.0 * mask
    ro.advantages = torch.randn(mask.shape, generator=g) * mask
    rc = SimpleNamespace(bypass_mode=True, loss_type="reinforce", rollout_is="token", is_bounds=(None, 1.02),
                         rejection=(), rollout_is_batch_normalize=True)
    cfg = _actor_cfg(entropy_coeff=0.0, use_kl_loss=False, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)
    out = worker.update(ro, cfg, num_mini_batches=1, kl_loss_coef=0.0, seed=0, rollout_correction=rc)
    assert abs(out["rollout_corr/rollout_is_batch_norm_factor"] - 1.02) < 1e-6, out


def test_bypass_update_with_empty_micro_batches_normalises_over_both_ranks():
    run_distributed(_bypass_body, 2, timeout=150)


def _decoupled_body(rank, world_size):
    """Decoupled mode in the trainer (`PPOTrainer._old_log_probs`): each rank's weights are its rows
    of the whole batch's truncated weights divided by their mean over every valid token, computed
    here by hand."""
    import math
    from types import SimpleNamespace

    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer
    from trainer.rollout_batch import RolloutBatch
    from trainer.tracking import Timer

    cfg = load_config(PPOConfig, None, [
        "data.train_batch_size=4", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true"])
    lengths = [5, 3, 1, 2]
    engine = [[-1.0 - 0.1 * t for t in range(n)] for n in lengths]
    full = RolloutBatch([[3, 4]] * 4, [[5] * n for n in lengths], [0, 0, 1, 1], [None] * 4, [None] * 4, [{}] * 4,
                        ["stop"] * 4, engine, 5, torch.device("cpu"))
    parts = [[0, 1], [2, 3]]
    ro = full.take(parts[rank])
    # log pi_old - log pi_rollout; rank 0 holds 8 tokens, rank 1 three, with the large ratios
    deltas = [[0.2, -0.3, 0.0, 0.1, -1.0], [0.5, 0.0, -0.2], [1.0], [0.3, 0.6]]
    delta = torch.zeros(4, 5)
    for i, d in enumerate(deltas):
        delta[i, :len(d)] = torch.tensor(d)
    old = ((full.padded(engine) + delta) * full.response_mask)[parts[rank]]
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=rank)
    trainer.actor = SimpleNamespace(count_work=no_work,
                                    log_probs=lambda ro, with_entropy, with_sum_pi_squared: (old, torch.zeros_like(old)))
    metrics = {}
    trainer._old_log_probs(full, ro, parts, metrics)
    truncated = [[min(math.exp(x), 1.5) for x in d] for d in deltas]
    mean = sum(map(sum, truncated)) / sum(lengths)
    want = torch.zeros(4, 5, dtype=F64)
    for i, w in enumerate(truncated):
        want[i, :len(w)] = torch.tensor(w, dtype=F64) / mean
    torch.testing.assert_close(ro.rollout_is_weights.double(), want[parts[rank]], rtol=1e-6, atol=1e-7)
    assert abs(metrics["rollout_corr/rollout_is_batch_norm_factor"] - mean) < 1e-6


def test_decoupled_trainer_normalises_over_the_whole_batch():
    run_distributed(_decoupled_body, 2)
