"""Sharding on a CUDA GPU: resharding into the engine, offload freeing device memory, activation
checkpointing / offload lowering the peak, and the side-stream pipeline. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models import ModelArgs  # noqa: E402
from rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from sharding import (FSDPConfig, ParallelDims, Resharder, build_fsdp_model, load_full_tensors,  # noqa: E402
                      load_states, offload_fsdp_model_to_cpu, offload_states, offloaded_tensors, release_gradients)
from tests.dist_utils import run_distributed  # noqa: E402

DEV = torch.device("cuda", 0)
SMALL = ModelArgs(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=256, model_type="qwen2", attention_bias=True,
                  tie_word_embeddings=True)


def _peaky_weights(model, seed):
    """Weights large enough for non-degenerate greedy decoding."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        yield name, (1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                     else 0.15 * torch.randn(p.shape, generator=g))


def _train_step(model, opt, vocab, seed=0, batch=2, seq=64):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEV)
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, vocab).float(), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    release_gradients(model)  # as the trainer's update does after each step


def _engine(args, dtype, meshes):
    cfg = EngineConfig(dtype=dtype, max_model_len=128, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    return LLMEngine(args, cfg, tp_mesh=meshes.tp, device=DEV)


def test_reshard_one_gpu_is_a_bitwise_cast_copy(meshes):
    model = build_fsdp_model(SMALL, meshes.train, FSDPConfig(), device=DEV)
    load_full_tensors(model, _peaky_weights(model, seed=1))
    _train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), SMALL.vocab_size)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}

    engine = _engine(SMALL, torch.bfloat16, meshes)
    resharder = Resharder(model, meshes, engine)
    for method in (resharder.reshard, resharder.reshard_naive):
        for slot in engine.param_slots().values():
            slot.view.fill_(float("nan"))
        stats = method()
        torch.cuda.synchronize()
        assert stats.bytes_received == 0
        assert stats.naive or stats.num_collectives == 0  # one GPU: a pure cast-copy
        for name, slot in engine.param_slots().items():
            assert torch.equal(slot.view, full[name].to(torch.bfloat16)), name

    # Same weights through the engine's reference loading path: the same greedy tokens.
    reference = _engine(SMALL, torch.bfloat16, meshes)
    reference.load_weights(full.items())
    prompts = [[1, 2, 3, 4], [100, 7], [9] * 17]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == [o.token_ids for o in reference.generate(prompts, sp)]
    assert len({t for g in got for t in g}) > 3


def test_frozen_reference_kept_gathered_on_cuda(meshes):
    """`reshard_after_forward=False` on a frozen bf16-compute reference: after the first forward
    its parameters stay gathered on the GPU (registered plain bf16 CUDA tensors), a second
    forward allocates no new parameter memory and gives the same logits as a resharding one."""
    from torch.distributed.tensor import DTensor

    ids = torch.randint(0, SMALL.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)).to(DEV)
    logits = {}
    for keep in (False, True):
        ref = build_fsdp_model(SMALL, meshes.train, FSDPConfig(reshard_after_forward=not keep), device=DEV,
                               trainable=False)
        load_full_tensors(ref, _peaky_weights(ref, seed=1))
        with torch.no_grad():
            first = ref(ids)
            params = list(ref.parameters())
            assert all(isinstance(p, DTensor) for p in params) != keep
            if keep:
                assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in params)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            second = ref(ids)
            if keep:
                del second
                torch.cuda.synchronize()
                # the second pass's activations are freed and no second gathered copy was made
                # (that would be the whole model in bf16 again)
                gathered = sum(p.numel() * p.element_size() for p in params)
                assert torch.cuda.memory_allocated() - before < gathered / 4
                second = ref(ids)
        assert torch.equal(first, second)
        logits[keep] = first
    assert torch.equal(logits[False], logits[True])


