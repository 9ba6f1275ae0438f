"""Tiled MLP (verl's `model.tiled_mlp`): the SwiGLU MLP over the tokens in `num_shards` tiles.

`models.transformer.MLP` makes three `[tokens, intermediate]` tensors (gate, up and
`silu(gate) * up`), and its untiled path keeps two (the fused `block_ops.swiglu_down`) to four
(eager, silu(gate) too) such tensors for backward: for 16k bf16 tokens of qwen2.5-1.5b's MLP
(hidden 1536, intermediate 8960) one is 16384 × 8960 × 2 bytes = 294 MB, where the MLP's input
is 50 MB. `_TiledMLP` saves only
the MLP's input `x` (and the weights, which are parameters anyway). Its forward computes the
output one tile of tokens at a time, so those tensors exist for one tile; its backward
recomputes a tile's gate and up from `x`, takes the tile's gradients and adds the tile's share
of the weight gradients, then drops the tile. The price is the recomputation of gate and up in
backward: two of the MLP's three projections again, +2/3 of its forward FLOPs, about +2/9 of
its forward and backward (the down projection's input is recomputed from them elementwise).
Under activation checkpointing the block's recomputation already repeats the whole MLP forward,
so the tiles add gate and up a third time.

Weight gradients are accumulated over the tiles in float32 when the weights are 16-bit (each
tile's product is a 16-bit GEMM with float32 accumulation inside, as the untiled one) and cast
once at the end; the input gradient of a tile is final when the tile is done.

The Function takes the module's weights as plain tensors inside `MLP.forward`, so FSDP2's
pre-forward all-gather (the block's hooks) has run and its post-backward reduce-scatter gets
the gradients. A LoRA-wrapped projection (`models.lora.LoRALinear`) has parameters the Function
does not know: such an MLP runs each tile of the plain module path under non-reentrant
`torch.utils.checkpoint` instead (same memory bound, autograd takes every gradient). The tiled
call runs eagerly under `torch.compile` (`torch.compiler.disable`): the compiled block breaks
its graph around the MLP, and the tile loop, whose bounds depend on the token count, is never
traced.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models import block_ops
from models.args import tiled_moe_refusal


def apply_tiled_mlp(model: nn.Module, num_shards: int | None) -> nn.Module:
    """Compute the MLP of every block of `model.layers` in `num_shards` token tiles (None: the
    untiled path). Only an attribute of each MLP changes: parameters, names and FSDP units stay.
    Set it before `sharding.compile.apply_compile`, whose graphs guard on it. Returns `model`.
    A mixture-of-experts model (`ModelArgs.moe_layers`) is refused: its sparse layers run each expert on its own
    tokens, which the tiles of one SwiGLU MLP do not describe."""
    if num_shards is not None and getattr(getattr(model, "args", None), "moe_layers", None):
        raise ValueError(tiled_moe_refusal(model.args.model_type))
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)
                                   or num_shards < 1):
        raise ValueError(f"tiled MLP num_shards must be a positive integer, got {num_shards!r}")
    for block in model.layers:
        block.mlp.num_shards = num_shards
    return model


def tile_bounds(n: int, num_shards: int) -> list[tuple[int, int]]:
    """`(start, end)` of the non-empty tiles of `n` tokens in `num_shards` near-equal tiles
    (sizes differ by at most one; more tiles than tokens leaves some empty, which are skipped)."""
    bounds = [n * i // num_shards for i in range(num_shards + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@torch.compiler.disable
def tiled_mlp(mlp: nn.Module, x: torch.Tensor, num_shards: int) -> torch.Tensor:
    """`mlp(x)` (a `models.transformer.MLP`, x `[..., H]`) in `num_shards` tiles of the
    flattened tokens: `_TiledMLP` for plain projections, checkpointed tiles of the module path
    where a projection is LoRA-wrapped."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    if all(type(p) is nn.Linear for p in (gate, up, down)):
        return _TiledMLP.apply(x, gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias, num_shards,
                               mlp.act)
    x2 = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled()
    tiles = [checkpoint(mlp.swiglu_mlp, x2[a:b], use_reentrant=False) if grad else mlp.swiglu_mlp(x2[a:b])
             for a, b in tile_bounds(x2.shape[0], num_shards)]
    out = torch.cat(tiles) if tiles else x2.new_empty(0, down.out_features)
    return out.view(*x.shape[:-1], out.shape[-1])


def _accumulator(w: torch.Tensor, needed: bool) -> torch.Tensor | None:
    """A zero gradient buffer for `w`: float32 for 16-bit weights (cast once at the end)."""
    if not needed:
        return None
    dtype = torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype
    return torch.zeros(w.shape, dtype=dtype, device=w.device)


class _TiledMLP(torch.autograd.Function):
    """`down(act(gate(x)) * up(x))` (`act`: `MLP.act`) over token tiles, saving x and the weights only."""

    @staticmethod
    def forward(ctx, x, wg, bg, wu, bu, wd, bd, num_shards, act):
        x2 = x.reshape(-1, x.shape[-1])
        out = x.new_empty(*x.shape[:-1], wd.shape[0])  # fresh, not a view (block_ops: FSDP2's output hooks)
        out2 = out.view(-1, wd.shape[0])
        for a, b in tile_bounds(x2.shape[0], num_shards):
            xt = x2[a:b]
            out2[a:b] = F.linear(block_ops.swiglu_values(F.linear(xt, wg, bg), F.linear(xt, wu, bu), act), wd, bd)
        ctx.save_for_backward(x, wg, bg, wu, bu, wd)
        ctx.num_shards, ctx.act = num_shards, act
        return out

    @staticmethod
    def backward(ctx, dy):
        x, wg, bg, wu, bu, wd = ctx.saved_tensors
        need_x, need_wg, need_bg, need_wu, need_bu, need_wd, need_bd = ctx.needs_input_grad[:7]
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = x.new_empty(x.shape) if need_x else None
        dx2 = dx.view(-1, x.shape[-1]) if need_x else None
        dwg, dwu, dwd = _accumulator(wg, need_wg), _accumulator(wu, need_wu), _accumulator(wd, need_wd)
        dbg = _accumulator(bg, need_bg) if bg is not None else None
        dbu = _accumulator(bu, need_bu) if bu is not None else None
        dbd = dy2.sum(0) if need_bd else None  # the output's bias needs no tiles
        for a, b in tile_bounds(x2.shape[0], ctx.num_shards):
            xt, dyt = x2[a:b], dy2[a:b]
            gate, up = F.linear(xt, wg, bg), F.linear(xt, wu, bu)
            dg, du, h = block_ops.swiglu_grads(gate, up, dyt @ wd, ctx.act)
            del gate, up
            if dwd is not None:
                dwd += dyt.t() @ h
            del h
            if dx2 is not None:
                dx2[a:b] = torch.addmm(dg @ wg, du, wu)
            for acc, g in ((dwg, dg), (dwu, du)):
                if acc is not None:
                    acc += g.t() @ xt
            for acc, g in ((dbg, dg), (dbu, du)):
                if acc is not None:
                    acc += g.sum(0, dtype=acc.dtype)
        grads = [g if g is None else g.to(w.dtype) for g, w in ((dwg, wg), (dbg, bg), (dwu, wu), (dbu, bu),
                                                               (dwd, wd))]
        return dx, *grads, dbd, None, None
