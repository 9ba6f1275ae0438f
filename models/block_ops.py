"""Fused RMSNorm, SwiGLU and RoPE for the eager training model: autograd Functions over
`models/block_triton.py`'s kernels, and the choice of path.

`models.transformer` keeps the eager formulas (the reference, and the path under
`torch.compile`, on CPU and for DTensors) and calls these where `use_fused_ops` says so. Each
Function's forward gives the eager formula's values and dtype (the same roundings); its
backward is one kernel where autograd runs several ops, each with its own launch and node:
on a small model the eager update is bound by the host.

What each saves for backward: RMSNorm its input, weight and per-row rstd (eager saves a
float32 copy of the input); SwiGLU gate and up (eager also saves silu(gate)); RoPE nothing
but cos and sin. On an H200, the 73M model of bench/learn (hidden 768, 12 layers) ran the
packed forward and backward of 26k bf16 tokens in 49-54 ms instead of 72 ms, with a peak of
7.1 GiB instead of 10.3.

SwiGLU with the down projection after it (`swiglu_down`) saves gate, up and the weight, not
the product that the projection reads: the SwiGLU backward kernel writes it again, bit for
bit, while it reads gate and up for their gradients. Eager keeps that product for the
weight's gradient: one `[tokens, intermediate]` tensor a layer, the largest of a block's
activations with gate and up (8.2 GB for 16k tokens of qwen2.5-1.5b's 28 layers; its update's
peak fell from 57.2 to 50.4 GiB at the same speed on an H200).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.triton_support import path_choice, triton_usable

_ENV = "MESHPPO_FUSED_OPS"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_fused_ops(*tensors: torch.Tensor, same_dtype: bool = False) -> bool:
    """Whether an op on `tensors` takes the Triton path. Never while `torch.compile` traces
    (Inductor fuses the eager formula with its neighbours; a Function launching Triton kernels
    would break the graph), for a DTensor, or for a dtype other than float32 / bfloat16 /
    float16 (or, with `same_dtype`, for mixed dtypes, whose eager result is promoted). Else
    `MESHPPO_FUSED_OPS`: `auto` (default) takes it for CUDA tensors when triton is importable,
    `torch` never, `triton` always, on CPU tensors too (tests run the kernels there under
    `TRITON_INTERPRET=1`)."""
    if torch.compiler.is_compiling():
        return False
    choice = path_choice(_ENV)
    if choice == "torch":
        return False
    if any(isinstance(t, DTensor) or t.dtype not in _DTYPES for t in tensors):
        return False
    if same_dtype and len({t.dtype for t in tensors}) > 1:
        return False
    return choice == "triton" or triton_usable(tensors[0].device)


def _kernels():
    from models import block_triton

    return block_triton


# Forwards return the kernels' fresh tensors, not views of them (as `models/lm_head.py` does:
# FSDP2 hooks module outputs for backward, and a view would bypass that hook).


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, unit_offset):
        x = x.contiguous()
        out, rstd = _kernels().rms_norm_fwd(x, weight.contiguous(), eps, unit_offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.unit_offset = unit_offset
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _kernels().rms_norm_bwd(x, weight.contiguous(), rstd, dout.contiguous(),
                                         with_dw=ctx.needs_input_grad[1], unit_offset=ctx.unit_offset)
        return dx, dw, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return _kernels().swiglu_fwd(gate, up, act)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return *_kernels().swiglu_bwd(gate, up, dout.contiguous(), act=ctx.act), None


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, bias, act):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        ctx.act = act
        return F.linear(_kernels().swiglu_fwd(gate, up, act), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = (dy2 @ weight).view(gate.shape)
        dg, du, h = _kernels().swiglu_bwd(gate, up, dh, with_out=True, act=ctx.act)
        dw = dy2.t() @ h.view(-1, h.shape[-1]) if ctx.needs_input_grad[2] else None
        db = dy2.sum(0) if ctx.needs_input_grad[3] else None  # False for a None bias
        return dg, du, dw, db, None


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        # cos/sin [..., D] with q's leading dims: one row per token (a copy only where they broadcast)
        shape = (*q.shape[:-2], q.shape[-1])
        cos, sin = cos.expand(shape).contiguous(), sin.expand(shape).contiguous()
        ctx.save_for_backward(cos, sin)
        return _kernels().rope(q.contiguous(), k.contiguous(), cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return *_kernels().rope(dq.contiguous(), dk.contiguous(), cos, sin, backward=True), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """`models.transformer.RMSNorm`'s formula over the last dim of `x [..., N]` (with its `unit_offset`), fused."""
    return _RMSNorm.apply(x, weight, float(eps), unit_offset)


def activation(gate: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The gate's eager activation: `F.silu`, or for "gelu_tanh" the tanh-approximated GELU (Gemma 3's GeGLU,
    transformers' gelu_pytorch_tanh)."""
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """`activation(gate, act) * up` (same shape and dtype), fused."""
    return _SwiGLU.apply(gate, up, act)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """`F.linear(activation(gate, act) * up, weight, bias)`, fused SwiGLU (GeGLU), without keeping the product
    for backward (module docstring)."""
    return _SwiGLUDown.apply(gate, up, weight, bias, act)


def swiglu_values(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """`activation(gate, act) * up` outside autograd (a Function's own forward or backward, as the tiled
    MLP's): the fused kernel where `use_fused_ops` takes it, else the eager formula."""
    if use_fused_ops(gate, up, same_dtype=True):
        return _kernels().swiglu_fwd(gate.contiguous(), up.contiguous(), act)
    return activation(gate, act) * up


def swiglu_grads(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, act: str = "silu"):
    """(dgate, dup, activation(gate, act) * up) for the gradient `dh` of the product, outside autograd: the
    fused kernel where `use_fused_ops` takes it, else autograd's roundings of the eager formula."""
    if use_fused_ops(gate, up, dh, same_dtype=True):
        return _kernels().swiglu_bwd(gate.contiguous(), up.contiguous(), dh.contiguous(), with_out=True, act=act)
    s = activation(gate, act)
    dgate = (torch.ops.aten.silu_backward(dh * up, gate) if act == "silu"
             else torch.ops.aten.gelu_backward(dh * up, gate, approximate="tanh"))
    return dgate, dh * s, s * up


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`models.transformer.apply_rope` on q `[..., Hq, D]` and k `[..., Hkv, D]` in one launch;
    cos/sin `[..., D]` (one dtype with q and k) broadcast over heads, no gradient."""
    return _RoPE.apply(q, k, cos, sin)
