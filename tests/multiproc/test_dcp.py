"""Sharded checkpoints: saved by 4 ranks, loaded by 2, identical weights and optimizer state;
full-state-dict export to a Hugging Face directory that `build_fsdp_model` loads back sharded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from models import ModelArgs, Transformer
from sharding import FSDPConfig, ParallelDims, build_fsdp_model, gather_full_state_dict, load_checkpoint, save_checkpoint
from tests.dist_utils import run_distributed

ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True)
CFG = FSDPConfig(mixed_precision={"param_dtype": "fp32"})


def _model_and_optim(fsdp_size: int, seed: int):
    meshes = ParallelDims(dist.get_world_size(), fsdp_size=fsdp_size).build_meshes("cpu")
    model = build_fsdp_model(ARGS, meshes.train, CFG, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_optim_state(model, opt):
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_body(rank, world, tmp):
    tmp = Path(tmp)
    model, opt = _model_and_optim(-1, seed=0)
    ids = torch.randint(0, ARGS.vocab_size, (2, 10), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, ARGS.vocab_size).float(), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp / "ckpt", model, opt, extra={"step": 1})
    save_checkpoint(tmp / "ckpt", model, opt, extra={"step": 2})  # overwriting an existing checkpoint
    full = gather_full_state_dict(model)
    optim_full = _full_optim_state(model, opt)
    if rank == 0:
        assert not (tmp / "ckpt.tmp").exists() and not (tmp / "ckpt.old").exists()
        assert set(full) == {n for n, _ in model.named_parameters()}
        assert all(v.device.type == "cpu" for v in full.values())
        torch.save({"model": full, "optim": optim_full}, tmp / "expected.pt")
    else:
        assert full == {}


def _load_body(rank, world, tmp):
    tmp = Path(tmp)
    expected = torch.load(tmp / "expected.pt")
    model, opt = _model_and_optim(-1, seed=7)  # different init: the load must overwrite it all
    extra = load_checkpoint(tmp / "ckpt", model, opt)
    assert extra == {"step": 2}
    for name, p in model.named_parameters():
        assert p.to_local().numel() <= -(-p.numel() // world)  # really sharded over 2 ranks
        assert torch.equal(p.full_tensor(), expected["model"][name]), name
    got = _full_optim_state(model, opt)  # full on rank 0, empty elsewhere
    if rank == 0:
        assert set(got["state"]) == set(expected["optim"]["state"])
        for name, state in expected["optim"]["state"].items():
            for k, v in state.items():
                assert torch.equal(torch.as_tensor(got["state"][name][k]), torch.as_tensor(v)), (name, k)
        assert got["param_groups"][0]["lr"] == expected["optim"]["param_groups"][0]["lr"]

    # HSDP on the same 2 ranks (fsdp_size=1: replicate) loads the same checkpoint, model only.
    hsdp, _ = _model_and_optim(1, seed=7)
    load_checkpoint(tmp / "ckpt", hsdp)
    for name, p in hsdp.named_parameters():
        assert torch.equal(p.full_tensor(), expected["model"][name]), name

    # The Hugging Face export (done here rather than by the 4 saving ranks: importing
    # transformers costs seconds per process) loads back sharded, and unsharded through models/.
    full = gather_full_state_dict(model)
    if rank == 0:
        model.save_pretrained(tmp / "hf", state_dict=full)
    dist.barrier()
    meshes = ParallelDims(world).build_meshes("cpu")
    from_hf = build_fsdp_model(tmp / "hf", meshes.train, CFG)
    for name, p in from_hf.named_parameters():
        assert torch.equal(p.full_tensor(), expected["model"][name]), name
    plain = Transformer.from_pretrained(tmp / "hf")
    for name, t in plain.state_dict().items():
        assert torch.equal(t, expected["model"][name]), name

    with pytest.raises(FileNotFoundError, match="not a meshppo checkpoint"):
        load_checkpoint(tmp / "missing", model)


def test_checkpoint_saved_by_4_ranks_loads_on_2(tmp_path):
    run_distributed(_save_body, 4, str(tmp_path))
    run_distributed(_load_body, 2, str(tmp_path))
