"""The update statistics against verl 0.9.1's aggregation, on 1 and 2 gloo ranks whose mini-batches run
different numbers of micro-batches (use_dynamic_bsz): the actor's `actor/pg_clipfrac`, `actor/ppo_kl` and
`actor/pg_clipfrac_lower` are each mini-batch's mean over its micro-batches of every rank, averaged over
the mini-batches (verl's `Metric` of aggregation MEAN: `Metric.aggregate_dp` per mini-batch, then the
trainer's mean over the mini-batches); the critic's `critic/vf_clipfrac` and `critic/vpred_mean` are the
plain mean over every micro-batch of every mini-batch and rank (verl's value loss returns them as floats,
which its worker flattens before the mean). The per-micro-batch values are computed here with
`ppo.core_algos` from the initial models' outputs (lr 0: every forward sees them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts

PROMPT = 8
# two mini-batches of two rows a rank: the first (2 x (8 + 3) = 22 tokens) packs into one micro-batch under
# 24 tokens, the second (2 x (8 + 12) = 40) into two
RESPONSE_LENGTHS = [3, 3, 12, 12]
MAX_TOKENS = 24


def _gathered(values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    if not dist.is_initialized():
        return [mine.tolist()]
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [e.tolist() for e in every]


def _off_policy_rows(args, lengths: list[int], g: torch.Generator):
    """Rows of random prompts and responses of `lengths` tokens, with the initial model's log-probs `logp`:
    old log-probs up to 0.6 nats off them and advantages of both signs, so every clip fraction moves from
    row to row. Returns `(rows, logp, response mask)`."""
    from models import Transformer
    from trainer.roles import MicroBatching, ReferencePolicy

    cpu = torch.device("cpu")
    prompts = [torch.randint(2, args.vocab_size, (PROMPT,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(2, args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    local = _rollouts(prompts, responses, max(lengths), cpu)
    mask = local.response_mask
    reference = ReferencePolicy(Transformer.build(args, seed=0), packed=True, temperature=1.0, pad_token_id=0,
                                device=cpu, batching=MicroBatching(None, False, 0))
    logp = reference.log_probs(local)
    local.old_log_probs = (logp + 0.6 * torch.randn(logp.shape, generator=g)) * mask
    local.advantages = torch.randn(logp.shape, generator=g) * mask
    return local, logp, mask


def _body(rank, world_size):
    from models import ModelArgs
    from ppo.core_algos import compute_value_loss, get_policy_loss_fn, masked_mean
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.config import ActorConfig, CriticConfig
    from trainer.roles import Actor, Critic, MicroBatching, plan_update

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(7 + rank)  # each rank its own rows
    local, logp, mask = _off_policy_rows(args, RESPONSE_LENGTHS, g)
    width = max(RESPONSE_LENGTHS)
    values = torch.randn(logp.shape, generator=g) * mask
    local.values, local.returns = values, (values + torch.randn(logp.shape, generator=g)) * mask

    plan = plan_update(local, 1, 2, False, 0, None, True, MAX_TOKENS)
    assert [len(mb.parts) for mb in plan] == [1, 2], plan  # mini-batches of different micro-batch counts

    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")
    fsdp = FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"})
    model = build_fsdp_model(args, meshes.train, fsdp, device=cpu, seed=0)
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=0.0), None, packed=True, temperature=1.0,
                  pad_token_id=0, device=cpu, world_size=world_size, response_length=width)
    cfg = ActorConfig(ppo_mini_batch_size=2 * world_size, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=MAX_TOKENS,
                      clip_ratio=0.2, clip_ratio_c=1.5, entropy_coeff=0.0, use_kl_loss=False, ppo_epochs=1,
                      shuffle=False)
    metrics = actor.update(local, cfg, 2, 0.0, seed=0, step=1)

    loss = get_policy_loss_fn("vanilla")
    names = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    per_micro = []  # [mini-batch][micro-batch][metric]
    for mb in plan:
        per_micro.append([])
        for part in mb.parts:
            out = loss(old_log_prob=local.old_log_probs[part], log_prob=logp[part], advantages=local.advantages[part],
                       response_mask=mask[part], cliprange=0.2, cliprange_low=None, cliprange_high=None,
                       clip_ratio_c=1.5, loss_agg_mode="token-mean", rollout_is_weights=None)
            per_micro[-1].append([float(getattr(out, n)) for n in names])
    flat = [v for mini in per_micro for micro in mini for v in micro]
    every = torch.tensor(_gathered(flat), dtype=torch.float64).view(world_size, 3, len(names))  # rank, micro, metric
    # verl: each mini-batch's micro-batches, each averaged over the ranks, then averaged; then over the mini-batches
    expected = (every[:, 0].mean(0) + every[:, 1:].mean(0).mean(0)) / 2
    naive = every.mean((0, 1))  # every micro-batch alike: what verl does not do for these
    got = torch.tensor([metrics[f"actor/{n}"] for n in names], dtype=torch.float64)
    assert (expected - naive).abs().max() > 1e-2, (expected, naive)  # the test tells the two apart
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    critic_model = build_fsdp_model(args, meshes.train, fsdp, device=cpu, head="value", seed=1)
    critic = Critic(critic_model, torch.optim.SGD(critic_model.parameters(), lr=0.0), None, packed=True,
                    pad_token_id=0, device=cpu, world_size=world_size, response_length=width,
                    batching=MicroBatching(None, False, 0))
    vpreds = critic.values(local)
    ccfg = CriticConfig(ppo_mini_batch_size=2 * world_size, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=MAX_TOKENS,
                        cliprange_value=0.3, ppo_epochs=1, shuffle=False, grad_clip=1.0,
                        loss_agg_mode="token-mean")
    cmetrics = critic.update(local, ccfg, 2, seed=0)
    per_micro = []
    for mb in plan:
        for part in mb.parts:
            vf = compute_value_loss(vpreds[part], local.returns[part], local.values[part], mask[part], 0.3,
                                    loss_agg_mode="token-mean")
            per_micro += [float(vf.vf_clipfrac), float(masked_mean(vpreds[part], mask[part]))]
    every = torch.tensor(_gathered(per_micro), dtype=torch.float64).view(world_size, 3, 2)
    expected = every.mean((0, 1))  # verl: the flat mean of the floats of every micro-batch and rank
    got = torch.tensor([cmetrics["critic/vf_clipfrac"], cmetrics["critic/vpred_mean"]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [1, 2])
def test_update_statistics_aggregate_as_verl(world_size):
    run_distributed(_body, world_size)


def _uneven_body(rank, world_size):
    from models import ModelArgs
    from ppo.core_algos import get_policy_loss_fn
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.config import ActorConfig
    from trainer.roles import Actor

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(3 + rank)
    rows = 4 if rank == 0 else 2  # rank 1 runs two empty micro-batches of the four
    local, logp, mask = _off_policy_rows(args, [6] * rows, g)
    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                             device=cpu, seed=0)
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=0.0), None, packed=True, temperature=1.0,
                  pad_token_id=0, device=cpu, world_size=world_size, response_length=6)
    # two epochs of one mini-batch (not on-policy) at lr 0: both see the initial policy
    cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, entropy_coeff=0.0,
                      use_kl_loss=False, ppo_epochs=2, shuffle=False)
    metrics = actor.update(local, cfg, 1, 0.0, seed=0, step=1)
    clipfrac = [float(get_policy_loss_fn("vanilla")(
        old_log_prob=local.old_log_probs[[i]], log_prob=logp[[i]], advantages=local.advantages[[i]],
        response_mask=mask[[i]], cliprange=0.2, cliprange_low=None, cliprange_high=None,
        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode="token-mean", rollout_is_weights=None).pg_clipfrac)
        for i in range(rows)]
    every = _gathered(clipfrac + [0.0] * (4 - rows))
    values = every[0] + every[1][:2]  # the six micro-batches that ran
    expected = sum(values) / 6
    per_rank = (sum(every[0]) / 4 + sum(every[1][:2]) / 2) / 2  # each rank's mean, then the ranks'
    assert abs(expected - per_rank) > 1e-2, (expected, per_rank)
    assert abs(metrics["actor/pg_clipfrac"] - expected) < 1e-6, (metrics["actor/pg_clipfrac"], expected)


def test_an_empty_micro_batch_adds_nothing_to_the_statistics():
    """A rank holding fewer rows than another runs empty micro-batches (every rank runs as many): the
    statistics are the mean over the micro-batches that ran, each counted once (verl's rule, whose ranks
    never hold unequal rows), not the mean of each rank's own mean."""
    run_distributed(_uneven_body, 2)
