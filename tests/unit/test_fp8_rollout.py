"""fp8 rollout (`EngineConfig.quantization = "fp8"`): the quantizers against their error bounds, the e4m3 GEMM
against float64, and the engine against an independent fake-quantized training forward."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import EngineConfig, LLMEngine, SamplingParams
from rollout.ops import FP8, FP8_MAX, TorchOps, quantize_fp8, scaled_linear
from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model

E4M3_HALF_ULP = 2.0 ** -4  # relative, normal e4m3 values (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # absolute, in units of the scale (subnormal spacing 2^-9)


def _within_e4m3_rounding(deq: torch.Tensor, exact: torch.Tensor, scale) -> bool:
    bound = E4M3_HALF_ULP * exact.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
    return bool(((deq - exact).abs() <= bound * (1 + 1e-6)).all())


def test_quantize_fp8_hand_values_and_bound():
    t = torch.tensor([[1.0, -2.0, 0.5], [4.0, 3.0, -0.0625]])
    q, scale = quantize_fp8(t)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.item() == torch.tensor(4.0 / 448, dtype=torch.float32).item()  # the largest |t| maps to 448
    # t * 112: 336 lies halfway between e4m3's 320 and 352 and rounds to the even mantissa (320)
    assert q.float().tolist() == [[112.0, -224.0, 56.0], [448.0, 320.0, -7.0]]
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 80, generator=g).double() * torch.logspace(-3, 1, 80, dtype=torch.float64)
    q, scale = quantize_fp8(t)
    assert _within_e4m3_rounding(q.double() * scale.double(), t, scale.item())
    assert q.float().abs().max().item() == FP8_MAX
    zero_q, zero_scale = quantize_fp8(torch.zeros(3, 4))
    assert not zero_q.float().any() and zero_scale.item() > 0


def test_silu_and_mul_fp8_rows_against_float64():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(5, 2 * 48, generator=g) * torch.tensor([0.01, 1.0, 3.0, 0.0, 100.0])[:, None]
    q, scale = TorchOps.silu_and_mul_fp8(gate_up)
    assert q.dtype == FP8 and scale.shape == (5,)
    v = torch.nn.functional.silu(gate_up[:, :48].double()) * gate_up[:, 48:].double()
    for t in range(5):
        if t == 3:  # an all-zero row (a padded row) stays zero
            assert not q[t].float().any()
            continue
        amax = v[t].abs().max()
        assert abs(scale[t].item() - amax.item() / FP8_MAX) <= 1e-6 * amax.item() / FP8_MAX
        assert q[t].float().abs().max().item() == FP8_MAX
        assert _within_e4m3_rounding(q[t].double() * scale[t].double(), v[t], scale[t].item() * (1 + 1e-5))


def test_scaled_linear_against_float64():
    # e4m3 products are exact in float32; the float32 sum of K of them, the rounding of the product (before the
    # bias or with it) and of the result to the output dtype bound the rest
    g = torch.Generator().manual_seed(2)
    x, xs = quantize_fp8(torch.randn(7, 96, generator=g))
    w, ws = quantize_fp8(torch.randn(40, 96, generator=g))
    product = (x.double() * xs.double()) @ (w.double() * ws.double()).t()
    terms = (x.double().abs() * xs.double()) @ (w.double().abs() * ws.double()).t()
    for dtype, half_ulp in ((torch.float32, 2.0 ** -24), (torch.bfloat16, 2.0 ** -9)):
        bias = torch.randn(40, generator=g).to(dtype)
        exact = product + bias.double()
        y = scaled_linear(x, w, xs, ws, bias, dtype)
        assert y.dtype == dtype
        bound = half_ulp * (exact.abs() + terms) + 2 * 96 * 2.0 ** -24 * terms
        assert bool(((y.double() - exact).abs() <= bound).all())
        # a scale left out is far outside it
        assert not bool(((scaled_linear(x, w, xs, torch.ones(()), bias, dtype).double() - exact).abs() <= bound).all())


def test_scaled_linear_fast_accumulation_from_the_row_threshold(monkeypatch):
    # cuBLASLt's fast accumulation is asked for from FP8_FAST_ACCUM_MIN_ROWS rows up (decode steps of 128+ rows,
    # prefill), never below, with or without a bias; the result is the same product either way on the CPU
    import rollout.ops as ops_mod
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs["use_fast_accum"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    g = torch.Generator().manual_seed(3)
    w, ws = quantize_fp8(torch.randn(24, 32, generator=g))
    t = ops_mod.FP8_FAST_ACCUM_MIN_ROWS
    for rows, bias, out in ((1, None, torch.bfloat16), (t - 1, None, torch.float32), (t, None, torch.bfloat16),
                            (t + 5, torch.randn(24, generator=g), torch.float32)):
        x, xs = quantize_fp8(torch.randn(rows, 32, generator=g))
        y = scaled_linear(x, w, xs, ws, bias, out)
        assert seen[-1] is (rows >= t) and y.shape == (rows, 24)
    assert seen == [False, False, True, True]


def _fake_quant_reference(model, tp: int = 1):
    """The training model computing what the fp8 engine should, in float64, built from the model's own weights:
    each RMSNorm's weight folded into the projections after it (q/k/v, gate/up: the norms' weights become 1),
    every fused projection rounded to e4m3 with one scale (`quantize_fp8`), every q/k/v and gate/up input
    rounded to e4m3 with the fixed scale sqrt(H) / 448, down_proj's input row by row - with `tp` ranks, each
    rank's slice of the row (its shard of the intermediate size) by its own scale."""
    ref = copy.deepcopy(model).double()
    act = model.args.hidden_size ** 0.5 / FP8_MAX

    def fixed_scale(_, inputs):
        (x,) = inputs
        return ((x / act).to(FP8).double() * act,)

    def row_scale(_, inputs):
        (x,) = inputs
        x = x.unflatten(-1, (tp, -1))
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
        return (((x / s).to(FP8).double() * s).flatten(-2),)

    def fake_quant(*weights, norm=None):
        w = torch.cat([m.weight.detach().float() for m in weights])
        q, scale = quantize_fp8(w if norm is None else w * norm.weight.detach().float())
        with torch.no_grad():
            for m, part in zip(weights, (q.double() * scale.double()).split([m.weight.shape[0] for m in weights])):
                m.weight.copy_(part)

    for block in ref.layers:
        attn, mlp = block.self_attn, block.mlp
        fake_quant(attn.q_proj, attn.k_proj, attn.v_proj, norm=block.input_layernorm)
        fake_quant(mlp.gate_proj, mlp.up_proj, norm=block.post_attention_layernorm)
        fake_quant(mlp.down_proj)
        with torch.no_grad():
            block.input_layernorm.weight.fill_(1.0)
            block.post_attention_layernorm.weight.fill_(1.0)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            lin.register_forward_pre_hook(fixed_scale)
        mlp.down_proj.register_forward_pre_hook(row_scale)
    return ref


