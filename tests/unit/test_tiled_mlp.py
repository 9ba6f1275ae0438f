"""The tiled MLP (models/tiled_mlp.py, verl's `model.tiled_mlp`): the values and gradients of the
untiled MLP, with only the MLP's input kept for backward."""

import copy
import dataclasses

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths
from models.lora import LoRAConfig, adapter_state_dict, inject_lora
from models.tiled_mlp import apply_tiled_mlp, tile_bounds
from models.transformer import MLP
from sharding.ac import activation_offloader, apply_ac
from sharding.compile import apply_compile
from trainer.config import TiledMLPConfig
from trainer.setup import _tiled_mlp

ARGS = ModelArgs(vocab_size=61, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True)
REL = 1e-12  # float64: the tiles change only the order of the weight gradients' sums


def _mlp(bias: bool, dtype=torch.float64, seed=0) -> MLP:
    m = MLP(dataclasses.replace(ARGS, mlp_bias=bias)).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():  # unit-scale outputs: weights ~ 1/sqrt(fan_in), biases ~ 0.5
            scale = 0.5 if p.dim() == 1 else p.shape[1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    return m


def _tiled(m: MLP, num_shards: int) -> MLP:
    t = copy.deepcopy(m)
    t.num_shards = num_shards
    return t


def _run(m, x, dy):
    """Output and {name: grad} (x's as "x") of `m(x)` for the output gradient `dy`."""
    x = x.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y = m(x)
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _close(got, ref, rel=REL):
    assert got.keys() == ref.keys()
    for k in ref:
        assert _rel(got[k], ref[k]) < rel, (k, _rel(got[k], ref[k]))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 7), (1, 14)], ids=["padded", "packed"])
@pytest.mark.parametrize("num_shards", [1, 3, 14, 50])
def test_values_and_grads_are_the_untiled_mlps(bias, shape, num_shards):
    """float64, 14 tokens: one tile, uneven tiles, one token a tile, more tiles than tokens."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, ARGS.hidden_size, generator=g, dtype=torch.float64)
    dy = torch.randn(*shape, ARGS.hidden_size, generator=g, dtype=torch.float64)
    m = _mlp(bias)
    y_ref, ref = _run(m, x, dy)
    y, got = _run(_tiled(m, num_shards), x, dy)
    assert y.shape == y_ref.shape and _rel(y, y_ref) < REL
    assert set(ref) == {"x", "gate_proj.weight", "up_proj.weight", "down_proj.weight"} | (
        {"gate_proj.bias", "up_proj.bias", "down_proj.bias"} if bias else set())
    _close(got, ref)


def test_tiles_cover_the_tokens_once():
    assert tile_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert tile_bounds(3, 5) == [(0, 1), (1, 2), (2, 3)]  # empty tiles skipped
    assert tile_bounds(0, 4) == []


def test_no_tokens_give_zero_grads():
    m = _mlp(True)
    x = torch.zeros(1, 0, ARGS.hidden_size, dtype=torch.float64)
    y, got = _run(_tiled(m, 4), x, torch.zeros_like(x))
    assert y.shape == (1, 0, ARGS.hidden_size)
    assert all(v.abs().sum() == 0 for v in got.values()) and got["down_proj.weight"].shape == (32, 80)


def test_the_function_keeps_only_the_input():
    """What backward keeps besides the parameters: the tiled MLP exactly x; the untiled one x and at
    least gate and up (`[tokens, intermediate]` each). The memory property of the tiles."""
    m = _mlp(True, dtype=torch.float32)
    x = torch.randn(3, 40, ARGS.hidden_size, requires_grad=True)

    def saved_activation_bytes(module):
        params = {p.data_ptr() for p in module.parameters()}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            module(x)
        acts = [t for t in saved if t.data_ptr() not in params]
        return acts, sum(t.numel() * t.element_size() for t in acts)

    acts, nbytes = saved_activation_bytes(_tiled(m, 4))
    assert len(acts) == 1 and acts[0] is x and nbytes == x.numel() * 4
    _, plain = saved_activation_bytes(m)
    assert plain >= nbytes + 2 * 3 * 40 * ARGS.intermediate_size * 4


@pytest.mark.parametrize("num_shards", [3, 512])
def test_bf16_weight_grads_accumulate_in_float32(num_shards):
    """bf16 weights and input, 512 tokens: every gradient within bf16's rounding of the float64
    gradient of the same bf16 values. Measured (largest error / largest entry): 2e-3 to 6.2e-3 for
    the tiled and the untiled bf16 MLP alike; weight gradients summed in bf16 over 512 one-token
    tiles were 2.5e-2 to 5.2e-2 off, 64 tiles 1.3e-2 to 1.9e-2. The bound sits 2x from both."""
    m = _mlp(True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 512, ARGS.hidden_size, generator=g).bfloat16()
    dy = torch.randn(1, 512, ARGS.hidden_size, generator=g).bfloat16()
    _, ref = _run(copy.deepcopy(m).double(), x.double(), dy.double())
    _, got = _run(_tiled(m, num_shards), x, dy)
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and _rel(got[k], ref[k]) < 1.2e-2, (k, _rel(got[k], ref[k]))


def _adapted(tiled: int | None, ac: bool = False) -> Transformer:
    model = Transformer.build(ARGS, seed=0, dtype=torch.float64)
    inject_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "gate_proj", "down_proj"]),
                torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in adapter_state_dict(model).items():
            if n.endswith("lora_B"):  # a trained adapter: B non-zero
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.05)
    apply_tiled_mlp(model, tiled)
    return apply_ac(model, enable_gradient_checkpointing=ac)


def _loss_and_grads(model, lengths=(5, 9, 3), padded=False):
    g = torch.Generator().manual_seed(3)
    if padded:
        ids = torch.randint(0, ARGS.vocab_size, (2, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding
        logp, ent = model(ids, labels=torch.roll(ids, -1, dims=1), attention_mask=mask, with_entropy=True)
    else:
        ids = torch.randint(0, ARGS.vocab_size, (1, sum(lengths)), generator=g)
        logp, ent = model(ids, labels=torch.roll(ids, -1, dims=1), cu_seqlens=cu_seqlens_from_lengths(lengths),
                          with_entropy=True)
    model.zero_grad(set_to_none=True)
    loss = (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view(logp.shape)).sum() + ent.sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ac", [False, True])
def test_lora_mlp_tiles_give_the_untiled_grads(ac):
    """LoRA-wrapped gate/down: checkpointed tiles of the module path; under block checkpointing too."""
    loss_ref, ref = _loss_and_grads(_adapted(None))
    loss, got = _loss_and_grads(_adapted(3, ac))
    assert _rel(loss, loss_ref) < REL
    assert any("mlp.gate_proj.lora_A" in k for k in ref)
    _close(got, ref)


def _model(tiled: int | None, ac: bool = False, bias: bool = True, dtype=torch.float64,
           offload: bool = False) -> Transformer:
    args = dataclasses.replace(ARGS, mlp_bias=bias)
    model = Transformer.build(args, seed=0, dtype=dtype)
    with torch.no_grad():  # biases start at zero; give them values so that the tiles see them
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    apply_tiled_mlp(model, tiled)
    apply_ac(model, enable_gradient_checkpointing=ac, enable_activation_offload=offload)
    if offload:
        activation_offloader(model).min_bytes = 0  # move this tiny model's tensors too
    return model


@pytest.mark.parametrize("ac, offload", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_transformer_loss_and_grads_are_the_untiled_ones(ac, offload, padded):
    """Under block checkpointing the recomputation runs the tiles again; under activation offload
    the Function's saved input moves to the host and back."""
    loss_ref, ref = _loss_and_grads(_model(None), padded=padded)
    model = _model(4, ac, offload=offload)
    loss, got = _loss_and_grads(model, padded=padded)
    assert not offload or activation_offloader(model).stats.tensors > 0
    assert _rel(loss, loss_ref) < REL
    assert len(got) == len(ref) == len(list(_model(None).parameters()))
    _close(got, ref)


