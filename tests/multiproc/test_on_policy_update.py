"""An on-policy actor update (one mini-batch, one epoch) on 2 gloo ranks takes its ratio's old
log-probs from its own forward, as verl's `on_policy`: stored old log-probs 0.5 nats off change
nothing (no clipping, the same parameters as with the right ones), none at all (the trainer's
skipped recompute pass) change nothing either, and the update then reports the pass's
`actor/entropy` and `actor/ref_kl`, checked against that pass run here. With two epochs the
stored old log-probs are the ratio's again (they clip)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts


def _body(rank, world_size):
    from kl import kl_penalty
    from models import ModelArgs
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.config import ActorConfig
    from trainer.roles import Actor, MicroBatching, agg_loss_global, masked_mean_global

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(7 + rank)  # each rank its own rows
    prompts = [torch.randint(2, args.vocab_size, (int(torch.randint(4, 12, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(2, args.vocab_size, (int(torch.randint(3, 12, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(4)]
    width = max(len(x) for x in responses)
    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")

    def actor():
        model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                                 device=cpu, seed=0)
        return Actor(model, torch.optim.SGD(model.parameters(), lr=0.5), None, packed=True, temperature=1.0,
                     pad_token_id=0, device=cpu, world_size=world_size, response_length=width,
                     batching=MicroBatching(3, False, 0))

    def batch(old):
        ro = _rollouts(prompts, responses, width, cpu)
        ro.old_log_probs, ro.ref_log_probs, ro.advantages = old, ref, advantages
        return ro

    def params(worker):
        return torch.cat([v.to_local().detach().flatten() for v in worker.model.state_dict().values()])

    first = actor()
    # the recompute pass of the trainer, before any update
    logp, ent = first.log_probs(_rollouts(prompts, responses, width, cpu), with_entropy=True)
    mask = _rollouts(prompts, responses, width, cpu).response_mask
    ref = (logp + 0.3 * torch.randn(logp.shape, generator=g)) * mask
    advantages = torch.randn(logp.shape, generator=g) * mask
    noisy = (logp + 0.5 * torch.randn(logp.shape, generator=g)) * mask
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2, entropy_coeff=0.0,
                      use_kl_loss=True, kl_loss_type="low_var_kl", grad_clip=1e9)
    start = params(first)

    right = first.update(batch(logp), cfg, 1, 0.1, seed=0, step=1)
    right_params = params(first)
    assert (right_params - start).abs().max() > 1e-3  # the update moved the actor

    wrong_actor = actor()
    wrong = wrong_actor.update(batch(noisy), cfg, 1, 0.1, seed=0, step=1)
    assert wrong["actor/pg_clipfrac"] == 0.0 and wrong["actor/ppo_kl"] == 0.0, wrong
    assert torch.equal(params(wrong_actor), right_params)

    skipped_actor = actor()
    skipped = skipped_actor.update(batch(None), cfg, 1, 0.1, seed=0, step=1)
    assert torch.equal(params(skipped_actor), right_params)
    entropy = agg_loss_global(ent, mask, "token-mean", width)
    ref_kl = masked_mean_global(kl_penalty(logp, ref, "low_var_kl"), mask)
    assert ref_kl > 0.01 and entropy > 1.0, (ref_kl, entropy)
    for key, want in (("actor/entropy", entropy), ("actor/ref_kl", ref_kl)):
        assert abs(skipped[key] - want) <= 1e-5 * abs(want), (key, skipped[key], want)
    for m in (right, wrong):  # the pass ran: its metrics are the trainer's, not the update's
        assert "actor/entropy" not in m and "actor/ref_kl" not in m

    # not on-policy (two epochs): the stored old log-probs are the ratio's, and 0.5 nats off they clip
    two_epochs = actor().update(batch(noisy), dataclasses.replace(cfg, ppo_epochs=2), 1, 0.1, seed=0,
                                step=1)
    assert two_epochs["actor/pg_clipfrac"] > 0.1, two_epochs
    with pytest.raises(ValueError, match="on-policy"):
        actor().update(batch(None), cfg, 2, 0.1, seed=0, step=1)


def test_on_policy_update_uses_its_own_forward():
    run_distributed(_body, 2)
