"""Row-parallel projections as split-K products that the next RMSNorm sums (`rollout.model.split_k_splits`)."""

import pytest
import torch

import rollout.model as engine_model
from rollout import SamplingParams
from rollout.model import split_k_splits
from rollout.ops import TorchOps, split_k_products, sum_split_k
from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_k_sum_is_the_projection_rounded_once(dtype, splits):
    g = torch.Generator().manual_seed(splits)
    t, k, n = 7, 96, 40
    x = torch.randn(t, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    parts = split_k_products(x, w, splits)
    assert parts.shape == (splits, t, n) and parts.dtype == torch.float32
    y = sum_split_k(parts, dtype)
    exact = x.double() @ w.double().t()
    # Products of two bf16 / fp16 values are exact in float32; the float32 sum is within k * 2**-24 of
    # sum |x_i w_i|; one rounding to the dtype adds at most half an ulp of the result.
    acc_err = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    mant = torch.finfo(dtype).eps  # ulp at 1
    half_ulp = 0.5 * mant * torch.exp2(torch.floor(torch.log2(y.double().abs().clamp_min(1e-30))))
    assert ((y.double() - exact).abs() <= half_ulp + acc_err * (1 + mant)).all()


def test_rms_norm_sums_the_products_before_the_residual():
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(3, 5, 16, generator=g)
    res = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(torch.bfloat16)
    summed = ((parts[0] + parts[1]) + parts[2]).to(torch.bfloat16)  # in order, rounded once
    out, new_res = TorchOps.rms_norm(parts, w, 1e-6, res.clone())
    ref_out, ref_res = TorchOps.rms_norm(summed, w, 1e-6, res.clone())
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)
    with pytest.raises(ValueError, match="residual"):
        TorchOps.rms_norm(parts, w, 1e-6, None)


def test_split_k_splits_policy():
    # (N, K) of qwen2.5's o_proj and down_proj at 0.5b, 1.5b and 7b, and the measured choices
    bf16 = torch.bfloat16
    o05, down05, o15, down15, o7, down7 = (896, 896), (896, 4864), (1536, 1536), (1536, 8960), (3584, 3584), (3584, 18944)
    assert [split_k_splits(256, n, k, bf16) for n, k in (o05, down05, o15, down15)] == [2, 2, 2, 2]
    # 512 rows: the o_projs' outputs are large for their depth of K; the downs still split
    assert [split_k_splits(512, n, k, bf16) for n, k in (o05, down05, o15, down15)] == [1, 2, 1, 2]
    assert [split_k_splits(rows, *o7, bf16) for rows in (32, 128)] == [2, 1]
    assert [split_k_splits(rows, *down7, bf16) for rows in (128, 256)] == [2, 1]
    assert split_k_splits(1, *down05, bf16) == 1  # one row: the GEMV
    assert split_k_splits(1024, *down05, bf16) == 1  # prefill-sized steps
    assert split_k_splits(256, *down05, torch.float32) == 1
    assert split_k_splits(256, 896, 904, bf16) == 1  # K / 2 is not whole 16-byte vectors


def test_bf16_engine_with_split_k_decodes_as_without(monkeypatch):
    model = tiny_model(tiny_args("qwen2", eos_token_id=None)).to(torch.bfloat16)
    prompts = prompts_of([3, 9, 5, 12, 7, 4])
    params = SamplingParams(temperature=0, max_tokens=10)
    calls = []
    monkeypatch.setattr(engine_model, "split_k_products",
                        lambda x, w, s: calls.append((x.shape[0], w.shape[0], s)) or split_k_products(x, w, s))
    split = make_engine(model, dtype=torch.bfloat16, num_kv_blocks=64).generate(prompts, params)
    assert calls and all(s == 2 for *_, s in calls) and any(rows > 1 for rows, *_ in calls)
    assert {n for _, n, _ in calls} == {64, 128}  # o_proj and down_proj (N = hidden), qkv (summed in the attention)
    monkeypatch.setattr(engine_model, "split_k_splits", lambda rows, n, k, dtype: 1)
    calls.clear()
    plain = make_engine(model, dtype=torch.bfloat16, num_kv_blocks=64).generate(prompts, params)
    assert not calls
    # Only the order of float32 additions differs: the same greedy tokens (the tiny model's logits are
    # decisive), and log-probs within a few bf16 roundings.
    assert [o.token_ids for o in split] == [o.token_ids for o in plain]
    diff = max(abs(a - b) for s, p in zip(split, plain) for a, b in zip(s.logprobs, p.logprobs))
    assert diff < 0.05, diff
