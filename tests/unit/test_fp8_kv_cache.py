"""The e4m3 KV cache (`EngineConfig.kv_cache_dtype = "fp8"`): the row quantizer against hand values and e4m3's
rounding bound, the reference attention over an e4m3 cache against float64, the pool's size, and the engine
against an independent training forward whose attention sees K and V rounded as the cache holds them."""

from __future__ import annotations

import pytest
import torch

import models.transformer as transformer
from rollout import EngineConfig, LLMEngine, SamplingParams
from rollout.attention import AttentionMetadata, decode_attention_ref
from rollout.ops import FP8, FP8_MAX, TorchOps, quantize_rows
from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model
from tests.unit.test_fp8_rollout import _fake_quant_reference, _logprob_errors, _within_e4m3_rounding


def test_quantize_rows_hand_values_and_bound():
    x = torch.tensor([[[1.0, -2.0, 0.5, 4.0], [448.0, 272.0, -1.0, 0.0]], [[0.0] * 4, [3.0, -6.0, 1.5, 0.75]]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (2, 2)
    # one scale per row of D values: its largest |value| maps to 448
    assert scale[0, 0].item() == torch.tensor(4.0 / 448).item() and scale[0, 1].item() == 1.0
    assert q[0, 0].float().tolist() == [112.0, -224.0, 56.0, 448.0]
    # 272 lies halfway between e4m3's 256 and 288: the even mantissa (256)
    assert q[0, 1].float().tolist() == [448.0, 256.0, -1.0, 0.0]
    assert not q[1, 0].float().any() and scale[1, 0].item() > 0  # an all-zero row stays zero
    assert q[1, 1].float().tolist() == [224.0, -448.0, 112.0, 56.0]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 3, 64, generator=g).double() * torch.logspace(-2, 2, 50, dtype=torch.float64)[:, None, None]
    q, scale = quantize_rows(rows)
    for r in range(50):
        for h in range(3):
            assert _within_e4m3_rounding(q[r, h].double() * scale[r, h].double(), rows[r, h], scale[r, h].item())
    assert (q.float().abs().amax(-1) == FP8_MAX).all()


def test_attention_over_an_e4m3_cache_against_float64():
    # rope_and_cache writes e4m3 rows and their scales where the block tables say; decode attention reads them
    # back: against softmax(q k^T) v in float64 with every cached row times its own scale, gathered by hand
    from models import ModelArgs
    from models.transformer import rope_cos_sin, rope_inv_freq

    g = torch.Generator().manual_seed(1)
    hq, hkv, d, page, blocks = 4, 2, 16, 4, 12
    args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
    cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(64), torch.float32)
    cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
    lengths = [3, 9]
    tables = torch.tensor([[7, 2, 0], [5, 11, 1]], dtype=torch.int32)  # scattered pages
    slots = torch.tensor([0, 1], dtype=torch.int32)
    k_cache, v_cache = (torch.zeros(blocks, page, hkv, d, dtype=FP8) for _ in range(2))
    k_scale, v_scale = (torch.zeros(blocks, page, hkv) for _ in range(2))
    qkv = torch.randn(sum(lengths), (hq + 2 * hkv) * d, generator=g) * 3
    positions = torch.tensor([p for n in lengths for p in range(n)], dtype=torch.int32)
    token_slots = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32)
    TorchOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, k_cache, v_cache, tables, hq, hkv, d,
                            k_scale, v_scale)
    assert (k_scale > 0).sum() == (v_scale > 0).sum() == sum(lengths) * hkv  # one scale per token and head
    q = torch.randn(2, hq, d, generator=g)
    meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(lengths, dtype=torch.int32),
                             max_context_len=max(lengths))
    out = decode_attention_ref(q, k_cache, v_cache, tables, meta, d ** -0.5, k_scale, v_scale)
    for b, n in enumerate(lengths):
        rows = [(int(tables[b, p // page]), p % page) for p in range(n)]
        k = torch.stack([k_cache[i, j].double() * k_scale[i, j, :, None].double() for i, j in rows])  # [n, Hkv, D]
        v = torch.stack([v_cache[i, j].double() * v_scale[i, j, :, None].double() for i, j in rows])
        for h in range(hq):
            kv_h = h // (hq // hkv)
            w = torch.softmax((k[:, kv_h] @ q[b, h].double()) * d ** -0.5, 0)
            expect = w @ v[:, kv_h]
            assert torch.allclose(out[b, h * d:(h + 1) * d].double(), expect, rtol=0, atol=2e-5)
    # the scales matter: without them the cache's e4m3 values are far from the rows they stand for
    assert not torch.allclose(decode_attention_ref(q, k_cache.float(), v_cache.float(), tables, meta, d ** -0.5), out,
                              atol=1e-2)


def test_kv_pool_bytes_and_blocks(monkeypatch):
    # per token, layer and KV head: K and V as D e4m3 bytes and a float32 scale each, against 4 D bytes in float32;
    # a 64 KiB pool holds 65536 // 2048 = 32 blocks of the float32 cache, 65536 // 640 = 102 of the e4m3 one
    monkeypatch.setattr("rollout.engine.CPU_KV_CACHE_BYTES", 65536)
    model = tiny_model(tiny_args("qwen2"))
    a = model.args
    full, fp8 = (make_engine(model, num_kv_blocks=None, kv_cache_dtype=c) for c in ("auto", "fp8"))
    per_head = a.hidden_size // a.num_attention_heads
    tokens_layer_heads = a.num_hidden_layers * 2 * 4 * a.num_key_value_heads  # block_size 4
    assert full.runner.kv_bytes_per_block() == tokens_layer_heads * per_head * 4
    assert fp8.runner.kv_bytes_per_block() == tokens_layer_heads * (per_head + 4)
    full.init_cache()
    fp8.init_cache()
    assert fp8.runner.kv_cache.dtype == FP8 and fp8.runner.kv_scales.shape == fp8.runner.kv_cache.shape[:-1]
    assert full.runner.kv_scales is None
    assert (tokens_layer_heads * per_head * 4, tokens_layer_heads * (per_head + 4)) == (2048, 640)
    assert (full.num_kv_blocks, fp8.num_kv_blocks) == (32, 102)
    assert fp8.runner.kv_cache.nbytes + fp8.runner.kv_scales.nbytes == 103 * 640  # with the scratch block
    fp8.free_cache()
    assert fp8.runner.kv_cache is None and fp8.runner.kv_scales is None


def test_block_copies_carry_the_scales():
    # a fork's first write into a shared, partly filled last block copies that block first (the scheduler's
    # `copies`): its e4m3 values and their scales, in every layer, and nothing else
    from types import SimpleNamespace

    engine = make_engine(tiny_model(tiny_args("llama")), kv_cache_dtype="fp8", num_kv_blocks=16)
    engine.init_cache()
    runner = engine.runner
    g = torch.Generator().manual_seed(2)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g).to(FP8))
    runner.kv_scales.copy_(torch.rand(runner.kv_scales.shape, generator=g))
    before = runner.kv_cache.float().clone(), runner.kv_scales.clone()
    runner._apply_updates(SimpleNamespace(block_table_updates=[], copies=[(3, 7), (5, 2)]))
    for cache, old in zip((runner.kv_cache.float(), runner.kv_scales), before):
        assert torch.equal(cache[:, :, 7], old[:, :, 3]) and torch.equal(cache[:, :, 2], old[:, :, 5])
        keep = [b for b in range(cache.shape[2]) if b not in (7, 2)]
        assert torch.equal(cache[:, :, keep], old[:, :, keep])


def _kv_rounded_reference(model, monkeypatch, weights_fp8: bool = False):
    """The training model in float64 whose attention sees each token's K (after RoPE) and V rounded to e4m3 with
    one scale per KV head, as the engine's cache holds them (`quantize_rows`); with `weights_fp8`, also the fp8
    projections' reference (`_fake_quant_reference`)."""
    ref = _fake_quant_reference(model) if weights_fp8 else __import__("copy").deepcopy(model).double()
    attend = transformer.attention_padded

    def rounded(t):
        q, scale = quantize_rows(t)
        return q.double() * scale.double()[..., None]

    monkeypatch.setattr(transformer, "attention_padded", lambda q, k, v, *a: attend(q, rounded(k), rounded(v), *a))
    return ref


@pytest.mark.parametrize("kind,quantization", [("qwen2", None), ("llama", None), ("qwen2", "fp8")])
def test_fp8_kv_engine_matches_a_training_forward_over_rounded_kv(kind, quantization, monkeypatch):
    # As in test_fp8_rollout: the float32 engine and the float64 reference round the same K/V values to e4m3
    # except within float32 noise of a rounding boundary, which moves one sequence's later log-probs; the
    # median over 16 samples holds. n=2 forks each prompt: the second sample's first write into the shared,
    # partly filled last block copies it (values and scales) first. A scale misapplied moves every token.
    model = tiny_model(tiny_args(kind))
    engine = make_engine(model, kv_cache_dtype="fp8", quantization=quantization)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)
    outs = engine.generate(prompts_of([3 + i % 12 for i in range(8)]), params)
    outs = [o for group in outs for o in (group if isinstance(group, list) else [group])]
    assert len(outs) == 16
    with torch.no_grad():
        ref = _kv_rounded_reference(model, monkeypatch, weights_fp8=quantization == "fp8")
    assert _logprob_errors(ref, outs).median().item() < 1e-4
    monkeypatch.undo()
    plain = _fake_quant_reference(model) if quantization else model
    assert _logprob_errors(plain, outs).mean().item() > 1e-3  # the cache's rounding is real


def test_fp8_kv_config_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs dtype bfloat16 or float32"):
        EngineConfig(kv_cache_dtype="fp8", dtype=torch.float16)
    # a CPU engine in float32 takes it
    assert LLMEngine(tiny_args("llama"), EngineConfig(dtype=torch.float32, kv_cache_dtype="fp8", num_kv_blocks=8),
                     device="cpu").runner.kv_fp8