def test_param_and_optimizer_offload_free_device_memory(meshes):
    args = ModelArgs(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
    cfg = FSDPConfig(param_offload=True, optimizer_offload=True)
    model = build_fsdp_model(args, meshes.train, cfg, device=DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, opt, args.vocab_size, seq=32)
    param_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    params = {n: p.to_local().cpu() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].to_local().cpu() for n, p in model.named_parameters()}
    gc.collect()  # earlier tests' models (cyclic garbage) freed now, not between the readings
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(DEV)

    offload_fsdp_model_to_cpu(model)
    torch.cuda.synchronize()
    after_params = torch.cuda.memory_allocated(DEV)
    offload_states(model, opt, FSDPConfig(optimizer_offload=True))  # the optimizer half of offload_states
    torch.cuda.synchronize()
    after_optim = torch.cuda.memory_allocated(DEV)
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(s["exp_avg"].to_local().untyped_storage().nbytes() == 0 for s in opt.state.values())
    assert all(h.device.type == "cpu" and h.is_pinned() for h in offloaded_tensors(model) + offloaded_tensors(opt))
    # The fp32 shards, then the two Adam moments, must leave the device.
    freed_params, freed_optim = before - after_params, after_params - after_optim
    ok = freed_params >= 0.95 * param_bytes and freed_optim >= 0.95 * 2 * param_bytes
    assert ok, (freed_params, freed_optim, param_bytes, _alive_cuda_tensors())

    load_states(model, opt, cfg, DEV)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(DEV) >= before - 0.05 * param_bytes
    for n, p in model.named_parameters():
        assert p.to_local().device == DEV and torch.equal(p.to_local().cpu(), params[n]), n
        assert torch.equal(opt.state[p]["exp_avg"].to_local().cpu(), moments[n]), n
    # FSDP must gather from the restored shards, not from storage it kept from before: zero the
    # LM head's shard in place and the logits must be zero.
    with torch.no_grad():
        model.lm_head.weight.to_local().zero_()
        assert model(torch.zeros(1, 4, dtype=torch.long, device=DEV)).abs().max().item() == 0.0
    _train_step(model, opt, args.vocab_size, seq=32)


