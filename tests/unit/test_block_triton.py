"""The fused RMSNorm, SwiGLU and RoPE (`models/block_ops.py`, kernels in `models/block_triton.py`)
against float64 references of the eager formulas, on CPU under Triton's interpreter; the path choice.

As in tests/unit/test_lm_head_triton.py: `TRITON_INTERPRET=1` must be set before triton is
imported, so the kernel checks run in one child process (this file run as a script) and the
tests read its report. The path-choice tests run in the pytest process.

Error measure: max |a - ref| / max |ref| over a tensor, `ref` the float64 eager formula on
the same (rounded) inputs. Tolerances:
* float32: `FP32_TOL`, 8 float32 ulps of the largest value. Both paths compute in float32;
  they differ by summation order (the norm's mean, its backward's row sums), a few ulps.
* bfloat16: at most `BF16_FACTOR` times the eager bf16 path's own error against float64.
  The forwards round where eager rounds (same error); the backwards keep float32 until the
  output where autograd rounds every intermediate gradient to bf16 (less error). The factor
  leaves room for float32 differences that flip a bf16 rounding here and there. The child
  makes the interpreter round float32 to bf16 to nearest, as the GPU does (Triton 3.9's
  truncates: `_round_bf16_like_the_gpu`), or, with a Triton where that cannot be done, leaves
  the bf16 inputs out; tests/gpu/test_block_triton_gpu.py holds the same factor.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from tests import interpreter

ENV = "MESHPPO_FUSED_OPS"
FP32_TOL = 8 * torch.finfo(torch.float32).eps
BF16_FACTOR = 1.5
# GeGLU's backward (gelu_tanh's derivative, `1 - tanh²` cancelling for large |gate|) puts the fused and eager
# gradients further apart: over 16 input seeds the fused `dgate` came within 12.7 float32 ulps of the largest value
# (FP32_TOL's 8 failed 3 of the first 12; CI failed so once) and within 1.54 × eager's bf16 error: these bounds leave
# 2.5 and 1.6 times that
GELU_FP32_TOL = 32 * torch.finfo(torch.float32).eps
GELU_BF16_FACTOR = 2.5
CHECKS = ["rms_norm", "rms_norm_weight_promotion", "rms_norm_unit_offset", "swiglu", "swiglu_down", "geglu",
          "geglu_down", "swiglu_down_keeps_less", "rope_packed", "rope_padded", "transformer", "transformer_gemma3"]


# ---------------------------------------------------------------------------- shared with the GPU test


@contextlib.contextmanager
def fused_ops(choice: str):
    """`MESHPPO_FUSED_OPS=choice` inside the block (forward and backward)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = choice
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV)
        else:
            os.environ[ENV] = old


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    assert a.shape == ref.shape, (a.shape, ref.shape)
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _values_and_grads(fn, args, needs_grad, grad_outs):
    """fn(*args)'s outputs and the gradients of its differentiable args for `grad_outs`."""
    args = [a.detach().clone().requires_grad_(n) for a, n in zip(args, needs_grad)]
    outs = fn(*args)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grad_outs)])
    return [o.detach() for o in outs] + [a.grad for a, n in zip(args, needs_grad) if n]


def compare_op(ops, args, needs_grad, names, bf16_factor: float, fp32_tol: float = FP32_TOL) -> dict:
    """`ops` = (reference, eager, fused): run `reference` on `args` in float64, `eager` and
    `fused` on `args`; assert equal output dtypes and the tolerance on every output and input
    gradient (for a low-precision forward, also an error no smaller than eager's over the
    factor); return {name: (fused error, eager error)}."""
    reference, eager, fused = ops
    g = torch.Generator(device=args[0].device).manual_seed(0)  # the output gradients: the same for all three
    with fused_ops("torch"), torch.no_grad():
        grad_outs = [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in eager(*args)]
    with fused_ops("torch"):
        eag = _values_and_grads(eager, args, needs_grad, grad_outs)
        ref = _values_and_grads(reference, [a.double() for a in args], needs_grad, [x.double() for x in grad_outs])
    got = _values_and_grads(fused, args, needs_grad, grad_outs)
    low_precision = any(a.dtype != torch.float32 for a in args)
    errs = {}
    for i, (name, f, e, r) in enumerate(zip(names, got, eag, ref)):
        assert f.dtype == e.dtype, f"{name}: fused dtype {f.dtype}, eager {e.dtype}"
        errs[name] = (rel_err(f, r), rel_err(e, r))
        ef, ee = errs[name]
        bound = bf16_factor * ee if low_precision else fp32_tol
        assert ef <= bound, f"{name}: fused error {ef:.3g} > {bound:.3g} (eager {ee:.3g})"
        if low_precision and i < len(grad_outs):
            # a forward rounds where eager rounds: not more precise either
            assert ef >= ee / bf16_factor, f"{name}: fused error {ef:.3g} << eager {ee:.3g}: a rounding skipped"
    return errs


