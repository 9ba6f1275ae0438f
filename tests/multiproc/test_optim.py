"""`ShardAdamW` (AdamW on the local shards of DTensor parameters) equals `torch.optim.AdamW`
bit for bit, on FSDP2's sharded parameters and on the replicated runtime's (gloo, CPU)."""

from __future__ import annotations

import copy
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from models import ModelArgs
from sharding import FSDPConfig, ParallelDims, build_fsdp_model
from sharding.optim import ShardAdamW
from tests.dist_utils import run_distributed

ARGS = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attention_bias=True)
FP32 = {"param_dtype": "fp32"}


def _run(mesh, cls, fused: bool, rank: int):
    model = build_fsdp_model(ModelArgs(**ARGS), mesh, FSDPConfig(mixed_precision=FP32), seed=0)
    opt = cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused, foreach=not fused)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(0, ARGS["vocab_size"], (2, 9), generator=gen)
        model(ids).float().pow(2).mean().backward()
        if fused:  # the trainer's non-finite skip: a device flag the fused kernel reads
            opt.found_inf = torch.tensor(1.0 if step == 1 else 0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _body(rank, world):
    pair = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pair", "dp_shard"))["dp_shard"]
    solo = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    for mesh in (pair, solo):
        for fused in (False, True):
            ref, ref_opt = _run(mesh, torch.optim.AdamW, fused, rank)
            got, got_opt = _run(mesh, ShardAdamW, fused, rank)
            for (n, p), q in zip(ref.named_parameters(), got.parameters()):
                assert isinstance(q, DTensor)
                assert torch.equal(p.to_local(), q.to_local()), (n, fused)
                s, t = ref_opt.state[p], got_opt.state[q]
                assert isinstance(t["exp_avg"], DTensor) and t["exp_avg"].placements == q.placements
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    a, b = s[key], t[key]
                    assert torch.equal(_plain(a), _plain(b)), (n, key, fused)
            assert float(got_opt.state[next(got.parameters())]["step"]) == (2 if fused else 3)  # one skipped
            sd = got_opt.state_dict()
            assert sd["param_groups"] == ref_opt.state_dict()["param_groups"]
            got_opt.load_state_dict(ref_opt.state_dict())  # the same format both ways


def _plain(t):
    return t.to_local() if isinstance(t, DTensor) else t


def test_shard_adamw_equals_adamw_on_dtensors():
    run_distributed(_body, 4)


def test_plain_parameters_step_as_adamw():
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, 5)) for _ in range(2)]
    opts = [ShardAdamW([ps[0]], lr=0.1), torch.optim.AdamW([ps[1]], lr=0.1)]
    for p, opt in zip(ps, opts):
        p.grad = torch.linspace(2, 3, 5)
        opt.step()
    assert torch.equal(ps[0], ps[1]) and not torch.equal(ps[0], torch.linspace(-1, 1, 5))


def _kernels_see_local_tensors_body(rank, world):
    import torch.optim.adam as adam_mod

    seen = []
    real = adam_mod.adam

    def spy(params, grads, exp_avgs, exp_avg_sqs, *args, **kw):
        seen.append({type(t) for lst in (params, grads, exp_avgs, exp_avg_sqs) for t in lst})
        return real(params, grads, exp_avgs, exp_avg_sqs, *args, **kw)

    adam_mod.adam = spy
    try:
        solo = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
        _run(solo, ShardAdamW, False, rank)
        assert seen and all(types == {torch.Tensor} for types in seen), seen
        seen.clear()
        _run(solo, torch.optim.AdamW, False, rank)
        assert all(DTensor in types for types in seen)  # what ShardAdamW spares the host
    finally:
        adam_mod.adam = real


def test_the_update_kernels_get_local_tensors():
    run_distributed(_kernels_see_local_tensors_body, 2)


def _mismatch_body(rank, world):
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, (Shard(0),)))
    p.grad = DTensor.from_local(torch.ones(4, 3), mesh, (Replicate(),))
    with pytest.raises(ValueError, match="laid out as"):
        ShardAdamW([p], lr=0.1).step()


def test_a_replicated_gradient_on_a_sharded_parameter_is_refused():
    run_distributed(_mismatch_body, 2)


def _flat_body(rank, world):
    """The replicated runtime (bf16 compute, fp32 masters and gradients in one buffer each): from
    its first step `ShardAdamW` runs one flat fused call, and stays `AdamW` bit for bit through a
    skipped step, a learning-rate change, an offload of its states, `state_dict` and a
    `load_state_dict` (whose states it moves into flat buffers at the next step)."""
    from sharding.fsdp import load_fsdp_optimizer, offload_fsdp_optimizer, release_gradients

    mesh = ParallelDims(world, fsdp_size=1).build_meshes("cpu").train
    cfg = FSDPConfig(mixed_precision={"param_dtype": "bf16"})
    models = [build_fsdp_model(ModelArgs(**ARGS), mesh, cfg, seed=0) for _ in range(2)]
    opts = [torch.optim.AdamW(models[0].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
            ShardAdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, ARGS["vocab_size"], (2, 9), generator=gen) for _ in range(6)]

    def step(k):
        for model, opt in zip(models, opts):
            model(batches[k]).float().pow(2).mean().backward()
            opt.found_inf = torch.tensor(1.0 if k == 2 else 0.0)
            if k == 3:
                opt.param_groups[0]["lr"] = 3e-3
            opt.step()
            opt.zero_grad(set_to_none=True)
            release_gradients(model)  # the trainer's step: the gradient buffer is freed, then re-allocated

    def assert_equal(tag):
        for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (tag, n)
        ref, got = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
        assert ref.keys() == got.keys()
        for i in ref:
            assert list(ref[i]) == list(got[i]), (tag, i)
            for key in ref[i]:
                assert torch.equal(_plain(ref[i][key]), _plain(got[i][key])), (tag, i, key)
                assert type(ref[i][key]) is type(got[i][key]), (tag, i, key)

    for k in range(4):
        step(k)
        assert opts[1].last_step_flat, k
    assert float(opts[1].state[next(models[1].parameters())]["step"]) == 3  # one skipped
    assert_equal("flat steps")
    offload_fsdp_optimizer(opts[1])
    load_fsdp_optimizer(opts[1], "cpu")
    step(4)
    assert opts[1].last_step_flat
    assert_equal("after an offload")
    # a copy, as a checkpoint holds: loading a live optimizer's own tensors would share them with it
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    assert opts[1]._flat is None
    step(5)
    assert opts[1].last_step_flat
    assert_equal("after load_state_dict")


def test_flat_step_on_the_replicated_runtime_equals_adamw():
    run_distributed(_flat_body, 2)
