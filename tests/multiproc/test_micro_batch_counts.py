"""Fixed-size micro-batches when the ranks hold different numbers of rows (2 gloo ranks, FSDP2): every
FSDP forward is a collective, so every rank must run as many; the rank with fewer rows runs empty
micro-batches up to the other's count. Rank 0 holds 5 rows and rank 1 holds 2, in micro-batches of
2: 3 forwards each. The log-probs equal the unsharded model's on each rank's rows (without the
agreement rank 0's third forward waits for a rank that has finished: the run hangs until the
timeout)."""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.gpu.multi_gpu_checks import UPDATE_MODEL, _rollouts


def _body(rank, world_size):
    from models import ModelArgs, Transformer
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from trainer.roles import Actor, MicroBatching, plan_micro_batches

    cpu = torch.device("cpu")
    args = ModelArgs(**UPDATE_MODEL)
    g = torch.Generator().manual_seed(rank)
    rows = (5, 2)[rank]
    prompts = [torch.randint(2, args.vocab_size, (6,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(2, args.vocab_size, (4,), generator=g).tolist() for _ in range(rows)]
    ro = _rollouts(prompts, responses, 4, cpu)
    assert len(plan_micro_batches(list(range(rows)), ro.lengths(), 2, False, 0)) == 3
    meshes = ParallelDims(world_size, fsdp_size=-1).build_meshes("cpu")
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=-1, mixed_precision={"param_dtype": "fp32"}),
                             device=cpu, seed=0)
    batching = MicroBatching(2, False, 0)
    actor = Actor(model, None, None, packed=True, temperature=1.0, pad_token_id=0, device=cpu, world_size=world_size,
                  response_length=4, batching=batching)
    logp, _ = actor.log_probs(ro)
    reference = Actor(Transformer.build(args, seed=0), None, None, packed=True, temperature=1.0, pad_token_id=0,
                      device=cpu, world_size=1, response_length=4, batching=MicroBatching(None, False, 0))
    want, _ = reference.log_probs(ro)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)


def test_ranks_with_fewer_rows_run_as_many_micro_batches():
    run_distributed(_body, 2, timeout=120)
