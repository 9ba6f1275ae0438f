"""The fused RMSNorm, SwiGLU and RoPE on a CUDA GPU at a real size, and a 73M-parameter
transformer's forward and backward with them against the eager model, in bf16. Skipped
without CUDA.

The op checks are tests/unit/test_block_triton.py's (`compare_op`: float64 references of the
eager formulas, float32 within `FP32_TOL`, bf16 within `BF16_FACTOR` times the eager bf16
error) at the sizes of a packed update micro-batch: 27k tokens, hidden 768 and 896, head_dim 64.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.unit.test_block_triton import (  # noqa: E402
    BF16_FACTOR, ENV, compare_op, fused_ops, rms_norm_ops, rope_inputs, rope_ops, swiglu_down_inputs, swiglu_down_ops,
    swiglu_ops,
)

DEV = "cuda"
T = 27_001  # packed tokens of one micro-batch; odd
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(ENV, raising=False)
    torch.manual_seed(0)


def test_auto_takes_the_fused_path_on_cuda():
    from models.block_ops import use_fused_ops

    x = torch.zeros(4, device=DEV)
    assert use_fused_ops(x) and use_fused_ops(x.bfloat16())
    with fused_ops("torch"):
        assert not use_fused_ops(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 896])
def test_rms_norm(dtype, hidden):
    x = (2 * torch.randn(T, hidden, device=DEV)).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, device=DEV)).to(dtype)
    compare_op(rms_norm_ops(1e-6), [x, w], [True, True], ["out", "dx", "dw"], BF16_FACTOR)


def test_rms_norm_float32_weight_bf16_input():
    x = torch.randn(T, 896, device=DEV).bfloat16()
    w = 1 + 0.2 * torch.randn(896, device=DEV)
    compare_op(rms_norm_ops(1e-6), [x, w], [True, True], ["out", "dx", "dw"], BF16_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(27_001, 1152), (27_001 * 4, 256)])
def test_rms_norm_unit_offset(dtype, rows, width):
    """Gemma 3's norm by 1 + weight (0-centred weights) at gemma-3-1b's hidden size and its per-head q / k norm
    (head_dim 256, four heads a token)."""
    x = (2 * torch.randn(rows, width, device=DEV)).to(dtype)
    w = (0.3 * torch.randn(width, device=DEV)).to(dtype)
    compare_op(rms_norm_ops(1e-6, unit_offset=True), [x, w], [True, True], ["out", "dx", "dw"], BF16_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [2048, 4864])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_swiglu(dtype, intermediate, act):
    gate = (3 * torch.randn(T, intermediate, device=DEV)).to(dtype)
    up = torch.randn(T, intermediate, device=DEV).to(dtype)
    compare_op(swiglu_ops(act), [gate, up], [True, True], ["out", "dgate", "dup"], BF16_FACTOR)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_swiglu_down(act):
    """bf16 at qwen2.5-0.5b's MLP (4864 -> 896), and its GeGLU (Gemma 3's); float32 sums of 4864 products would
    sit too close to `FP32_TOL` (the interpreter checks float32 at small sizes)."""
    args = swiglu_down_inputs((T,), 4864, 896, torch.bfloat16, bias=False, device=DEV)
    compare_op(swiglu_down_ops(act), args, [True] * 3, ["out", "dgate", "dup", "dweight"], BF16_FACTOR)


def test_swiglu_down_does_not_keep_the_product():
    """Between forward and backward `swiglu_down` holds its output and no more; SwiGLU then the
    projection also hold the product `[T, 4864]` (bf16: 262 MB)."""
    from models import block_ops

    gate, up, weight = (t.requires_grad_() for t in swiglu_down_inputs((T,), 4864, 896, torch.bfloat16, bias=False,
                                                                      device=DEV))
    held = {}
    for name, fn in (("before", lambda: torch.nn.functional.linear(block_ops.swiglu(gate, up), weight)),
                     ("after", lambda: block_ops.swiglu_down(gate, up, weight))):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = fn()
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - base - y.untyped_storage().nbytes()
        y.float().sum().backward()
        del y
    product = gate.numel() * gate.element_size()
    assert abs(held["before"] - product) < 1 << 20 and abs(held["after"]) < 1 << 20, (held, product)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(12, 2), (14, 2)])
def test_rope_packed(dtype, heads):
    hq, hkv = heads
    lengths = torch.randint(50, 1500, (40,))
    pos = torch.cat([torch.arange(int(n)) for n in lengths])[:T]
    pos = torch.cat([pos, torch.arange(T - pos.numel())])[None]  # [1, T]
    args = rope_inputs((1, T), hq, hkv, 64, dtype, device=DEV, positions=pos)
    ops = rope_ops()
    compare_op(ops, args, [True, True, False, False], ["q", "k", "dq", "dk"], BF16_FACTOR)
    # the same roundings, no FMA: the forward values are eager's, bit for bit
    with fused_ops("torch"):
        assert all(torch.equal(a, b) for a, b in zip(ops[2](*args), ops[1](*args)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_padded(dtype):
    b, s = 16, 1700
    pos = (torch.arange(s)[None] - torch.randint(0, 300, (b, 1))).clamp(min=0)  # left padding
    args = rope_inputs((b, s), 12, 2, 64, dtype, device=DEV, positions=pos)
    compare_op(rope_ops(), args, [True, True, False, False], ["q", "k", "dq", "dk"], BF16_FACTOR)


def _norm_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def test_transformer_bf16_fused_matches_eager():
    """The 73M model of bench/learn (hidden 768, 12 layers, 12 heads, 2 KV heads, intermediate
    2048) in bf16, packed, log-probs of 8k tokens and every parameter's gradient: eager and fused
    against the same model in float32 (bf16 weights, float32 arithmetic). Fused and eager round
    the same values where the ops are concerned, and their backwards keep float32 longer; so the
    fused bf16 error may be at most `BF16_FACTOR` times the eager bf16 error, tensor by tensor
    (norm-wise). A wrong gradient anywhere in 12 layers is orders of magnitude off that."""
    from models import ModelArgs, Transformer, block_triton, cu_seqlens_from_lengths

    args = ModelArgs(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False)
    model = Transformer.build(args, device=DEV, dtype=torch.bfloat16, seed=0)
    ref_model = Transformer.build(args, device=DEV, dtype=torch.float32, seed=0)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(100, 900, (16,), generator=g).tolist()
    n = sum(lengths)
    ids = torch.randint(0, args.vocab_size, (1, n), generator=g).to(DEV)
    labels = torch.roll(ids, -1, 1)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    weights = torch.randn(1, n, generator=g).to(DEV)

    def run(m, choice):
        m.zero_grad(set_to_none=True)
        with fused_ops(choice):
            logp, _ = m(ids, cu_seqlens=cu, labels=labels)
            (logp * weights).sum().backward()
        return {"logp": logp.detach(), **{name: p.grad for name, p in m.named_parameters()}}

    calls = []
    rope = block_triton.rope
    block_triton.rope = lambda *a, **k: calls.append(1) or rope(*a, **k)
    try:
        fused = run(model, "auto")
    finally:
        block_triton.rope = rope
    assert len(calls) == 2 * args.num_hidden_layers, "auto did not take the fused path"
    eager = run(model, "torch")
    ref = run(ref_model, "torch")
    errs = {k: (_norm_err(fused[k], ref[k]), _norm_err(eager[k], ref[k])) for k in ref}
    bad = {k: e for k, e in errs.items() if not e[0] <= BF16_FACTOR * e[1]}
    assert not bad, bad
    assert errs["logp"][1] < 0.05, errs["logp"]  # the bf16 model is close to its float32 self at all