def _tolerances(act: str) -> dict:
    """`compare_op`'s bounds (`bf16_factor`, `fp32_tol`) for a gated MLP of activation `act`."""
    gelu = act == "gelu_tanh"
    return {"bf16_factor": GELU_BF16_FACTOR if gelu else BF16_FACTOR, "fp32_tol": GELU_FP32_TOL if gelu else FP32_TOL}


def rms_norm_ops(eps: float, unit_offset: bool = False):
    """(reference, eager, fused) RMSNorm of (x, weight) (`unit_offset`: Gemma 3's, times 1 + weight). The
    module's eager formula normalises in float32 whatever the input (`x.float()`): the float64 reference writes it
    out in float64."""
    from models import block_ops
    from models.transformer import RMSNorm

    def reference(x, w):
        return ((1 + w if unit_offset else w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),)

    def eager(x, w):
        return (torch.func.functional_call(RMSNorm(w.shape[0], eps, unit_offset), {"weight": w}, (x,)),)

    return reference, eager, lambda x, w: (block_ops.rms_norm(x, w, eps, unit_offset),)


def _gelu_tanh64(g):
    """The tanh-approximated GELU written out (float64 reference of F.gelu(approximate="tanh"))."""
    return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))


def swiglu_ops(act: str = "silu"):
    """(reference, eager, fused) `act(gate) * up` (silu; "gelu_tanh": Gemma 3's GeGLU, whose reference is the
    formula written out): the eager formula is its own float64 reference."""
    from models import block_ops

    def eager(gate, up):
        return (block_ops.activation(gate, act) * up,)

    def reference(gate, up):
        return ((_gelu_tanh64(gate) if act == "gelu_tanh" else F.silu(gate)) * up,)

    return reference, eager, lambda gate, up: (block_ops.swiglu(gate, up, act),)


def swiglu_down_ops(act: str = "silu"):
    """(reference, eager, fused) `F.linear(act(gate) * up, weight[, bias])`: the eager formula is
    its own float64 reference (GeGLU's written out)."""
    from models import block_ops

    def eager(gate, up, weight, *bias):
        return (F.linear(block_ops.activation(gate, act) * up, weight, *bias),)

    def reference(gate, up, weight, *bias):
        return (F.linear((_gelu_tanh64(gate) if act == "gelu_tanh" else F.silu(gate)) * up, weight, *bias),)

    return reference, eager, lambda gate, up, weight, *bias: (block_ops.swiglu_down(gate, up, weight, *bias, act=act),)


def swiglu_down_inputs(lead: tuple, m: int, n: int, dtype, bias: bool, device="cpu"):
    """gate, up `[*lead, m]`, weight `[n, m]` of std 1/sqrt(m) (and a bias `[n]`)."""
    gate, up = 3 * torch.randn(*lead, m, device=device), torch.randn(*lead, m, device=device)
    weight = torch.randn(n, m, device=device) / m ** 0.5
    return [t.to(dtype) for t in (gate, up, weight, *([torch.randn(n, device=device)] if bias else []))]


def rope_ops():
    """(reference, eager, fused) RoPE of (q, k, cos, sin): `apply_rope` on each, or one fused call."""
    from models import block_ops
    from models.transformer import apply_rope

    def eager(q, k, cos, sin):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    return eager, eager, block_ops.rope


