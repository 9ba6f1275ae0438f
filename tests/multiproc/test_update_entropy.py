"""`actor.calculate_entropy` (and an entropy bonus, verl's rule) make the update report its own entropy,
`actor/entropy_loss`, as verl 0.9.1's engine workers (`actor/entropy` stays the recompute pass's),
on 2 gloo ranks: each mini-batch's entropy under the actor of its forwards, aggregated with
`loss_agg_mode` over the whole mini-batch, averaged over mini-batches. At lr 0 every mini-batch sees
the initial actor, so two mini-batches of the batch average to the mini-batches' entropies computed
here by the recompute pass; with a learning rate the second mini-batch sees the stepped actor."""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts


def _body(rank, world_size):
    from models import ModelArgs
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.config import ActorConfig
    from trainer.roles import Actor, MicroBatching, agg_loss_global

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(3 + rank)
    prompts = [torch.randint(2, args.vocab_size, (6,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(2, args.vocab_size, (int(torch.randint(3, 10, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(4)]
    width = max(len(x) for x in responses)
    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")

    def actor(lr):
        model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                                 device=cpu, seed=0)
        return Actor(model, torch.optim.SGD(model.parameters(), lr=lr), None, packed=True, temperature=1.0,
                     pad_token_id=0, device=cpu, world_size=world_size, response_length=width,
                     batching=MicroBatching(2, False, 0))

    def batch(logp):
        ro = _rollouts(prompts, responses, width, cpu)
        ro.old_log_probs, ro.advantages = logp, torch.randn(logp.shape, generator=torch.Generator().manual_seed(9))
        ro.advantages = ro.advantages * ro.response_mask
        return ro

    first = actor(0.0)
    logp, ent = first.log_probs(_rollouts(prompts, responses, width, cpu), with_entropy=True)
    mask = _rollouts(prompts, responses, width, cpu).response_mask
    # the two mini-batches of plan_update without shuffle: rows 0-1 and 2-3 of every rank
    halves = [agg_loss_global(ent[rows], mask[rows], "seq-mean-token-mean", width) for rows in (slice(0, 2), slice(2, 4))]
    cfg = dict(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, entropy_coeff=0.0, use_kl_loss=False,
               shuffle=False, loss_agg_mode="seq-mean-token-mean", grad_clip=1e9)
    plain = first.update(batch(logp), ActorConfig(**cfg), 2, 0.0, seed=0, step=1)
    assert "actor/entropy" not in plain and "actor/entropy_loss" not in plain  # the recompute pass's stands
    reported = actor(0.0).update(batch(logp), ActorConfig(**cfg, calculate_entropy=True), 2, 0.0, seed=0, step=1)
    want = sum(halves) / 2
    # the two mini-batches' entropies differ (5.8e-4 here) by far more than the tolerance below (6e-6):
    # the reported figure is their average, not one of them
    assert abs(halves[0] - halves[1]) > 1e-4, halves
    assert "actor/entropy" not in reported
    assert abs(reported["actor/entropy_loss"] - want) <= 1e-6 * abs(want), (reported["actor/entropy_loss"], halves)
    bonus = actor(0.0).update(batch(logp), ActorConfig(**{**cfg, "entropy_coeff": 0.01}), 2, 0.0, seed=0, step=1)
    assert abs(bonus["actor/entropy_loss"] - want) <= 1e-6 * abs(want)
    stepped = actor(5.0).update(batch(logp), ActorConfig(**cfg, calculate_entropy=True), 2, 0.0, seed=0, step=1)
    assert abs(stepped["actor/entropy_loss"] - want) > 1e-4  # the second mini-batch saw the stepped actor


def test_update_reports_its_own_entropy():
    run_distributed(_body, 2)
