"""Sharded checkpoints: saved by 4 ranks, loaded by 2, identical weights and optimizer state;
full-state-dict export to a Hugging Face directory that `build_fsdp_model` loads back sharded;
a checkpoint whose pickles would run code is refused on every rank before they run."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from models import ModelArgs, Transformer
from sharding import FSDPConfig, ParallelDims, build_fsdp_model, gather_full_state_dict, load_checkpoint, save_checkpoint
from sharding.checkpoint import UnsafeCheckpointError
from tests.dist_utils import run_distributed
from tests.unit.test_checkpoint_state import _Payload

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _craft_item(ckpt: Path, fqn: str, payload: bytes) -> None:
    """Point the first stored chunk of item `fqn` at `payload`, appended to its data file (rank 0)."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == fqn and not any(i.offset or ()))
    info = metadata.storage_data[index]
    data_file = ckpt / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(payload)
    with open(data_file, "ab") as f:
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _refusal_body(rank, world, tmp):
    ckpt, marker = Path(tmp) / "ckpt", Path(tmp) / "pwned"  # what the crafted pickles would create
    model, opt = _model_and_optim(-1, seed=0)
    ids = torch.randint(0, ARGS.vocab_size, (2, 10), generator=torch.Generator().manual_seed(rank))
    F.cross_entropy(model(ids[:, :-1]).reshape(-1, ARGS.vocab_size).float(), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    save_checkpoint(ckpt, model, opt)
    metadata = (ckpt / ".metadata").read_bytes()
    payload = io.BytesIO()
    torch.save(_Payload(str(marker)), payload)
    ckpt_re = re.escape(str(ckpt))
    fresh, fresh_opt = _model_and_optim(-1, seed=7)
    before = {name: p.full_tensor() for name, p in fresh.named_parameters()}

    def refused(match):
        dist.barrier()  # rank 0 has crafted the checkpoint
        with pytest.raises(UnsafeCheckpointError, match=match):
            load_checkpoint(ckpt, fresh, fresh_opt)
        assert not marker.exists()
        dist.barrier()  # every rank is done with it before rank 0 restores it
        if rank == 0:
            (ckpt / ".metadata").write_bytes(metadata)

    # A real checkpoint's metadata with a payload inside: refused before any state changes.
    if rank == 0:
        tampered = pickle.loads(metadata)
        tampered.storage_meta.modules = [_Payload(str(marker))]
        (ckpt / ".metadata").write_bytes(pickle.dumps(tampered))
    refused(rf"^checkpoint '{ckpt_re}' holds a pickle \(\.metadata\) that would call posix\.mkdir: refusing to load it")
    assert all(torch.equal(p.full_tensor(), before[name]) for name, p in fresh.named_parameters())

    # An optimizer hyper-parameter (a pickled non-tensor item), then a tensor shard.
    if rank == 0:
        _craft_item(ckpt, "optim.param_groups.0.lr", payload.getvalue())
    refused(rf"^checkpoint '{ckpt_re}' holds a pickle \(item 'optim\.param_groups\.0\.lr'\) that would call posix\.mkdir")
    if rank == 0:
        _craft_item(ckpt, "model.embed_tokens.weight", payload.getvalue())
    refused(rf"^checkpoint '{ckpt_re}' holds a pickle \(a tensor item\) that would call posix\.mkdir")

    # Truncated files (cut in half): the extra JSON, the .metadata pickle, then a data file - a
    # one-line error naming the file or checkpoint; the first two before any state changes.
    from models.checkpoint import CheckpointFileError

    data_file = sorted(ckpt.glob("*.distcp"))[0]
    data = data_file.read_bytes()
    extra = (ckpt / "extra.json").read_bytes()
    for target, whole, match in ((ckpt / "extra.json", extra, r"extra\.json' is not readable JSON"),
                                 (ckpt / ".metadata", metadata, r"\.metadata' is truncated or corrupt"),
                                 (data_file, data, rf"^checkpoint '{ckpt_re}' could not be read")):
        dist.barrier()
        if rank == 0:
            target.write_bytes(whole[:len(whole) // 2])
        dist.barrier()
        now = {name: p.full_tensor() for name, p in fresh.named_parameters()}
        with pytest.raises(CheckpointFileError, match=match):
            load_checkpoint(ckpt, fresh, fresh_opt)
        if target != data_file:
            assert all(torch.equal(p.full_tensor(), now[name]) for name, p in fresh.named_parameters())
        dist.barrier()
        if rank == 0:
            target.write_bytes(whole)

    # The checkpoint as saved loads through the same readers, bit for bit.
    dist.barrier()
    load_checkpoint(ckpt, fresh, fresh_opt)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        saved, loaded = opt.state[p], fresh_opt.state[q]
        assert saved.keys() == loaded.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in saved:
            assert torch.equal(_local(saved[k]), _local(loaded[k])), (name, k)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2


def test_a_checkpoint_whose_pickles_would_run_code_is_refused(tmp_path):
    run_distributed(_refusal_body, 2, str(tmp_path))