def _logprob_errors(model, outs) -> torch.Tensor:
    """|engine log-prob - `model`'s teacher-forced log-prob| of every sampled token."""
    errs, device = [], next(model.parameters()).device
    for out in outs:
        p = len(out.prompt_token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt_token_ids + out.token_ids], device=device))[0, p - 1:-1]
        lp = torch.log_softmax(logits.double().cpu(), -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        errs.append((lp - torch.tensor(out.logprobs, dtype=torch.float64)).abs())
    return torch.cat(errs)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_fp8_engine_matches_a_fake_quantized_training_forward(kind):
    # The float32 engine and the float64 reference round the same values to e4m3, except where one lies within
    # float32 noise of a rounding boundary. Such a flip moves the log-probs of its sequence from there on
    # (up to 4e-2 in one of 20 runs of 4 x 12 tokens): 16 short samples keep any flip to a sixteenth of the
    # tokens, and the median holds unless half of them flip. Bugs (a norm not folded, a scale not applied)
    # move every token by e4m3's ~0.1, as e4m3 moves them from the exact model's (0.08-0.18, 20 tiny models).
    model = tiny_model(tiny_args(kind))
    engine = make_engine(model, quantization="fp8")
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3, ignore_eos=True)
    outs = engine.generate(prompts_of([3 + i % 12 for i in range(16)]), params)
    assert engine.last_stats["quantize_s"] > 0 and not engine.model.fp8_stale
    assert _logprob_errors(_fake_quant_reference(model), outs).median().item() < 1e-4
    assert _logprob_errors(model, outs).mean().item() > 0.03  # the quantization is real


def test_fp8_weights_follow_every_weight_write():
    model = tiny_model(tiny_args("qwen2"))
    engine = make_engine(model, quantization="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = prompts_of([6, 4])
    first = engine.generate(prompts, params)
    other = tiny_model(tiny_args("qwen2"), seed=7)
    with torch.no_grad():
        for name, slot in engine.param_slots().items():  # as the resharder writes
            slot.view.copy_(dict(other.named_parameters())[name])
    assert engine.model.fp8_stale
    second = engine.generate(prompts, params)
    assert [o.token_ids for o in second] != [o.token_ids for o in first]
    fresh = make_engine(other, quantization="fp8")
    assert [o.token_ids for o in fresh.generate(prompts, params)] == [o.token_ids for o in second]
    engine.free_weights()
    engine.load_weights(other.named_parameters())
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in second]


def test_fp8_gives_the_model_dtype_projections_back_between_writes():
    model = tiny_model(tiny_args("llama"))
    engine = make_engine(model, quantization="fp8")
    m = engine.model
    proj_bytes = m.proj_storage.untyped_storage().nbytes()
    assert proj_bytes == 4 * m.fp8_weight_bytes  # float32 engine: 4 bytes a projection weight, 1 in e4m3
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = prompts_of([6, 4])
    first = engine.generate(prompts, params)
    assert m.proj_storage.untyped_storage().nbytes() == 0 and m.allocated  # quantized, then given back
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in first]  # no write: kept
    engine.param_slots()  # re-allocated for a write that does not come
    assert m.proj_storage.untyped_storage().nbytes() == proj_bytes
    with pytest.raises(RuntimeError, match="not finite"):
        engine.generate(prompts, params)
    engine.load_weights(model.named_parameters())
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in first]


def test_fp8_config_errors():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int8")
    model = tiny_model(tiny_args("qwen2"))
    engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=64,
                                                quantization="fp8"), device="cpu")
    engine.load_weights(model.named_parameters())
    engine.model.fp8_stale = True
    with pytest.raises(RuntimeError, match="stale"):
        engine.runner.model.forward(*([None] * 6), ops=None)