def rope_inputs(lead: tuple, hq: int, hkv: int, d: int, dtype, device="cpu", positions=None):
    """q [*lead, hq, d], k [*lead, hkv, d] and cos/sin [*lead, d]: the model's tables at
    `positions` (both halves equal) or, without positions, random ones (halves differ)."""
    from models import ModelArgs
    from models.transformer import rope_cos_sin, rope_inv_freq

    q = torch.randn(*lead, hq, d, device=device).to(dtype)
    k = torch.randn(*lead, hkv, d, device=device).to(dtype)
    if positions is None:
        cos, sin = ((torch.rand(*lead, d, device=device) * 2 - 1).to(dtype) for _ in range(2))
    else:
        args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
        cos, sin = rope_cos_sin(rope_inv_freq(args, device=device), positions.to(device), dtype)
    return q, k, cos, sin


# ---------------------------------------------------------------------------- interpreter checks


def _checks(bf16: bool = True) -> dict:
    """The interpreter checks; `bf16=False` (an interpreter that cannot round to bf16 as the GPU
    does) leaves out the bf16 inputs."""
    from models import ModelArgs, Transformer, block_triton, cu_seqlens_from_lengths

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)

    def rms_norm():
        errs = {}
        ops = rms_norm_ops(1e-6)
        for dtype in dtypes:
            for shape in ((7, 96), (2, 5, 96), (13, 40)):
                x = (2 * torch.randn(shape)).to(dtype)
                w = (1 + 0.2 * torch.randn(shape[-1])).to(dtype)
                errs[f"{dtype} {shape}"] = compare_op(ops, [x, w], [True, True], ["out", "dx", "dw"],
                                                      BF16_FACTOR)
        # the backward with programs that take several rows each (the last one fewer), against
        # the one-row-per-program launch: dx is per row, dw sums per-program partials
        x, w = torch.randn(13, 40), 1 + 0.2 * torch.randn(40)
        out, rstd = block_triton.rms_norm_fwd(x, w, 1e-6)
        dout = torch.randn(13, 40)
        dx1, dw1 = block_triton.rms_norm_bwd(x, w, rstd, dout)
        dx3, dw3 = block_triton.rms_norm_bwd(x, w, rstd, dout, programs=3)
        assert torch.equal(dx1, dx3), "dx depends on how rows are split over programs"
        errs["dw over 3 programs"] = rel_err(dw3, dw1)
        assert errs["dw over 3 programs"] <= FP32_TOL
        dx, dw = block_triton.rms_norm_bwd(x, w, rstd, dout, with_dw=False)
        assert torch.equal(dx, dx1) and dw is None
        # no rows (an empty input): dweight is zeros, as eager's, however dirty the memory it could come from
        _, eager, fused = ops
        for fn, choice in ((eager, "torch"), (fused, "triton")):
            for _ in range(3):
                dirt = torch.full((4, 96), float("nan"))
                del dirt
                x0, w0 = torch.randn(2, 0, 96, requires_grad=True), (1 + 0.2 * torch.randn(96)).requires_grad_()
                with fused_ops(choice):
                    fn(x0, w0)[0].sum().backward()
                assert x0.grad.shape == x0.shape and torch.equal(w0.grad, torch.zeros(96)), (choice, w0.grad[:4])
        return errs

    def rms_norm_weight_promotion():
        # float32 weight, bf16 input: eager's `weight * y.to(bf16)` is float32; so is the fused output
        if not bf16:
            return "bf16 left out: this interpreter truncates to bf16"
        ops = rms_norm_ops(1e-5)
        _, eager, fused = ops
        x, w = torch.randn(9, 96).bfloat16(), 1 + 0.2 * torch.randn(96)
        assert fused(x, w)[0].dtype == torch.float32
        return compare_op(ops, [x, w], [True, True], ["out", "dx", "dw"], BF16_FACTOR)

    def rms_norm_unit_offset():
        # Gemma 3's norm: times 1 + weight in float32, rounded once; weights near 0 as its checkpoints store them
        errs = {}
        ops = rms_norm_ops(1e-6, unit_offset=True)
        for dtype in dtypes:
            for shape in ((7, 96), (2, 5, 96), (13, 40), (4, 3, 256)):  # (256: Gemma 3's per-head q / k norm)
                x = (2 * torch.randn(shape)).to(dtype)
                w = (0.3 * torch.randn(shape[-1])).to(dtype)
                errs[f"{dtype} {shape}"] = compare_op(ops, [x, w], [True, True], ["out", "dx", "dw"], BF16_FACTOR)
                assert ops[2](x, w)[0].dtype == x.dtype
        return errs

    def swiglu(act="silu"):
        errs = {}
        ops = swiglu_ops(act)
        for dtype in dtypes:
            for shape in ((7, 80), (3, 5, 37)):
                gate, up = (3 * torch.randn(shape)).to(dtype), torch.randn(shape).to(dtype)
                errs[f"{dtype} {shape}"] = compare_op(ops, [gate, up], [True, True], ["out", "dgate", "dup"],
                                                      **_tolerances(act))
        return errs

    def geglu():
        return swiglu("gelu_tanh")

    def geglu_down():
        return swiglu_down("gelu_tanh")

    def swiglu_down(act="silu"):
        errs = {}
        ops = swiglu_down_ops(act)
        for dtype in dtypes:
            for lead, m, n, bias in (((7,), 80, 40, False), ((3, 5), 37, 24, True)):
                args = swiglu_down_inputs(lead, m, n, dtype, bias)
                names = ["out", "dgate", "dup", "dweight"] + (["dbias"] if bias else [])
                errs[f"{dtype} {lead} {m}->{n}"] = compare_op(ops, args, [True] * len(args), names, **_tolerances(act))
        return errs

    def swiglu_down_keeps_less():
        """What autograd keeps for backward, counted by a saved-tensors hook: the fused SwiGLU then
        the projection keep gate, up, the product and the weight; `swiglu_down` all but the product."""
        from models import block_ops

        def kept(fn, args):
            seen = {}

            def pack(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            args = [a.detach().clone().requires_grad_() for a in args]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = fn(*args)
            y.sum().backward()
            return sum(seen.values())

        errs = {}
        for dtype in dtypes:
            gate, up, weight = swiglu_down_inputs((6, 5), 64, 24, dtype, bias=False)
            before = kept(lambda g, u, w: F.linear(block_ops.swiglu(g, u), w), [gate, up, weight])
            after = kept(block_ops.swiglu_down, [gate, up, weight])
            product = gate.numel() * gate.element_size()
            assert before == 3 * product + weight.numel() * weight.element_size(), (dtype, before)
            assert after == before - product, (dtype, before, after)
            errs[str(dtype)] = after / before
        return errs

    def rope_packed():
        # [1, T, heads, D] with the model's cos/sin [1, T, D] at restarting positions
        errs = {}
        ops = rope_ops()
        for dtype in dtypes:
            for hq, hkv, d in ((3, 1, 16), (6, 2, 32), (2, 2, 24)):
                pos = torch.cat([torch.arange(7), torch.arange(4), torch.arange(40, 46)])[None]
                args = rope_inputs((1, pos.shape[1]), hq, hkv, d, dtype, positions=pos)
                errs[f"{dtype} {hq}/{hkv}x{d}"] = compare_op(ops, args, [True, True, False, False],
                                                             ["q", "k", "dq", "dk"], BF16_FACTOR)
                # both halves of the model's tables are equal: fused forward values are eager's
                with fused_ops("torch"):
                    assert all(torch.equal(a, b) for a, b in zip(ops[2](*args), ops[1](*args)))
        return errs

    def rope_padded():
        # [B, S, heads, D] with cos/sin [B, S, D]; random tables whose halves differ
        errs = {}
        ops = rope_ops()
        for dtype in dtypes:
            for hq, hkv, d in ((3, 1, 16), (4, 2, 32)):
                args = rope_inputs((3, 5), hq, hkv, d, dtype)
                errs[f"{dtype} {hq}/{hkv}x{d}"] = compare_op(ops, args, [True, True, False, False],
                                                             ["q", "k", "dq", "dk"], BF16_FACTOR)
        return errs

    def transformer(args=None, expected_calls=None):
        """A tiny model, fused ops forced on vs off, float32: padded logits and packed log-probs,
        each with every parameter's gradient. Tolerance 1e-5 (normwise, ~80 float32 ulps): the
        per-op few-ulp differences, carried through two layers, the attention and the LM head."""
        calls = {}

        def counted(name):
            fn = getattr(block_triton, name)

            def run(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return fn(*args, **kwargs)
            return run

        kernels = ("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope")
        originals = {name: getattr(block_triton, name) for name in kernels}
        for name in kernels:
            setattr(block_triton, name, counted(name))
        args = args or ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                 num_attention_heads=3, num_key_value_heads=1, attention_bias=True)
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():  # weights of std 0.1, norms and biases not 1 and 0
                if "norm" in name or "bias" in name:
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.mul_(5)
        ids = torch.randint(0, 61, (2, 9))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding
        lengths = [5, 9, 4]
        packed = torch.randint(0, 61, (1, sum(lengths)))
        cu = cu_seqlens_from_lengths(lengths)

        def run(choice):
            out = {}
            for layout in ("padded", "packed"):
                model.zero_grad(set_to_none=True)
                with fused_ops(choice):
                    if layout == "padded":
                        y = model(ids, attention_mask=mask)
                    else:
                        y, _ = model(packed, cu_seqlens=cu, labels=torch.roll(packed, -1, 1))
                    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
                out[layout] = y.detach()
                out.update({f"{layout} {n}": p.grad for n, p in model.named_parameters()})
            return out

        try:
            ref = run("torch")
            assert not calls, f"MESHPPO_FUSED_OPS=torch ran kernels: {calls}"
            got = run("triton")
        finally:
            for name, fn in originals.items():
                setattr(block_triton, name, fn)
        # per forward: 2 norms per layer + the final one, one SwiGLU and one RoPE per layer
        assert calls == (expected_calls or {"rms_norm_fwd": 10, "rms_norm_bwd": 10, "swiglu_fwd": 4,
                                            "swiglu_bwd": 4, "rope": 8}), calls
        errs = {name: rel_err(got[name], ref[name]) for name in ref}
        worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
        assert worst[0][1] <= 1e-5, worst
        return max(errs.values())

    def transformer_gemma3():
        """`transformer` on a Gemma 3 (norms by 1 + weight, GeGLU, one sliding layer with its RoPE and window of 3):
        per forward 6 norms a layer (four, q and k) + the final one."""
        args = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16, model_type="gemma3_text",
                         extra_hf={"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]})
        return transformer(args, {"rms_norm_fwd": 26, "rms_norm_bwd": 26, "swiglu_fwd": 4, "swiglu_bwd": 4,
                                  "rope": 8})

    return locals()


interpreter_report, test_fused_op_matches_float64_under_interpreter, test_fused_op_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


# ---------------------------------------------------------------------------- the path choice


def test_env_choice(monkeypatch):
    from models.block_ops import use_fused_ops

    cpu = torch.zeros(2)
    monkeypatch.delenv(ENV, raising=False)
    assert not use_fused_ops(cpu), "auto takes the eager path on CPU"
    monkeypatch.setenv(ENV, "auto")
    assert not use_fused_ops(cpu)
    monkeypatch.setenv(ENV, "triton")
    assert use_fused_ops(cpu) and use_fused_ops(cpu.bfloat16(), cpu.half())
    assert not use_fused_ops(cpu.double()), "no kernel for float64"
    assert not use_fused_ops(cpu.bfloat16(), cpu, same_dtype=True), "mixed dtypes promote: eager"
    monkeypatch.setenv(ENV, "torch")
    assert not use_fused_ops(cpu)
    monkeypatch.setenv(ENV, "trition")
    with pytest.raises(ValueError, match=ENV):
        use_fused_ops(cpu)


def test_auto_asks_whether_triton_runs_on_the_device(monkeypatch):
    from models import block_ops

    monkeypatch.delenv(ENV, raising=False)
    seen = []
    monkeypatch.setattr(block_ops, "triton_usable", lambda device: seen.append(device) or True)
    assert block_ops.use_fused_ops(torch.zeros(2)) and seen == [torch.device("cpu")]


def test_compiling_takes_the_eager_path(monkeypatch):
    """Under `torch.compile` the model's formulas are traced even with the kernels forced: were
    the Function traced instead, its Triton launch on CPU tensors (no interpreter here) would fail."""
    from models import ModelArgs
    from models.transformer import MLP, RMSNorm, apply_rope_qk

    monkeypatch.setenv(ENV, "triton")

    args = ModelArgs(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)
    norm, mlp = RMSNorm(32, 1e-6), MLP(args)
    norm.weight.data.uniform_(0.5, 1.5)

    def block(x, q, k, cos, sin):
        q, k = apply_rope_qk(q, k, cos, sin)
        return mlp(norm(x)), q, k

    x, q, k = torch.randn(5, 32), torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    torch._dynamo.reset()
    got = torch.compile(block, backend="eager", fullgraph=True)(x, q, k, cos, sin)
    with fused_ops("torch"):
        ref = block(x, q, k, cos, sin)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_dtensor_takes_the_eager_path(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from models.block_ops import use_fused_ops

    # (tests/conftest.py fails whichever earlier test of this process leaves a group behind)
    assert not dist.is_initialized(), "a process group already exists in this process: this test makes its own"
    monkeypatch.setenv(ENV, "triton")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
        assert use_fused_ops(torch.ones(4))
        assert not use_fused_ops(torch.ones(4), w)
    finally:
        dist.destroy_process_group()


def _interpreter_rounds_bf16() -> bool:
    """Whether this Triton interpreter converts float32 to bfloat16 as the GPU and torch do (to
    nearest even): a kernel casts values that sit between two bf16 numbers, nearer the upper."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    x = 1 + torch.arange(1, 9, dtype=torch.float32) * 2.0**-7 + 3 * 2.0**-9  # 3/4 of a bf16 ulp above
    y = torch.empty(8, dtype=torch.bfloat16)
    cast[(1,)](x, y, N=8)
    return torch.equal(y, x.bfloat16())


def _round_bf16_like_the_gpu() -> bool:
    """Make the interpreter round float32 to bf16 as the GPU does; False if it cannot be made to.
    Triton's interpreter (3.9) truncates, and truncated, every rounding the kernels share with
    eager doubles its error; its private converter is then replaced by torch's conversion. A
    Triton that rounds needs nothing; one that truncates and has no such converter to replace
    leaves the bf16 checks out of this file (tests/gpu/test_block_triton_gpu.py runs them)."""
    if _interpreter_rounds_bf16():
        return True
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    convert = getattr(triton_interpreter, "_convert_float", None)
    if convert is None:
        return False

    def rounded(x, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16()
            return t.view(torch.int16).numpy().view(np.uint16).reshape(x.shape)
        return convert(x, input_dtype, output_dtype, rounding_mode)

    triton_interpreter._convert_float = rounded
    return _interpreter_rounds_bf16()


if __name__ == "__main__":
    interpreter.main(_checks(bf16=_round_bf16_like_the_gpu()), CHECKS)


def test_mlp_fuses_the_down_projection_only_when_it_is_a_plain_linear(monkeypatch):
    """With the fused ops, a plain `down_proj` runs inside `swiglu_down` (its input not kept for
    backward); a LoRA `down_proj` runs its own forward, adapters included, after `swiglu`:
    `swiglu_down` reads only the base weight and would drop them. (Stand-ins with the eager
    formulas for the two Functions: no Triton here.)"""
    from models import ModelArgs, Transformer, block_ops
    from models.lora import LoRAConfig, inject_lora

    monkeypatch.setenv(ENV, "triton")
    calls = []

    def swiglu_down(gate, up, weight, bias=None, act="silu"):
        calls.append("swiglu_down")
        return F.linear(F.silu(gate) * up, weight, bias)

    def swiglu(gate, up, act="silu"):
        calls.append("swiglu")
        return F.silu(gate) * up

    monkeypatch.setattr(block_ops, "swiglu_down", swiglu_down)
    monkeypatch.setattr(block_ops, "swiglu", swiglu)
    args = ModelArgs(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
    x = torch.randn(3, 32)
    plain = Transformer.build(args, seed=0)
    lora = Transformer.build(args, seed=0)
    inject_lora(lora, LoRAConfig(rank=4, target_modules=["down_proj"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lora.layers[0].mlp.down_proj.lora_B.normal_()  # B starts at zero: make the adapter count
    outs = {}
    for name, model in (("plain", plain), ("lora", lora)):
        mlp = model.layers[0].mlp
        with fused_ops("torch"):
            ref = mlp(x)
        calls.clear()
        outs[name] = mlp(x)
        assert calls == (["swiglu_down"] if name == "plain" else ["swiglu"]), (name, calls)
        torch.testing.assert_close(outs[name], ref, rtol=0, atol=0)
    assert (outs["plain"] - outs["lora"]).abs().max() > 1e-3  # the same base: only the adapter differs
