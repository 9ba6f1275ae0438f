"""FSDP2 training equals single-process training (gloo, CPU, float32).

Every rank trains the unsharded reference on the whole global batch and the FSDP model on its
slice of it; the per-rank loss is the mean over equal-sized slices, so FSDP's gradient average
is the global mean and the parameters must agree to float32 reduction-order noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from models import ModelArgs, Transformer, tp_shard_dim
from sharding import FSDPConfig, ParallelDims, build_fsdp_model
from sharding.replicate import replicated_params
from tests.dist_utils import run_distributed

ARGS = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attention_bias=True)
GLOBAL_BATCH, SEQ, STEPS = 8, 12, 2


def _loss(model, ids, head):
    if head == "value":
        return model(ids).pow(2).mean()
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _train(model, batches, head):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, ids, head)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _check_equivalent(mesh, cfg, *, tie=False, head="lm", seed=0, **build_kw):
    """Train on `mesh` (1-D FULL_SHARD or 2-D HSDP; every rank of it is a data-parallel rank)."""
    args = ModelArgs(**ARGS, tie_word_embeddings=tie)
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, args.vocab_size, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(STEPS)]
    ref = Transformer.build(args, head=head, seed=seed)
    ref_losses = _train(ref, batches, head)

    model = build_fsdp_model(args, mesh, cfg, head=head, seed=seed, **build_kw)
    dp_size, dp_rank = mesh.size(), _dp_rank(mesh)
    per = GLOBAL_BATCH // dp_size
    losses = _train(model, [b[dp_rank * per:(dp_rank + 1) * per] for b in batches], head)

    ref_sd = ref.state_dict()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), ref_sd[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    group = mesh.get_group() if mesh.ndim == 1 else None  # the 2-D meshes here span the world
    for loss, ref_loss in zip(losses, ref_losses):
        mean = loss.clone()
        dist.all_reduce(mean, group=group)
        torch.testing.assert_close(mean / dp_size, ref_loss, rtol=1e-5, atol=1e-6)
    return model


def _dp_rank(mesh):
    coord = mesh.get_coordinate()
    return coord[0] * mesh.size(1) + coord[1] if mesh.ndim > 1 else coord[0]


def _body(rank, world):
    fp32 = {"param_dtype": "fp32"}
    # FULL_SHARD over 2 ranks: ranks {0, 1} and {2, 3} each form an independent 1-D mesh and
    # run the same training (one process launch serves the 2-rank and the 4-rank cases).
    pair = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp_shard"))["dp_shard"]
    model = _check_equivalent(pair, FSDPConfig(mixed_precision=fp32))
    # The placement follows the TP plan: row-parallel weights on dim 1, the rest on dim 0.
    for name, p in model.named_parameters():
        assert p.placements == (Shard(tp_shard_dim(name) or 0),), (name, p.placements)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 6, [type(m).__name__ for m in units]  # embed, 2 blocks, norm + lm_head, root

    # Variants on the same data: tied embeddings (embedding in the root unit), a critic,
    # prefetch chains + checkpointing + activation offload, blocks grouped by wrap_policy with
    # no reshard after forward.
    _check_equivalent(pair, FSDPConfig(mixed_precision=fp32), tie=True)
    critic = _check_equivalent(pair, FSDPConfig(mixed_precision=fp32), head="value")
    # FSDP2 hooks each unit's output for backward, and an in-place op on a view output would skip
    # that hook (torch 2.13 warns): the value head's unit and the root hand back fresh tensors.
    views = []
    for unit in (critic.score, critic):
        unit.register_forward_hook(lambda mod, args, out: views.append(type(mod).__name__) if out._base is not None
                                   else None)
    critic(torch.randint(0, ARGS["vocab_size"], (2, SEQ))).sum().backward()
    assert not views, f"units returning a view: {views}"
    _check_equivalent(pair, FSDPConfig(mixed_precision=fp32, forward_prefetch=True),
                      enable_gradient_checkpointing=True, enable_activation_offload=True)
    grouped = _check_equivalent(pair, FSDPConfig(mixed_precision=fp32, reshard_after_forward=False,
                                                 wrap_policy={"min_num_params": 10**6}))
    assert sum(isinstance(b, FSDPModule) for b in grouped.layers) == 2  # one unit spanning both blocks
    assert grouped.layers[0]._get_fsdp_state() is grouped.layers[1]._get_fsdp_state()
    _mixed_precision_checks(pair)
    with pytest.raises(ValueError, match="one mesh for all models"):  # a critic asking for another shard size
        build_fsdp_model(ModelArgs(**ARGS), pair, FSDPConfig(fsdp_size=4), head="value")

    # A one-rank mesh (a single GPU): no FSDP2 unit, the replicated runtime, and still exact.
    solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("solo", "dp_shard"))["dp_shard"]
    for tie, head in ((False, "lm"), (True, "lm"), (False, "value")):
        model = _check_equivalent(solo, FSDPConfig(mixed_precision=fp32), tie=tie, head=head)
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        assert replicated_params(model) is not None
        for name, p in model.named_parameters():
            assert p.placements == (Shard(tp_shard_dim(name) or 0),), (name, p.placements)
    _check_equivalent(solo, FSDPConfig(mixed_precision=fp32), enable_gradient_checkpointing=True,
                      enable_activation_offload=True)
    _mixed_precision_checks(solo)

    # FULL_SHARD over all 4 ranks, then HYBRID_SHARD 2 x 2, built from ParallelDims.
    meshes = ParallelDims(world).build_meshes("cpu")
    assert meshes.train.mesh_dim_names == ("dp_shard",)
    _check_equivalent(meshes.train, FSDPConfig(mixed_precision=fp32))
    meshes = ParallelDims(world, fsdp_size=2).build_meshes("cpu")
    model = _check_equivalent(meshes.train, FSDPConfig(fsdp_size=2, mixed_precision=fp32))
    p = model.layers[0].self_attn.o_proj.weight
    assert p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert p.placements == (Replicate(), Shard(1))
    assert p.to_local().shape == (64, 32)  # 64 input features over 2 shard ranks

    # HYBRID_SHARD with shard groups of one (data parallelism): nothing is sharded, so the whole
    # model is one unit whose gradients are all-reduced over the 4 replicas, and still exact.
    meshes = ParallelDims(world, fsdp_size=1).build_meshes("cpu")
    model = _check_equivalent(meshes.train, FSDPConfig(fsdp_size=1, mixed_precision=fp32))
    assert replicated_params(model) is not None and not any(isinstance(m, FSDPModule) for m in model.modules())
    p = model.layers[0].self_attn.o_proj.weight
    assert p.placements == (Replicate(), Shard(1))
    _mixed_precision_checks(meshes.train)
    # With parameters on the CPU (offload_policy) FSDP2 keeps the model, as one unit.
    model = _check_equivalent(meshes.train, FSDPConfig(fsdp_size=1, mixed_precision=fp32, offload_policy=True))
    assert [m for m in model.modules() if isinstance(m, FSDPModule)] == [model]


def _mixed_precision_checks(mesh):
    # bf16 compute with fp32 master weights and gradients; a bf16 frozen reference model.
    args = ModelArgs(**ARGS)
    model = build_fsdp_model(args, mesh, FSDPConfig(), seed=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    logits.float().mean().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    ref = build_fsdp_model(args, mesh, FSDPConfig(model_dtype="bf16"), seed=0, trainable=False)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).float(), logits.detach().float(), rtol=0.05, atol=0.05)
    _frozen_keeps_gathered(mesh, args, ids)


def _frozen_keeps_gathered(mesh, args, ids):
    """A frozen model resharding after forward (the default) holds only its shards between
    passes; with `reshard_after_forward=False` every unit keeps its gathered (bf16) parameters
    from the first forward on, so later passes gather nothing, and computes the same."""
    def gathered(model):
        rp = replicated_params(model)
        if rp is not None:  # shard groups of one rank: the compute copies are registered or not
            return [rp._installed]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
        return [g.is_unsharded for g in groups if g is not None]  # a unit that owns no parameter has no group

    outs = {}
    for keep in (False, True):
        ref = build_fsdp_model(args, mesh, FSDPConfig(reshard_after_forward=not keep), seed=0, trainable=False)
        with torch.no_grad():
            first = ref(ids)
            assert set(gathered(ref)) == {keep}, (keep, gathered(ref))
            if keep:
                assert not any(isinstance(p, DTensor) for p in ref.parameters())  # the gathered ones are registered
                assert all(p.dtype == torch.bfloat16 for p in ref.parameters())
            second = ref(ids)
        assert torch.equal(first, second)
        outs[keep] = first
    assert torch.equal(outs[False], outs[True])


def test_fsdp_full_shard_2_and_4_ranks_and_hsdp_2x2_match_single_process():
    run_distributed(_body, 4)


def _saved_bytes_and_grads(model, ids):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, ids, "lm")
    loss.backward()
    return sum(saved), {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_and_offload_keep_gradients_and_save_less():
    """Single process: the per-block wrappers change what autograd keeps, never the gradients."""
    from sharding import apply_ac

    args = ModelArgs(**ARGS)
    ids = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    base_bytes, base_grads = _saved_bytes_and_grads(Transformer.build(args, seed=0), ids)
    for ckpt, offload in ((True, False), (False, True), (True, True)):
        model = apply_ac(Transformer.build(args, seed=0), ckpt, offload)
        # Inside a block, the checkpoint's / offloader's hooks take over from the outer hook; what
        # the outer hook still sees is saved outside the blocks (embedding, head, loss).
        outside_bytes, grads = _saved_bytes_and_grads(model, ids)
        assert outside_bytes < base_bytes / 2, (ckpt, offload, outside_bytes, base_bytes)
        assert [n for n, _ in model.named_parameters()] == list(base_grads)  # names unchanged
        for n, g in grads.items():
            torch.testing.assert_close(g, base_grads[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
        with pytest.raises(RuntimeError, match="already applied"):
            apply_ac(model, ckpt, offload)


def _offload_fsdp_body(rank, world):
    """Under FULL_SHARD the projections save FSDP2's unsharded parameters, whose storage FSDP2
    frees after each block's forward: the offloader must leave them (a copy stream reading them
    would race the free) and move the activations, and the update stays the reference's."""
    from sharding.ac import activation_offloader

    mesh = ParallelDims(world).build_meshes("cpu").train
    cfg = FSDPConfig(mixed_precision={"param_dtype": "fp32"})
    moved = []

    def spy(off):
        pack = off.pack

        def record(t):
            out = pack(t)
            if hasattr(out, "host"):
                moved.append(t)
            return out
        return record

    def build(seed=0, **kw):
        model = build_fsdp_model(ModelArgs(**ARGS), mesh, cfg, seed=seed, **kw)
        off = activation_offloader(model)
        if off is not None:
            off.min_bytes, off.pack = 0, spy(off)
        return model

    ids = torch.randint(0, ARGS["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(rank))
    grads = []
    for kw in ({}, {"enable_activation_offload": True},
               {"enable_activation_offload": True, "enable_gradient_checkpointing": True}):
        model = build(**kw)
        assert isinstance(model, FSDPModule)
        _loss(model, ids, "lm").backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        if kw:
            assert moved and not any(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                                     for t in moved)
            moved.clear()
    for g in grads[1:]:
        for n, ref in grads[0].items():
            torch.testing.assert_close(g[n], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_offloaded_activations_under_full_shard():
    run_distributed(_offload_fsdp_body, 2)


def _grad_norm_body(rank, world):
    from sharding.grad_norm import clip_grad_norm_

    args = ModelArgs(**ARGS)
    ids = torch.randint(0, args.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(rank))
    pair = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp_shard"))["dp_shard"]
    hsdp = ParallelDims(world, fsdp_size=2).build_meshes("cpu").train
    for mesh, max_norm in ((pair, 0.5), (hsdp, 0.5), (hsdp, 1e6)):
        model = build_fsdp_model(args, mesh, FSDPConfig(mixed_precision={"param_dtype": "fp32"}), seed=0)
        _loss(model, ids, "lm").backward()
        before = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before.values()]))
        norm = clip_grad_norm_(list(model.parameters()), max_norm)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6)
        scale = min(1.0, max_norm / (float(expected) + 1e-6))
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), before[n] * scale, rtol=1e-5, atol=1e-7, msg=n)
        if max_norm < float(expected):
            total = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in model.parameters()]))
            torch.testing.assert_close(total, torch.tensor(max_norm), rtol=1e-4, atol=1e-6)
    # plain tensors (no process group involved)
    g = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in g]
    for p, x in zip(params, g):
        p.grad = x.clone()
    assert abs(float(clip_grad_norm_(params, 1.0)) - 4.0) < 1e-6  # sqrt(3*4 + 4*1)
    assert abs(float(params[0].grad[0]) - 0.5) < 1e-5


