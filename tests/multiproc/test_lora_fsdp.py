"""A LoRA actor under FSDP2 (gloo, CPU, 2 ranks): frozen base and trainable adapters in the same
units; a training step moves only the adapters and matches the unsharded model; adapters-off
forward equals the frozen reference; checkpoints hold the adapters only; peft export and
`lora_adapter_path` round-trip; a bf16 frozen base next to fp32 adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from models import ModelArgs, Transformer
from models.lora import (
    LoRAConfig,
    adapters_disabled,
    inject_lora,
    read_peft_adapter,
    save_peft_adapter,
    trainable_parameters,
)
from sharding import (
    FSDPConfig,
    ParallelDims,
    build_fsdp_model,
    gather_full_state_dict,
    load_checkpoint,
    load_full_tensors,
    reshard_all,
    save_checkpoint,
)
from tests.dist_utils import run_distributed

ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True)
LORA = LoRAConfig(rank=6, alpha=12, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
FP32 = FSDPConfig(mixed_precision={"param_dtype": "fp32"})


def _trained_adapters(model, seed=11):
    """Full adapter tensors with B non-zero (as after training), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {n: 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
            if n.endswith((".lora_A", ".lora_B"))}


def _loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, ARGS.vocab_size).float(), ids[:, 1:].reshape(-1))


def _body(rank, world, tmp):
    tmp = Path(tmp)
    meshes = ParallelDims(world).build_meshes("cpu")
    actor = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, seed=0)
    ref = build_fsdp_model(ARGS, meshes.train, FP32, trainable=False, seed=0)
    adapters = _trained_adapters(actor)
    load_full_tensors(actor, adapters.items(), partial=True)
    for name, p in actor.named_parameters():
        assert isinstance(p, DTensor) and p.to_local().numel() <= -(-p.numel() // world), name
        assert p.requires_grad == name.endswith((".lora_A", ".lora_B")), name

    # The unsharded twin: same base (seeded init), same adapters.
    plain = inject_lora(Transformer.build(ARGS, seed=0), LORA)
    plain.load_state_dict(adapters, strict=False)

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ARGS.vocab_size, (2 * world, 12), generator=gen)
    mine = ids[rank * 2:(rank + 1) * 2]
    with torch.no_grad():
        with adapters_disabled(actor):
            off = actor(mine)
        assert torch.equal(off, ref(mine))  # the reference is the actor with adapters off
        torch.testing.assert_close(actor(mine), plain(ids)[rank * 2:(rank + 1) * 2], rtol=1e-5, atol=1e-5)
        assert (actor(mine) - off).abs().max() > 1e-2

    reshard_all(actor)  # units kept gathered after forward register their shards again
    base_before = {n: p.to_local().clone() for n, p in actor.named_parameters() if not p.requires_grad}
    adapters_before = {n: p.full_tensor() for n, p in actor.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(trainable_parameters(actor), lr=0.5)
    _loss(actor, mine).backward()
    opt.step()
    popt = torch.optim.SGD(trainable_parameters(plain), lr=0.5)
    _loss(plain, ids).backward()  # the global mean: what FSDP's averaged gradient is the gradient of
    popt.step()
    reshard_all(actor)
    for n, p in actor.named_parameters():
        if n in base_before:
            assert p.grad is None and torch.equal(p.to_local(), base_before[n]), n
        else:
            full = p.full_tensor()
            assert (full - adapters_before[n]).abs().max() > 1e-4, n  # moved
            torch.testing.assert_close(full, dict(plain.named_parameters())[n].detach(), rtol=1e-4, atol=1e-6)

    # Checkpoints hold the adapters (and their optimizer state), not the base.
    adam = torch.optim.AdamW(trainable_parameters(actor), lr=1e-2)
    _loss(actor, mine).backward()
    adam.step()
    save_checkpoint(tmp / "ckpt", actor, adam, extra={"step": 3})
    keys = set(dcp.FileSystemReader(str(tmp / "ckpt")).read_metadata().state_dict_metadata)
    model_keys = {k[len("model."):] for k in keys if k.startswith("model.")}
    assert model_keys == set(adapters), sorted(model_keys ^ set(adapters))[:4]
    fresh = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, seed=0)
    fresh_adam = torch.optim.AdamW(trainable_parameters(fresh), lr=1e-2)
    assert load_checkpoint(tmp / "ckpt", fresh, fresh_adam) == {"step": 3}
    reshard_all(actor)
    for (n, a), (_, b) in zip(actor.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n
    for a, b in zip(trainable_parameters(actor), trainable_parameters(fresh)):
        assert torch.equal(adam.state[a]["exp_avg"].to_local(), fresh_adam.state[b]["exp_avg"].to_local())

    # peft export from the shards (adapters only are gathered) and `lora_adapter_path`.
    full = gather_full_state_dict(actor, trainable_only=True)
    if rank == 0:
        assert set(full) == set(adapters)
        save_peft_adapter(tmp / "adapter", full, LORA, base_model_name_or_path="tiny",
                          model_type=ARGS.model_type)
    dist.barrier()
    loaded = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, lora_adapter_path=tmp / "adapter", seed=0)
    _, on_disk = read_peft_adapter(tmp / "adapter")
    for n, p in loaded.named_parameters():
        if n in on_disk:
            assert torch.equal(p.full_tensor(), on_disk[n]), n
        else:
            assert torch.equal(p.to_local(), base_before[n]), n
    with pytest.raises(ValueError, match="r \\(lora_rank\\)=6, the configuration says 4"):
        build_fsdp_model(ARGS, meshes.train, FP32, lora=LoRAConfig(rank=4, alpha=12, target_modules=LORA.targets),
                         lora_adapter_path=tmp / "adapter")
    # no LoRAConfig given: the adapter's own (as peft's loading; verl passes none with lora_adapter_path)
    own = build_fsdp_model(ARGS, meshes.train, FP32, lora_adapter_path=tmp / "adapter", seed=0)
    assert own.lora_config == LORA
    assert all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(own.parameters(), loaded.parameters()))

    # bf16 compute: the frozen base is stored in bf16 (half the bytes), the adapters stay fp32,
    # in the same FSDP units; a step trains, and a fresh adapter is the identity on the base.
    mixed = build_fsdp_model(ARGS, meshes.train, FSDPConfig(), lora=LORA, seed=0)
    ref16 = build_fsdp_model(ARGS, meshes.train, FSDPConfig(model_dtype="bf16"), trainable=False, seed=0)
    for n, p in mixed.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), n
    with torch.no_grad():
        assert torch.equal(mixed(mine), ref16(mine))  # B = 0 at init
    opt = torch.optim.SGD(trainable_parameters(mixed), lr=0.5)
    _loss(mixed, mine).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable_parameters(mixed))
    opt.step()
    with torch.no_grad():
        with adapters_disabled(mixed):
            assert torch.equal(mixed(mine), ref16(mine))
        assert not torch.equal(mixed(mine), ref16(mine))


def test_lora_actor_under_fsdp_2_ranks(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
