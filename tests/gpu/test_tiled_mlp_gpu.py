"""The tiled MLP (models/tiled_mlp.py) on a CUDA GPU, bf16, qwen2.5-1.5b's MLP (hidden 1536,
intermediate 8960): gradients as close to float64 as the untiled MLP's, and the peak memory of a
forward and backward of 16k tokens lower by what the shapes say. Skipped without CUDA."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models import ModelArgs  # noqa: E402
from models.transformer import MLP  # noqa: E402

DEV = torch.device("cuda", 0)
H, M = 1536, 8960
ARGS = ModelArgs(vocab_size=128, hidden_size=H, intermediate_size=M, num_hidden_layers=1, num_attention_heads=12,
                 num_key_value_heads=2)


def _mlp(bias=False) -> MLP:
    torch.manual_seed(0)
    m = MLP(dataclasses.replace(ARGS, mlp_bias=bias))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.dim() == 1 else p.shape[1] ** -0.5))
    return m.to(DEV, torch.bfloat16)


def _inputs(tokens, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(1, tokens, H, generator=g, device=DEV).bfloat16()
    return x, torch.randn(1, tokens, H, generator=g, device=DEV).bfloat16()


def _grads(m, x, dy):
    x = x.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    m(x).backward(dy)
    return {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


@pytest.mark.parametrize("fused", ["auto", "torch"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_grads_are_as_close_to_float64_as_the_untiled_ones(fused, bias, monkeypatch):
    """4096 tokens in 7 tiles, with the Triton SwiGLU kernels (auto) and without (torch). Error:
    the largest difference to float64 over the largest entry, per gradient."""
    monkeypatch.setenv("MESHPPO_FUSED_OPS", fused)
    m = _mlp(bias)
    x, dy = _inputs(4096)
    ref = _grads(copy.deepcopy(m).double(), x.double(), dy.double())
    plain = _grads(m, x, dy)
    tiled = copy.deepcopy(m)
    tiled.num_shards = 7
    got = _grads(tiled, x, dy)

    def err(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for k in ref:
        assert got[k].dtype == torch.bfloat16
        e, e_plain = err(got[k], ref[k]), err(plain[k], ref[k])
        # bf16's relative rounding is 2^-8 = 3.9e-3 at most per value
        assert e < 1.6e-2 and e < 2 * e_plain + 4e-3, (k, e, e_plain)


def _peak(m, x, dy) -> int:
    """Bytes allocated at the peak of `m`'s forward and backward above what was there before
    (the weights, x and dy)."""
    x = x.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize(DEV)
    base = torch.cuda.memory_allocated(DEV)
    torch.cuda.reset_peak_memory_stats(DEV)
    m(x).backward(dy)
    torch.cuda.synchronize(DEV)
    return torch.cuda.max_memory_allocated(DEV) - base


def test_peak_memory_of_16k_tokens_is_that_of_one_tile():
    """T = 16384 tokens, 16 tiles. One [T, M] bf16 tensor is U = T·M·2 = 293.6 MB; [T, H] is
    X = T·H·2 = 50.3 MB; a weight H·M is 27.5 MB in bf16, 55.1 MB in float32.

    Untiled: its backward holds gate and up (saved) and dh = dy·W_down, then the gate, up and
    product tensors of the SwiGLU backward (the fused kernel's dg, du, h; eager's autograd also
    keeps silu(gate) and the product): at least 5 U = 1468 MB above the inputs.

    Tiled: the output and dx (2 X), the float32 gradient accumulators and their bf16 casts
    (3 · 82.6 MB), and at most 8 [T/16, M] tensors of one tile (8 U / 16 = 146.8 MB): 495 MB,
    with 32 MiB for the allocator's rounding and cuBLAS's workspace 529 MB. Lower by > 900 MB."""
    T = 16384
    U, X, W = T * M * 2, T * H * 2, H * M
    m = _mlp()
    x, dy = _inputs(T)
    _peak(m, x, dy)  # warm-up: cuBLAS handles and workspaces, Triton's compiled kernels
    plain = _peak(m, x, dy)
    tiled_m = copy.deepcopy(m)
    tiled_m.num_shards = 16
    _peak(tiled_m, x, dy)
    tiled = _peak(tiled_m, x, dy)
    bound = 2 * X + 3 * W * (4 + 2) + 8 * U // 16 + (32 << 20)
    assert plain >= 5 * U, (plain, 5 * U)
    assert tiled <= bound, (tiled, bound)
    assert plain - tiled > 900e6, (plain, tiled)
