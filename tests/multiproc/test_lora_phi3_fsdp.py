"""LoRA on a Phi3 (its fused qkv_proj / gate_up_proj adapted as peft adapts them: the parts share one A) under FSDP2
(gloo, CPU, 2 ranks): the shared A stays one parameter after sharding (one FSDP shard, one optimizer entry); a
training step equals the unsharded model's; the DCP checkpoint resumes it (still shared); the peft export
gathered from the shards stacks the parts' B and loads back through lora_adapter_path; the resharder merges each
part's B_part @ A into the engine's weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from models import ModelArgs, Transformer
from models.lora import LoRAConfig, inject_lora, merge_weight, read_peft_adapter, save_peft_adapter, \
    shared_a_name, trainable_parameters
from sharding import (FSDPConfig, ParallelDims, Resharder, build_fsdp_model, gather_full_state_dict, load_checkpoint,
                      load_full_tensors, reshard_all, save_checkpoint)
from tests.dist_utils import run_distributed
from tests.multiproc.test_resharder import _engine, _expected_slice

ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, model_type="phi3", tie_word_embeddings=False)
LORA = LoRAConfig(rank=4, alpha=8)  # all-linear: qkv_proj, o_proj, gate_up_proj, down_proj
FP32 = FSDPConfig(mixed_precision={"param_dtype": "fp32"})


def _adapters(model, seed):
    """Dyadic adapter values (B @ A exact in float32 whatever the order of the sums), B non-zero."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-4, 5, p.shape, generator=g).float() / 16 for n, p in model.named_parameters()
            if n.endswith((".lora_A", ".lora_B"))}


def _loss(model, ids):
    return F.cross_entropy(model(ids[:, :-1]).reshape(-1, ARGS.vocab_size).float(), ids[:, 1:].reshape(-1))


def _body(rank, world, tmp):
    tmp = Path(tmp)
    meshes = ParallelDims(world).build_meshes("cpu")
    actor = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, seed=0)
    adapters = _adapters(actor, 4)
    names = set(adapters)
    assert "layers.0.self_attn.q_proj.lora_A" in names and "layers.0.self_attn.k_proj.lora_A" not in names
    assert len(names) == ARGS.num_hidden_layers * (4 * 2 + 3)  # peft's A and B of 4 modules, B split (+3)
    load_full_tensors(actor, adapters.items(), partial=True)
    attn = actor.layers[1].self_attn
    assert attn.q_proj.lora_A is attn.k_proj.lora_A is attn.v_proj.lora_A  # one sharded parameter
    assert len(trainable_parameters(actor)) == len(names)
    plain = inject_lora(Transformer.build(ARGS, seed=0), LORA)
    plain.load_state_dict(adapters, strict=False)
    ids = torch.randint(0, ARGS.vocab_size, (2 * world, 12), generator=torch.Generator().manual_seed(5))
    mine = ids[rank * 2:(rank + 1) * 2]
    with torch.no_grad():
        torch.testing.assert_close(actor(mine), plain(ids)[rank * 2:(rank + 1) * 2], rtol=1e-5, atol=1e-5)
    reshard_all(actor)  # units kept gathered after forward register their shards again
    opt = torch.optim.SGD(trainable_parameters(actor), lr=0.5)
    _loss(actor, mine).backward()
    opt.step()
    popt = torch.optim.SGD(trainable_parameters(plain), lr=0.5)
    _loss(plain, ids).backward()
    popt.step()
    reshard_all(actor)
    theirs = dict(plain.named_parameters())
    for n, p in actor.named_parameters():
        if p.requires_grad:
            assert (p.full_tensor() - adapters[n]).abs().max() > 1e-4, n  # moved, the shared A too
            torch.testing.assert_close(p.full_tensor(), theirs[n].detach(), rtol=1e-4, atol=1e-6)

    # DCP: the shared A once, resumed into a fresh model (its optimizer state too)
    adam = torch.optim.AdamW(trainable_parameters(actor), lr=1e-2)
    _loss(actor, mine).backward()
    adam.step()
    save_checkpoint(tmp / "ckpt", actor, adam, extra={"step": 3})
    keys = set(dcp.FileSystemReader(str(tmp / "ckpt")).read_metadata().state_dict_metadata)
    # torch's state dict lists the shared A under each part's name (the same tensor): it round-trips
    shared = {f"layers.{i}.{p}.lora_A" for i in range(ARGS.num_hidden_layers)
              for p in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")}
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == names | shared
    fresh = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, seed=1)
    fresh_adam = torch.optim.AdamW(trainable_parameters(fresh), lr=1e-2)
    assert load_checkpoint(tmp / "ckpt", fresh, fresh_adam) == {"step": 3}
    reshard_all(actor)
    assert fresh.layers[0].self_attn.q_proj.lora_A is fresh.layers[0].self_attn.v_proj.lora_A
    for (n, a), (_, b) in zip(actor.named_parameters(), fresh.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a.to_local(), b.to_local()), n
    for a, b in zip(trainable_parameters(actor), trainable_parameters(fresh)):
        assert torch.equal(adam.state[a]["exp_avg"].to_local(), fresh_adam.state[b]["exp_avg"].to_local())

    # the peft export gathered from the shards, and lora_adapter_path
    full = gather_full_state_dict(actor, trainable_only=True)
    if rank == 0:
        save_peft_adapter(tmp / "adapter", full, LORA, model_type="phi3")
        _, on_disk = read_peft_adapter(tmp / "adapter")
        assert {k.rsplit(".", 2)[1] for k in on_disk} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    dist.barrier()
    loaded = build_fsdp_model(ARGS, meshes.train, FP32, lora=LORA, lora_adapter_path=tmp / "adapter", seed=0)
    for (n, a), (_, b) in zip(actor.named_parameters(), loaded.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a.full_tensor(), b.full_tensor()), n

    # the engine's weights: each part's weight + scaling · B_part @ A (exact: dyadic values)
    load_full_tensors(actor, adapters.items(), partial=True)
    full = {n: p.full_tensor() for n, p in actor.named_parameters()}
    want = {}
    for n, v in full.items():
        mod = n[:-len(".weight")]
        if n.endswith(".weight") and mod + ".lora_B" in full:
            v = merge_weight(v, full[shared_a_name(mod + ".lora_A")], full[mod + ".lora_B"], LORA.scaling)
        if not n.endswith((".lora_A", ".lora_B")):
            want[n] = v
    reshard_all(actor)
    engine = _engine(ARGS, torch.float32, meshes)
    stats = Resharder(actor, meshes, engine).reshard()
    assert stats.num_merged == ARGS.num_hidden_layers * 7
    for name, slot in engine.param_slots().items():
        assert torch.equal(slot.view, _expected_slice(want[name], slot.shard_dim, 0, 1)), name


def test_lora_on_phi3_under_fsdp_2_ranks(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