def test_compiled_tiled_blocks_match_eager(monkeypatch):
    """The tiled call runs eagerly inside the compiled blocks (`torch.compiler.disable`): same values
    and gradients as the eager tiled and untiled models, two token counts (dynamic shapes)."""
    import models.tiled_mlp as tm

    calls = []
    monkeypatch.setattr(tm, "tile_bounds", lambda n, k: calls.append(n) or tile_bounds(n, k))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = _model(3, dtype=torch.float32), _model(3, dtype=torch.float32)
    apply_compile(compiled, backend="aot_eager")
    plain = _model(None, dtype=torch.float32)
    for lengths in ([5, 9, 3], [7, 11]):
        loss_ref, ref = _loss_and_grads(eager, lengths)
        calls.clear()
        loss, got = _loss_and_grads(compiled, lengths)
        assert calls == [sum(lengths)] * 2 * ARGS.num_hidden_layers  # each block's forward and backward tiled
        loss_plain, plain_grads = _loss_and_grads(plain, lengths)
        for other_loss, other in ((loss_ref, ref), (loss_plain, plain_grads)):
            torch.testing.assert_close(loss, other_loss, atol=1e-5, rtol=1e-5)
            assert got.keys() == other.keys()
            for k in other:
                torch.testing.assert_close(got[k], other[k], atol=1e-5, rtol=1e-4, msg=k)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the blocks' other ops were compiled


def test_build_models_applies_the_sections_tiles():
    model = _model(None)
    _tiled_mlp(model, TiledMLPConfig(enabled=False, num_shards=8))
    assert all(b.mlp.num_shards is None for b in model.layers)
    _tiled_mlp(model, TiledMLPConfig(enabled=True, num_shards=8))
    assert all(b.mlp.num_shards == 8 for b in model.layers)
    apply_tiled_mlp(model, None)
    assert all(b.mlp.num_shards is None for b in model.layers)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_shards must be a positive integer"):
            apply_tiled_mlp(model, bad)


def test_train_bench_measures_each_tile_count_in_a_process_of_its_own():
    """bench/train.py --tiled-mlp 0,8: each variant untiled (no option: the records of before) and
    in 8 tiles; lm_head has no MLP and runs once."""
    from argparse import Namespace

    from bench.train import main, measurement_argvs, tile_counts

    a = Namespace(models="m05", variants="base,lm_head", tokens=8192, seq_len=256, repeats=3, profile=False,
                  tiled_mlp=tile_counts("0,8,8"), layers=None)
    rest = ["--tokens=8192", "--seq-len=256", "--repeats=3"]
    assert measurement_argvs(a) == [
        ["--models=m05", "--variants=base", *rest], ["--models=m05", "--variants=base", "--tiled-mlp=8", *rest],
        ["--models=m05", "--variants=lm_head", *rest]]
    for bad in ("0,x", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["--tiled-mlp", bad])
        assert e.value.code == 2