def test_clip_grad_norm_over_shards_matches_the_full_gradient():
    run_distributed(_grad_norm_body, 4)


def _no_sync_hsdp_body(rank, world):
    """HYBRID_SHARD under FSDP2 (2 replicas x 2 shards): inside `no_gradient_sync` a backward
    reduce-scatters in its shard group but does not all-reduce over the replicas; the next
    backward outside all-reduces what was accumulated. The gradients are the mean over every
    rank's micro-batches, as without it."""
    from sharding import no_gradient_sync

    args = ModelArgs(**ARGS)
    mesh = ParallelDims(world, fsdp_size=2).build_meshes("cpu").train
    model = build_fsdp_model(args, mesh, FSDPConfig(fsdp_size=2, mixed_precision={"param_dtype": "fp32"}), seed=0)
    ref = Transformer.build(args, seed=0)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, ARGS["vocab_size"], (3, SEQ), generator=gen) for _ in range(world)]
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with no_gradient_sync(model):
            _loss(model, batches[rank][:1], "lm").backward()
            _loss(model, batches[rank][1:2], "lm").backward()
        deferred = len(calls)
        _loss(model, batches[rank][2:], "lm").backward()
    finally:
        dist.all_reduce = real
    assert deferred == 0 and len(calls) > 0
    expected = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        sum(_loss(ref, batches[r][s:s + 1], "lm") for s in range(3)).backward()
        for n, p in ref.named_parameters():
            expected[n] += p.grad / world
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_no_gradient_sync_defers_hsdp_all_reduce():
    run_distributed(_no_sync_hsdp_body, 4)
