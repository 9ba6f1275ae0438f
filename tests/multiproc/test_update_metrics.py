"""An update's statistics are every rank's: on 2 gloo ranks whose batches clip differently, the logged
`actor/pg_clipfrac` and `actor/ppo_kl` are the means of the two ranks' own values (each computed here from
the initial policy's log-probs with `ppo.core_algos`), not rank 0's alone."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts


def _body(rank, world_size):
    from models import ModelArgs, Transformer
    from ppo.core_algos import get_policy_loss_fn
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.config import ActorConfig
    from trainer.roles import Actor, MicroBatching, ReferencePolicy

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(5 + rank)  # each rank its own rows
    prompts = [torch.randint(2, args.vocab_size, (8,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(2, args.vocab_size, (int(torch.randint(3, 12, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(4)]
    width = max(len(x) for x in responses)
    local = _rollouts(prompts, responses, width, cpu)
    reference = ReferencePolicy(Transformer.build(args, seed=0), packed=True, temperature=1.0, pad_token_id=0,
                                device=cpu, batching=MicroBatching(None, False, 0))
    logp = reference.log_probs(local)  # the policy the update's one micro-batch sees before its step
    mask = local.response_mask
    # rank 0's old log-probs are the policy's own (ratio 1: nothing clips); rank 1's are 0.5 nats off
    shift = 0.0 if rank == 0 else 0.5 * torch.randn(logp.shape, generator=g)
    local.old_log_probs = (logp + shift) * mask
    local.advantages = torch.randn(logp.shape, generator=g) * mask

    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                             device=cpu, seed=0)
    # two epochs of one mini-batch (not on-policy: the stored old log-probs are the ratio's) at lr 0, so that
    # both see the initial policy and their means are the one-pass statistics computed below
    worker = Actor(model, torch.optim.SGD(model.parameters(), lr=0.0), None, packed=True, temperature=1.0,
                   pad_token_id=0, device=cpu, world_size=world_size, response_length=width)
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, clip_ratio=0.2, entropy_coeff=0.0,
                      use_kl_loss=False, ppo_epochs=2, shuffle=False)
    metrics = worker.update(local, cfg, 1, 0.0, seed=0, step=1)

    own = get_policy_loss_fn("vanilla")(
        old_log_prob=local.old_log_probs, log_prob=logp, advantages=local.advantages, response_mask=mask,
        cliprange=0.2, cliprange_low=None, cliprange_high=None, clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode="token-mean", rollout_is_weights=None)
    mine = torch.tensor([float(own.pg_clipfrac), float(own.ppo_kl)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    expected = torch.stack(every).mean(0)
    if rank == 0:
        assert every[0][0] == 0.0 < every[1][0], every  # the ranks' clip fractions differ
    got = torch.tensor([metrics["actor/pg_clipfrac"], metrics["actor/ppo_kl"]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_update_statistics_are_means_over_ranks():
    run_distributed(_body, 2)