def test_replicated_runtime_and_shard_adamw_on_cuda(meshes):
    """One GPU (a shard group of one rank, `sharding.replicate`): the fp32 masters live in one
    buffer, the bf16 copy only from a forward to the end of its backward, the gradient buffer
    only until the trainer's step drops it, and nothing grows from step to step; `ShardAdamW`
    (fused, as one flat call over those buffers) updates bit for bit as `torch.optim.AdamW`
    (fused, through DTensor), a skipped step (`found_inf`) included; gradients handed over in small buckets
    during the backward (hooks on the autograd thread, a copy per bucket) update bit for bit as
    one bucket at its end."""
    from sharding.optim import ShardAdamW
    from sharding.replicate import replicated_params

    results = []
    for cls, bucket_numel in ((torch.optim.AdamW, None), (ShardAdamW, None), (ShardAdamW, 50_000)):
        model = build_fsdp_model(SMALL, meshes.train, FSDPConfig(), device=DEV)
        load_full_tensors(model, _peaky_weights(model, seed=1))
        rp = replicated_params(model)
        if bucket_numel:
            rp.bucket_numel = bucket_numel  # read when the buffers are laid out, at the first forward
        opt = cls(model.parameters(), lr=1e-3, fused=True)
        after = []
        for step in range(3):
            ids = torch.randint(0, SMALL.vocab_size, (2, 64), generator=torch.Generator().manual_seed(step)).to(DEV)
            logits = model(ids[:, :-1])
            assert rp._installed and all(c.allocated for c, _ in rp._compute_flats)
            F.cross_entropy(logits.reshape(-1, SMALL.vocab_size).float(), ids[:, 1:].reshape(-1)).backward()
            assert not rp._installed and not any(c.allocated for c, _ in rp._compute_flats)
            assert rp._grads.allocated and all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.found_inf = torch.tensor(1.0 if step == 1 else 0.0, device=DEV)
            opt.step()
            opt.zero_grad(set_to_none=True)
            release_gradients(model)
            assert not rp._grads.allocated
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated(DEV))
        assert after[2] <= after[1] + (1 << 20), after
        assert len({p.to_local().untyped_storage().data_ptr() for p in model.parameters()}) == 1
        assert float(opt.state[next(model.parameters())]["step"]) == 2  # the flagged step was skipped
        assert getattr(opt, "last_step_flat", True)  # ShardAdamW: one flat call over the runtime's buffers
        assert len(rp._buckets) == (1 if bucket_numel is None else 21)
        results.append([t.to_local().clone() for p in model.parameters()
                        for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_no_gradient_sync_leaves_offloaded_units_reducing(meshes):
    """`no_gradient_sync` defers FSDP2's all-reduce over replicas by keeping the sharded sums on
    the device; with `offload_policy` that would hold device memory the offload is there to
    save, so units whose parameters live in host memory keep reducing at every backward."""
    from torch.distributed.fsdp import FSDPModule

    from sharding import no_gradient_sync
    from sharding.fsdp import _params_offloaded

    offloaded = build_fsdp_model(SMALL, meshes.train, FSDPConfig(offload_policy=True), device=DEV)
    assert _params_offloaded(offloaded)
    assert not _params_offloaded(build_fsdp_model(SMALL, meshes.train, FSDPConfig(), device=DEV))
    groups = [m._get_fsdp_state()._fsdp_param_group for m in offloaded.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    assert groups
    with no_gradient_sync(offloaded):
        assert all(g.all_reduce_grads for g in groups)


def _alive_cuda_tensors(min_bytes=1 << 20):
    """What still holds device memory (for the failure message): the largest live CUDA tensors and who refers to them."""
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and not obj._is_view():
                nbytes = obj.untyped_storage().nbytes()
                if nbytes >= min_bytes:
                    owners = []
                    for r in gc.get_referrers(obj)[:6]:
                        if isinstance(r, dict):  # an object's __dict__: name the object
                            r = next((o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r), r)
                        owners.append(type(r).__name__)
                    found.append((nbytes, type(obj).__name__, tuple(obj.shape), owners))
        except Exception:  # noqa: BLE001 - objects in odd states during the scan are skipped
            continue
    found.sort(reverse=True)
    return sum(f[0] for f in found), found[:12]


AC_ARGS = ModelArgs(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
AC_BATCH = (4, 2048)


def _peak_train_bytes(meshes, **ac):
    """Bytes allocated after the forward and at the peak of the pass, the peak reserved bytes (all
    above what was there before), the gradients, and whether the host waited for the GPU during
    the backward."""
    model = build_fsdp_model(AC_ARGS, meshes.train, FSDPConfig(), device=DEV, **ac)
    ids = torch.randint(0, AC_ARGS.vocab_size, AC_BATCH, generator=torch.Generator().manual_seed(0)).to(DEV)
    model(ids).float().mean().backward()  # warm-up: pinned host blocks
    model.zero_grad(set_to_none=True)
    # The models of earlier calls are cyclic garbage (FSDP's state and its modules refer to each
    # other): collected now, not by a collection that falls inside the measured pass (one did,
    # once, and freed an earlier model's 76 MiB of parameters during the forward).
    gc.collect()
    gc.disable()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # reserved = allocated: the pass's own segments count
        base, base_reserved = torch.cuda.memory_allocated(DEV), torch.cuda.memory_reserved(DEV)
        torch.cuda.reset_peak_memory_stats(DEV)
        loss = model(ids).float().mean()
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated(DEV) - base
        # Two seconds of GPU sleep ahead of the backward: if the host returns from it while the GPU
        # still sleeps, nothing in it waited for the GPU (a blocking copy back would have).
        torch.cuda._sleep(4_000_000_000)
        loss.backward()
        backward_waited = torch.cuda.current_stream(DEV).query()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
    del model, loss
    peaks = (after_forward, torch.cuda.max_memory_allocated(DEV) - base,
             torch.cuda.max_memory_reserved(DEV) - base_reserved)
    return peaks, grads, backward_waited


def test_activation_checkpointing_and_offload_lower_the_peak(meshes):
    plain, g0, w0 = _peak_train_bytes(meshes)
    ckpt, g1, w1 = _peak_train_bytes(meshes, enable_gradient_checkpointing=True)
    offl, g2, w2 = _peak_train_bytes(meshes, enable_activation_offload=True)
    both, g3, w3 = _peak_train_bytes(meshes, enable_gradient_checkpointing=True, enable_activation_offload=True)
    print("MiB after forward / peak / peak reserved: " + ", ".join(
        f"{k} " + " / ".join(f"{b / 2**20:.1f}" for b in v)
        for k, v in (("plain", plain), ("checkpointing", ckpt), ("offload", offl), ("both", both))))
    # After the forward the moved tensors hold no device memory. With checkpointing they are the
    # inputs of blocks 0-4 (the last block keeps its own), 8 MiB each in bf16.
    block_input = AC_BATCH[0] * AC_BATCH[1] * AC_ARGS.hidden_size * 2
    assert 4.5 * block_input < ckpt[0] - both[0] < 5.5 * block_input, (ckpt[0], both[0])
    # Without checkpointing, five of the six blocks' activations: at least four blocks' worth gone.
    per_block = (plain[0] - ckpt[0]) / AC_ARGS.num_hidden_layers
    assert offl[0] < plain[0] - 4 * per_block, (offl[0], plain[0], per_block)
    assert ckpt[1] < 0.6 * plain[1], (ckpt, plain)
    assert offl[1] < 0.75 * plain[1] and offl[2] < 0.9 * plain[2], (offl, plain)
    # Reserved peaks depend on how the allocator's segments happen to fit (the earlier tests' live
    # tensors among them), so they are bounded against the plain pass, not against each other.
    assert both[1] <= ckpt[1] and both[2] < 0.5 * plain[2], (both, ckpt, plain)
    assert (w2, w3) == (w0, w1), "the offloaded backward waited for the GPU where the plain one did not"
    # The attention's backward accumulates with atomics, so two runs of the same model differ in
    # the last bits (the CPU test checks the offloaded gradients bit for bit). A tensor that came
    # back wrong, or was overwritten before its copy, is far outside 1 % of the gradient's norm.
    for n in g0:
        for name, g, ref in (("offload", g2, g0), ("both", g3, g1), ("checkpointing", g1, g0)):
            err = (g[n] - ref[n]).norm() / ref[n].norm()
            assert err < 0.01, (name, n, err.item())



def _compiled_pass(meshes, **ac):
    """Unique graphs Dynamo compiled for two passes of a 10-block model (more blocks than Dynamo's
    recompile limit of 8) compiled as the trainer compiles it, the gradients, and the offload
    stats."""
    from torch._dynamo.utils import counters

    from sharding.ac import activation_offloader
    from sharding.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    args = dataclasses.replace(AC_ARGS, num_hidden_layers=10)
    model = build_fsdp_model(args, meshes.train, FSDPConfig(), device=DEV, enable_gradient_checkpointing=True, **ac)
    apply_compile(model)
    for seq in (1024, 1536):  # a second length: dynamic shapes, no recompilation
        ids = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq)).to(DEV)
        model(ids).float().mean().backward()
    grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
    offloader = activation_offloader(model)
    return counters["stats"]["unique_graphs"], grads, offloader and offloader.stats


def test_compiled_checkpointed_blocks_offload_without_recompiling(meshes):
    plain, g0, _ = _compiled_pass(meshes)
    offloaded, g1, stats = _compiled_pass(meshes, enable_activation_offload=True)
    assert plain > 0, "nothing was compiled"
    # The offloader's per-block bookkeeping stays out of the graphs: it adds no compilations.
    assert offloaded == plain, (offloaded, plain)
    # Under compile the checkpointed block's inputs still leave the device, all blocks but the last.
    assert set(stats.bytes_by_block) == set(range(9)), stats
    for n in g0:
        err = (g1[n] - g0[n]).norm() / g0[n].norm()
        assert err < 0.01, (n, err.item())


GLOO_CUDA = "gloo cannot all-gather CUDA tensors here"


def _pipeline_body(rank, world):
    # Two ranks on one GPU (NCCL refuses that; gloo stages CUDA tensors through the host). What
    # this exercises is the side-stream pipeline: packing and gathers on a side stream, copies
    # on the default stream, events between them, double buffers.
    torch.cuda.set_device(0)
    probe = torch.full((2,), float(rank), device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, device="cuda", dtype=torch.bfloat16)
    try:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, probe)
    except RuntimeError as e:
        raise RuntimeError(f"{GLOO_CUDA}: {e}") from e
    args = ModelArgs(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, attention_bias=True)
    for tp in (1, 2):
        dims = ParallelDims(world, tp=tp)
        meshes = dims.build_meshes("cuda")
        model = build_fsdp_model(args, meshes.train, FSDPConfig(), device="cuda")
        full = dict(_peaky_weights(model, seed=2))
        load_full_tensors(model, full.items())
        engine = _engine(args, torch.bfloat16, meshes)
        stats = Resharder(model, meshes, engine).reshard()
        torch.cuda.synchronize()
        assert stats.bytes_received == stats.bytes_bound
        j = dims.tp_rank(rank)
        for name, slot in engine.param_slots().items():
            want = full[name].to(torch.bfloat16)
            if slot.shard_dim is not None and tp > 1:
                want = want.chunk(tp, dim=slot.shard_dim)[j]
            assert torch.equal(slot.view.cpu(), want), (tp, name)


def test_side_stream_pipeline_two_ranks_one_gpu():
    try:
        run_distributed(_pipeline_body, 2)
    except AssertionError as e:
        if GLOO_CUDA in str(e):
            pytest.skip(GLOO_CUDA)
        raise
