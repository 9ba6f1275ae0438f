"""The replicated runtime of shard groups of one rank (`sharding.replicate`), on gloo.

`tests/multiproc/test_fsdp.py` checks that it trains exactly like one process; here, what is
particular to it: gradients accumulated over several backward passes, a parameter that one
rank's loss does not reach, a forward without grad between a forward and its backward, the
compute copies being the masters cast, the memory it frees between uses, and the gradients
handed over (all-reduced) in buckets while the backward still runs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from models import ModelArgs, Transformer, torch_dtypes
from sharding import FSDPConfig, ParallelDims, build_fsdp_model, no_gradient_sync, reshard_all
from sharding.replicate import replicated_params
from tests.dist_utils import run_distributed
from trainer.roles import _grad_norm_and_step

ARGS = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attention_bias=True)
FP32 = {"param_dtype": "fp32"}


def _batches(world: int, n: int = 4, seq: int = 10):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, ARGS["vocab_size"], (n, seq), generator=gen) for _ in range(world)]


def _loss(m, ids):
    return m(ids).float().pow(2).mean()


def _assert_replica_mean(model, ref, batches, world):
    """The masters' gradients are the replica mean of each rank's two micro-batches (rows :2 and
    2: of its batch), computed again on the unsharded reference."""
    expected = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        (_loss(ref, batches[r][:2]) + _loss(ref, batches[r][2:])).backward()
        for n, p in ref.named_parameters():
            expected[n] += p.grad / world
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def _body(rank, world):
    args = ModelArgs(**ARGS)
    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    model = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=1, mixed_precision=FP32), seed=0)
    rp = replicated_params(model)
    masters = list(model.parameters())
    ref = Transformer.build(args, seed=0)
    batches = _batches(world)

    # Two backward passes (two micro-batches), with forwards without grad in between: the
    # masters' gradients are the replica mean of the per-rank sums.
    ids = batches[rank]
    _loss(model, ids[:2]).backward()
    assert rp._compute_flats == []  # fp32 compute: the masters themselves, nothing cast
    with torch.no_grad():  # a forward without grad does not disturb the pending one below
        model(ids[:1])
    out = _loss(model, ids[2:])
    with torch.no_grad():
        model(ids[:1])
    assert rp._pending
    out.backward()
    assert not rp._pending and list(model.parameters()) == masters  # the masters are registered again
    _assert_replica_mean(model, ref, batches, world)

    # The gradients are DTensors over one buffer, the same objects every step; an optimizer
    # step updates the masters in place (their local tensors live in one flat buffer per dtype).
    grads = [p.grad for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _grad_norm_and_step(model, opt, 1.0)  # the trainer's step: clip, step, drop the gradients
    assert not rp._grads.allocated  # ... and their memory, for the phases after the update
    _loss(model, ids).backward()
    assert rp._grads.allocated and all(p.grad is g for p, g in zip(model.parameters(), grads))
    opt.zero_grad(set_to_none=True)
    reshard_all(model)  # what offload and the resharder's set-up call: the gradient buffer goes too
    assert not rp._grads.allocated

    # bf16 compute: the registered copies are the masters cast (one kernel), freed after use.
    model = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=1), seed=0)
    rp = replicated_params(model)
    cast = Transformer.build(args, seed=0)  # parameters in bf16, the RoPE table in fp32 (as apply_fsdp keeps it)
    with torch.no_grad():
        for p, q in zip(model.parameters(), cast.parameters()):
            p.to_local().mul_(1.0 + 1e-3 * rank)  # replicas that disagree would show below
            q.data = p.to_local().to(torch.bfloat16)
        assert torch.equal(model(ids), cast(ids))
    assert not rp._installed and not any(c.allocated for c, _ in rp._compute_flats)
    storages = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # every fp32 master in one buffer
    model(ids).float().mean().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    dist.barrier()


def test_replicated_runtime_accumulates_reduces_and_frees():
    run_distributed(_body, 2)


def _bucket_body(rank, world):
    """Small buckets: the backward hands them over (all-reduces them, with replicas) while it
    still runs, frees each bucket's compute gradients then, and the result is the same replica
    mean as one reduction at the end."""
    from sharding import comm

    args = ModelArgs(**ARGS)
    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    model = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=1, mixed_precision=FP32), seed=0)
    rp = replicated_params(model)
    rp.bucket_numel = 3000  # read when the buffers are laid out, at the first forward
    ref = Transformer.build(args, seed=0)
    batches = _batches(world)
    started = []
    real_async = comm.all_reduce_async
    comm.all_reduce_async = lambda t, **kw: started.append(t.numel()) or real_async(t, **kw)
    seen = []

    def at_first_block(module, grad_output):  # the backward reaches the first block
        handed = [rp._trainable[k] for lo, hi in rp._buckets[:rp._next] for k in range(lo, hi)]
        seen.append((rp._next, len(started), all(rp.compute[i].grad is None for i in handed)))

    model.layers[0].register_full_backward_pre_hook(at_first_block)
    try:
        ids = batches[rank]
        launches = []
        for part in (ids[:2], ids[2:]):  # two micro-batches: the second adds to the first's gradients
            started.clear()
            _loss(model, part).backward()
            launches.append(len(started))
    finally:
        comm.all_reduce_async = real_async
    # The buckets: contiguous ranges from the last parameter back to the first, each closed by the
    # parameter that takes it to the size (the last one holds what is left).
    numels = rp._grads.numels
    assert len(rp._buckets) >= 6 and rp._buckets[0][1] == len(rp._trainable) and rp._buckets[-1][0] == 0
    for (lo, hi), (lo2, hi2) in zip(rp._buckets, rp._buckets[1:]):
        assert hi2 == lo and sum(numels[lo:hi]) >= 3000 > sum(numels[lo + 1:hi])
    # Handed over during the backward: every bucket of the blocks after the first (their
    # gradients already freed), and with replicas their all-reduces already started.
    for handed, launched, freed in seen:
        assert handed >= 4 and freed
        assert launched == (handed if world > 1 else 0)
    assert launches == [len(rp._buckets) if world > 1 else 0] * 2 and len(seen) == 2
    _assert_replica_mean(model, ref, batches, world)


def test_gradients_are_handed_over_in_buckets_during_the_backward():
    run_distributed(_bucket_body, 2)


def test_one_rank_hands_buckets_into_the_gradient_buffer():
    run_distributed(_bucket_body, 1)


def _dropped_body(rank, world):
    """A dropped model is freed, masters and all, after a training step or none: the runtime's
    gradient hooks sit on tensors, where Python's cycle collector cannot see them, so they must
    not hold the runtime strongly (they did, and every model a process built stayed allocated)."""
    import gc
    import weakref

    from sharding.optim import ShardAdamW

    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    for step in (False, True):
        model = build_fsdp_model(ModelArgs(**ARGS), mesh, FSDPConfig(fsdp_size=1, mixed_precision=FP32), seed=0)
        if step:
            opt = ShardAdamW(model.parameters(), lr=1e-3)
            _loss(model, _batches(world)[rank]).backward()
            opt.step()
            del opt
        refs = [weakref.ref(replicated_params(model)), *(weakref.ref(p) for p in model.parameters())]
        del model
        gc.collect()
        assert all(r() is None for r in refs), (step, [type(r()).__name__ for r in refs if r() is not None])


def test_a_dropped_model_is_freed():
    run_distributed(_dropped_body, 1)


def _frozen_body(rank, world):
    """A frozen bf16 model (the reference) is computed from its masters: nothing is copied."""
    args = ModelArgs(**ARGS)
    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    ids = _batches(world)[rank]
    for keep in (False, True):
        ref = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=1, model_dtype="bf16", reshard_after_forward=not keep),
                               seed=0, trainable=False)
        rp = replicated_params(ref)
        with torch.no_grad():
            ref(ids)
        assert rp._compute_flats == [] and rp._installed == keep
        locals_ = {p.to_local().data_ptr() for p in rp.masters}
        assert {c.data_ptr() for c in rp.compute} == locals_
        reshard_all(ref)
        assert not rp._installed


def test_frozen_bf16_model_computes_from_its_masters():
    run_distributed(_frozen_body, 2)


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return self.b(y) if use_b else y


def _unused_body(rank, world, bucket_numel):
    """A parameter one rank's loss does not reach has no gradient there: it counts as zero in
    the replica mean, and the ranks' collectives stay in step (with a bucket per parameter, the
    rank that reaches `b` all-reduces every bucket during its backward, the other one all of
    them at its end, in the same order)."""
    from sharding.replicate import apply_replicated

    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    torch.manual_seed(0)
    model, ref = _TwoLayers(), _TwoLayers()
    ref.load_state_dict(model.state_dict())
    rp = apply_replicated(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                          keep_after_forward=False, shard_dim=lambda name, shape: 0, bucket_numel=bucket_numel)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for step in range(2):  # the second step accumulates onto the first's gradients
        model(xs[rank], use_b=rank == 0).pow(2).sum().backward()
    expected = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        ref(xs[r], use_b=r == 0).pow(2).sum().backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                expected[n] += 2 * p.grad / world
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert float(model.b.weight.grad.to_local().abs().sum()) > 0
    assert len(rp._buckets) == (4 if bucket_numel == 1 else 1)


@pytest.mark.parametrize("bucket_numel", [1, 1 << 25])
def test_a_parameter_one_rank_does_not_reach_counts_as_zero(bucket_numel):
    run_distributed(_unused_body, 2, bucket_numel)


def _no_sync_body(rank, world, reduce_dtype):
    """`no_gradient_sync`: micro-batches before the last add up unreduced, the last backward
    all-reduces everything once: the replica mean of all micro-batches, with one all-reduce per
    bucket in all. A reduce dtype like the gradients' reduces the gradient buffer in place (no
    second buffer); another goes through a staging buffer that lives only for that backward."""
    from sharding import comm, no_gradient_sync

    args = ModelArgs(**ARGS)
    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    model = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=1, mixed_precision={**FP32, "reduce_dtype": reduce_dtype}),
                             seed=0)
    rp = replicated_params(model)
    rp.bucket_numel = 3000
    ref = Transformer.build(args, seed=0)
    batches = _batches(world, n=6)
    started = []
    real_async = comm.all_reduce_async
    comm.all_reduce_async = lambda t, **kw: started.append(t.dtype) or real_async(t, **kw)
    try:
        ids = batches[rank]
        with no_gradient_sync(model):
            _loss(model, ids[:2]).backward()
            _loss(model, ids[2:4]).backward()
        assert not started and rp.sync_gradients  # nothing reduced so far; syncing again after the block
        if reduce_dtype == "fp32":
            assert rp._stage is None
        _loss(model, ids[4:]).backward()
    finally:
        comm.all_reduce_async = real_async
    assert len(started) == len(rp._buckets) and set(started) == {torch_dtypes()[reduce_dtype]}
    if rp._stage is not None:
        assert not rp._stage.allocated
    expected = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        sum(_loss(ref, batches[r][s:s + 2]) for s in (0, 2, 4)).backward()
        for n, p in ref.named_parameters():
            expected[n] += p.grad / world
    tol = dict(rtol=1e-5, atol=1e-7) if reduce_dtype == "fp32" else dict(rtol=2e-2, atol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[n], **tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_no_gradient_sync_defers_the_reduction_to_the_last_backward(reduce_dtype):
    run_distributed(_no_sync_body, 2, reduce_dtype)


def _flat_clip_body(rank, world):
    """After a backward the runtime hands out its gradient buffer (every master's gradient a view
    of it); clipping that buffer (one norm, one scale) gives the norm of the whole gradient and
    the gradients that clipping each one (`clip_grad_norm_` without `flat`) gives. Without
    gradients (after `zero_grad`) there is no buffer to hand out."""
    from sharding.grad_norm import clip_grad_norm_

    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    models = [build_fsdp_model(ModelArgs(**ARGS), mesh, FSDPConfig(fsdp_size=1), seed=0) for _ in range(2)]
    rps = [replicated_params(m) for m in models]
    ids = _batches(world)[rank]
    for m in models:
        _loss(m, ids).backward()
    flat = rps[0].flat_gradients()
    assert flat is not None and flat.numel() == sum(p.numel() for p in models[0].parameters())
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    assert all(lo <= p.grad.to_local().data_ptr() < hi for p in models[0].parameters())
    whole = torch.cat([p.grad.full_tensor().reshape(-1) for p in models[0].parameters()]).double()
    max_norm = 0.5 * float(whole.norm())  # clips by a half
    a = clip_grad_norm_(models[0].parameters(), max_norm, flat=flat)
    b = clip_grad_norm_(models[1].parameters(), max_norm)
    # float32 sums of ~60k squares in different orders: a few 1e-6 apart; a wrong scale or a
    # missing gradient would be off by far more than 1e-4
    torch.testing.assert_close(a.double(), whole.norm(), rtol=1e-4, atol=0)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=0)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-4, atol=1e-9)
    assert torch.linalg.vector_norm(flat.double()).item() == pytest.approx(max_norm, rel=1e-4)
    for p in models[0].parameters():
        p.grad = None
    assert rps[0].flat_gradients() is None


def test_clipping_the_gradient_buffer_as_one_tensor():
    run_distributed(_flat_clip_body, 2)
    run_distributed(_flat_clip_body, 1)


def _kept_body(rank, world):
    """`keep_compute_copies`: the micro-batches of a mini-batch, and the forwards of a no-grad
    phase, share one cast of the masters (bf16 copies registered from the first forward to the
    end of the scope, then freed), with gradients and outputs bit for bit those of one cast per
    forward."""
    from sharding import keep_compute_copies

    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    models = [build_fsdp_model(ModelArgs(**ARGS), mesh, FSDPConfig(fsdp_size=1), seed=0) for _ in range(2)]
    casts = [0, 0]
    for i, m in enumerate(models):
        rp = replicated_params(m)
        install = rp.install

        def counted(rp=rp, install=install, i=i):
            casts[i] += not rp._installed
            install()
        rp.install = counted
    ids = _batches(world)[rank]
    masters = list(models[0].parameters())
    with keep_compute_copies(models[0]):
        for k in range(3):
            with no_gradient_sync(models[0]) if k < 2 else contextlib.nullcontext():
                _loss(models[0], ids[k:k + 2]).backward()
        rp = replicated_params(models[0])
        assert rp._installed and all(c.allocated for c, _ in rp._compute_flats)
    assert not rp._installed and not any(c.allocated for c, _ in rp._compute_flats)
    assert list(models[0].parameters()) == masters
    for k in range(3):
        with no_gradient_sync(models[1]) if k < 2 else contextlib.nullcontext():
            _loss(models[1], ids[k:k + 2]).backward()
    assert casts == [1, 3]
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())
    with torch.no_grad():
        with keep_compute_copies(models[0]):
            kept = [models[0](ids[k:k + 1]) for k in range(3)]
        each = [models[1](ids[k:k + 1]) for k in range(3)]
    assert casts == [2, 6] and all(torch.equal(a, b) for a, b in zip(kept, each))
    assert not replicated_params(models[0])._installed


def test_keep_compute_copies_casts_once_per_scope():
    run_distributed(_kept_body, 2)
