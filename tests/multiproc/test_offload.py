"""Parameter / optimizer offload between phases, and FSDP2's CPUOffloadPolicy (gloo, CPU, 2 ranks).

Offload copies each shard / moment storage to host memory and shrinks the storage to zero
bytes; on CPU the "device" is the CPU too, but the mechanics are the same: storages released,
host copies holding exactly the shard bytes, parameter identity for the optimizer, values
across the round trip, training afterwards. `tests/gpu/test_sharding_gpu.py` measures the
device memory given back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import ModelArgs
from sharding import FSDPConfig, ParallelDims, build_fsdp_model, load_states, offload_states, offloaded_tensors
from tests.dist_utils import run_distributed

ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
FP32 = {"param_dtype": "fp32"}


def _step(model, opt, rank, step):
    ids = torch.randint(0, ARGS.vocab_size, (2, 10), generator=torch.Generator().manual_seed(100 * step + rank))
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, ARGS.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _body(rank, world):
    meshes = ParallelDims(world).build_meshes("cpu")
    device = torch.device("cpu")
    plain_cfg = FSDPConfig(mixed_precision=FP32)
    off_cfg = FSDPConfig(mixed_precision=FP32, param_offload=True, optimizer_offload=True)
    plain = build_fsdp_model(ARGS, meshes.train, plain_cfg, seed=0)
    off = build_fsdp_model(ARGS, meshes.train, off_cfg, seed=0)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_off = torch.optim.AdamW(off.parameters(), lr=1e-2)
    _step(plain, opt_plain, rank, 0)
    _step(off, opt_off, rank, 0)

    params_before = {n: p.to_local().clone() for n, p in off.named_parameters()}
    states_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt_off.state.items()}
    param_objects = list(off.parameters())
    shard_bytes = sum(p.to_local().untyped_storage().nbytes() for p in off.parameters())

    offload_states(off, opt_off, off_cfg)
    offload_states(off, opt_off, off_cfg)  # a second call is a no-op, not a second copy
    # The shards' own storage is released; the data lives in host copies.
    for n, p in off.named_parameters():
        assert p.to_local().untyped_storage().nbytes() == 0, n
    for s in opt_off.state.values():
        assert s["exp_avg"].to_local().untyped_storage().nbytes() == 0
    hosts, opt_hosts = offloaded_tensors(off), offloaded_tensors(opt_off)
    assert all(h.device.type == "cpu" for h in hosts + opt_hosts)
    assert sum(h.numel() for h in hosts) == shard_bytes
    assert sum(h.numel() for h in opt_hosts) == 2 * shard_bytes  # exp_avg and exp_avg_sq
    # The optimizer still holds the model's parameter objects.
    assert all(a is b for a, b in zip(param_objects, off.parameters()))
    assert all(a is b for a, b in zip(param_objects, opt_off.param_groups[0]["params"]))

    load_states(off, opt_off, off_cfg, device)
    load_states(off, opt_off, off_cfg, device)  # idempotent too
    assert offloaded_tensors(off) == [] and offloaded_tensors(opt_off) == []
    for n, p in off.named_parameters():
        assert torch.equal(p.to_local(), params_before[n]), n
    for p, s in opt_off.state.items():
        for k, v in s.items():
            assert torch.equal(v, states_before[id(p)][k]), k

    # rollout.name=hf: the actor itself generates, so only its optimizer states wait in host memory meanwhile
    # (`param_offload` frees nothing there), and both are back, unchanged, when the phase ends.
    import trainer.hf_rollout as hf_rollout
    from rollout.config import RequestOutput
    from trainer.roles import Role
    from trainer.rollout_phase import NoCacheRollout
    from trainer.tracking import PeakMemory

    role = Role(off, device=device, packed=False, pad_token_id=0, fsdp_cfg=off_cfg, optimizer=opt_off)
    during = []

    def generate(model, prompts, **kw):
        during.append((len(offloaded_tensors(model)), len(offloaded_tensors(opt_off)) > 0))
        return [RequestOutput(0, 0, [1, 2], [10 + rank], [-0.5], "length")]

    real, hf_rollout.generate_no_cache = hf_rollout.generate_no_cache, generate
    try:
        outs = NoCacheRollout(role, rank, world, PeakMemory(device)).generate(
            [[1, 2], [3, 4]], max_tokens=2, eos_ids=[], ignore_eos=True, seed=0, n=1, temperature=1.0, top_p=1.0,
            top_k=-1)
    finally:
        hf_rollout.generate_no_cache = real
    assert during == [(0, True)] and list(outs.token_ids) == [[10], [11]]
    assert offloaded_tensors(off) == [] and offloaded_tensors(opt_off) == []
    for p, s in opt_off.state.items():
        for k, v in s.items():
            assert torch.equal(v, states_before[id(p)][k]), k

    # Training after the round trip is exactly training without it.
    _step(plain, opt_plain, rank, 1)
    _step(off, opt_off, rank, 1)
    for (n, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n

    # offload_states is a no-op for flags that are off.
    kept = {n: p.to_local() for n, p in plain.named_parameters()}
    offload_states(plain, opt_plain, plain_cfg)
    assert all(p.to_local() is kept[n] or torch.equal(p.to_local(), kept[n]) for n, p in plain.named_parameters())

    # FSDP2's CPUOffloadPolicy: shards on CPU permanently; training matches the plain run.
    pol = build_fsdp_model(ARGS, meshes.train, FSDPConfig(mixed_precision=FP32, offload_policy=True), seed=0)
    opt_pol = torch.optim.AdamW(pol.parameters(), lr=1e-2)
    for step in range(2):
        _step(pol, opt_pol, rank, step)
    assert all(p.to_local().device.type == "cpu" for p in pol.parameters())
    for (n, a), b in zip(plain.named_parameters(), pol.parameters()):
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_param_and_optimizer_offload_round_trip():
    run_distributed(_body, 2)


def test_offload_config_conflicts_are_errors():
    with pytest.raises(ValueError, match="offload_policy"):
        FSDPConfig(offload_policy=True, param_offload=True)
