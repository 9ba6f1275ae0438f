"""Micro-batches when the ranks hold different rows (2 gloo ranks): every FSDP forward is a collective,
so every rank must run as many; the rank with fewer rows runs empty micro-batches up to the other's
count. Fixed size: rank 0 holds 5 rows and rank 1 holds 2, in micro-batches of 2: 3 forwards each. The
log-probs equal the unsharded model's on each rank's rows (without the agreement rank 0's third forward
waits for a rank that has finished: the run hangs until the timeout). Dynamic: the count and the budget
check agreed over the ranks as verl 0.9.1's."""

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
    # dynamic, 16 tokens: rank 0's five rows of 10 tokens need five micro-batches (four at first, ceil(50 / 16),
    # one of which would hold 20 tokens), so rank 1 runs five too, its two rows in the middle (equal work:
    # the later row first, the lightest, empty, at both ends): its first forward has no rows
    plan = plan_micro_batches(list(range(rows)), ro.lengths(), None, True, 16)
    assert plan == [[[0], [2], [4], [3], [1]], [[], [], [1], [0], []]][rank], plan
    actor.batching = MicroBatching(None, True, 16)
    logp, _ = actor.log_probs(ro)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)


def test_ranks_with_fewer_rows_run_as_many_micro_batches():
    run_distributed(_body, 2, timeout=120)


def _dynamic_body(rank, world_size):
    from trainer.roles import plan_micro_batches

    # Expected: verl 0.9.1's rearrange_micro_batches on 2 gloo ranks with these lengths (run outside the
    # repo). Rank 0's 43 tokens need ceil(43 / 23) = 2 parts, rank 1's 65 need 3: both start at 3. Rank 0's
    # balance at 3 keeps the budget, rank 1's does not (a part of 24 tokens), so both go to 4 (the budget
    # check agreed over the ranks): rank 0 a row a part.
    lengths = [[11, 8, 10, 14], [15, 5, 16, 11, 18]][rank]
    want = [[[2], [3], [0], [1]], [[1, 3], [4], [2], [0]]][rank]
    assert plan_micro_batches(list(range(len(lengths))), lengths, None, True, 23) == want
    # a rank with fewer rows than the count (verl refuses it): rank 1's one row and two empty parts, the
    # lightest (empty) at both ends
    lengths = [[9, 4, 12, 7, 3], [6]][rank]
    want = [[[1, 3], [2], [0, 4]], [[], [0], []]][rank]
    assert plan_micro_batches(list(range(len(lengths))), lengths, None, True, 16) == want


def test_dynamic_micro_batches_agree_over_ranks_as_verls():
    run_distributed(_dynamic_body, 2, timeout=120)
