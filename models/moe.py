"""Mixture-of-experts MLP (Granite-MoE's, Mixtral's, OLMoE's, Qwen2-MoE's and Qwen3-MoE's sparse block), as
transformers 5 computes it: the one implementation that the training model (`models.transformer.MoE`) and the engine
share. (A Qwen2-MoE's or Granite-MoE-Shared's shared expert is no routed expert: each adds it beside these, as a dense
MLP.)

`route` picks each token's experts: router logits `x Wᵀ` (`weight [E, H]`), their softmax in float32, the top
`k`, optionally renormalised to sum to 1 (`norm_topk_prob`), cast to the logits' dtype (transformers'
Qwen3MoeTopKRouter, OlmoeTopKRouter) or kept in float32 (`float32_weights`: MixtralTopKRouter, whose expert outputs
are then weighted in float32 and their sum rounded once); or (`softmax_topk`: GraniteMoeTopKRouter) the top `k` of
the logits in float32 and the softmax over those `k`, cast to the input's dtype. With `replay` (routing replay, R2 /
R3) the given experts replace the top-k and are weighted by the same softmax at their ids. A record of expert ids
(the engine's, R3; the old-log-prob pass's, R2) is kept in `routing_dtype`. `experts_forward` runs them:
`Σ_k w[t, k] · down_e(act(gate_e x) · up_e x)` with each expert's weights stacked as transformers 5 holds them in
memory, `gate_up [E, 2I, H]` (gate rows first: its `chunk(2)`) and `down [E, H, I]`. The (token, slot) pairs are sorted by expert (a stable sort of the flattened
expert ids, `sort_by_expert`: on CUDA a counting-sort kernel up to `SORT_KERNEL_MAX_PAIRS` pairs, `models/moe_triton.py`),
each expert's group goes through one GEMM per projection, the weighted rows are put back in
(token, slot) order and summed over the slots: a fixed order of additions (no atomics), as transformers'
grouped_mm path sums them. Both reorderings are permutations, so their backward passes are gathers by the inverse
permutation (`_Permuted`), not the generic index backward (an accumulating `index_put_`, which sorts its indices
on CUDA): a four-layer qwen3-30b-a3b update on an H100 took 206.4 ms against 209.0 with plain indexing.

Two paths compute the same products: on CUDA in bfloat16 (with hidden and expert sizes multiples of 8, the
kernel's 16-byte strides) `torch.nn.functional.grouped_mm` over all experts at once, with the groups' ends
counted on the device by the sort (no host sync, no data-dependent shape, so the engine can capture it in a CUDA
graph); elsewhere (CPU, float32 / float16 / float64 on CUDA) a loop over the experts that
have tokens, which reads the group sizes on the host. Both are differentiable (the trainer's backward).

Shapes: `T` tokens, `H` hidden, `E` experts, `I` expert intermediate size, `k` experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.block_ops import activation
from models.triton_support import path_choice, triton_usable


# torch.nn.functional.grouped_mm where torch has it; the same operator under its older private name where it does
# not (an older torch)
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm

# `sort_by_expert` takes the Triton kernel on CUDA up to this many (token, slot) pairs: each of its programs (one
# an expert, side by side) reads every pair twice, so its time grows with the pairs faster than torch's sort does.
# On an H100 at 128 experts (bench/moe_sort.py, BENCHMARKS "Twenty-eighth session"), µs a sort, kernel / torch:
# 2,048 pairs 3.4 / 45.8, 16,384 17.3 / 94.3, 32,768 35.5 / 86.9, 131,072 156.8 / 120.2
SORT_KERNEL_MAX_PAIRS = 32768


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool, float32_weights: bool = False,
          replay: torch.Tensor | None = None, softmax_topk: bool = False):
    """`(weights [T, k] in x's dtype, or float32 where `float32_weights`, experts [T, k] int64)` of tokens `x [T, H]`
    under router `weight [E, H]`: the top `top_k` of the softmax (taken in float32) of `F.linear(x, weight)`, in
    descending order, divided by their sum where `norm_topk_prob`. `softmax_topk` (Granite-MoE's router): the top
    `top_k` of the logits (cast to float32) and the softmax over those alone, the same weights rounded otherwise
    (`norm_topk_prob` then changes nothing: they sum to 1).

    `replay [T, k]` (any integer dtype; routing replay: the experts the rollout engine routed each token to, R3, or
    those the old-log-prob pass's routers chose, R2)
    replaces the top-k selection alone: the experts are `replay`, their weights the same softmax's probabilities
    at those ids, renormalised and rounded as above, so the router still gets its gradient through them. Replaying
    the natural top-k computes exactly what routing does."""
    logits = F.linear(x, weight)
    # the scores the top-k is taken of (and replay gathers): the float32 softmax, or Granite-MoE's float32 logits
    probs = logits.float() if softmax_topk else torch.softmax(logits, dim=-1, dtype=torch.float32)
    if replay is None:
        top, experts = torch.topk(probs, top_k, dim=-1)
    else:
        if replay.shape != (*probs.shape[:-1], top_k):
            raise ValueError(f"replayed experts of shape {tuple(replay.shape)} for {probs.shape[0]} tokens routed to "
                             f"{top_k} experts each")
        experts = replay.long()
        top = probs.gather(-1, experts)
    if softmax_topk:
        top = torch.softmax(top, dim=-1)
    elif norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if float32_weights else top.to(logits.dtype)), experts


def routing_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype of a record of expert ids (routing replay): uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def route_model(x: torch.Tensor, weight: torch.Tensor, args,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` as the model of `args` (a `ModelArgs`) routes: its `num_experts_per_tok`, `norm_topk_prob`,
    `router_weights_float32` and `router_softmax_topk`; `replay`: the experts to use instead of the top-k (`route`).
    The one call of the training model's block and the engine's layer, so the two route and round alike."""
    return route(x, weight, args.num_experts_per_tok, args.norm_topk_prob, args.router_weights_float32, replay,
                 args.router_softmax_topk)


def use_grouped_mm(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether `experts_forward` takes the grouped-GEMM path: CUDA bfloat16 (the dtype torch's grouped GEMM
    kernel takes there) with the hidden and expert sizes multiples of 8 (its rows' 16-byte alignment)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and gate_up.shape[1] % 16 == 0)


def _gated(h: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` of a gate_up projection's output `[.., 2I]` (gate columns first)."""
    gate, up = h.chunk(2, dim=-1)
    return activation(gate, act) * up


class _Permuted(torch.autograd.Function):
    """`x[index // copies]`, where `index` is a permutation of `range(len(x) * copies)` and `inverse` its inverse:
    each row of `x` taken `copies` times, the copies in the order `index` gives. The backward gathers the gradient
    back by `inverse` and sums each row's `copies` (adjacent after the gather) in one reduction: no atomics, no
    sort, a fixed order of additions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x[index // copies if copies > 1 else index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, = ctx.saved_tensors
        grad = grad[inverse]
        if ctx.copies > 1:
            grad = grad.view(-1, ctx.copies, *grad.shape[1:]).sum(dim=1)
        return grad, None, None, None


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(order [N] int64, inverse [N] int64, ends [num_experts] int32)` of the flattened expert ids `ids [N]`
    (int64, each in `[0, num_experts)`): the stable sort's permutation (`torch.argsort(ids, stable=True)`: the
    pairs grouped by expert, each group in pair order), its inverse and each group's end (the cumulative counts),
    all on the device without a host sync. `models/moe_triton.py`'s one kernel (a counting sort, the same
    permutation) where `MESHPPO_MOE_SORT` is `auto` (default) on CUDA up to `SORT_KERNEL_MAX_PAIRS` pairs, or
    `triton` (any device and size; CPU under `TRITON_INTERPRET=1`); else torch's sort, a scatter and a cumsum."""
    choice = path_choice("MESHPPO_MOE_SORT")
    if choice == "triton" or (choice == "auto" and triton_usable(ids.device) and ids.numel() <= SORT_KERNEL_MAX_PAIRS):
        from models.moe_triton import sort_by_expert as kernel
        return kernel(ids, num_experts)
    order = torch.argsort(ids, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int32))
    return order, inverse, torch.cumsum(counts, 0, dtype=torch.int32)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: str = "silu", grouped: bool | None = None) -> torch.Tensor:
    """`[T, H]`: `Σ_k weights[t, k] · down[e](act(gate[e] x_t) · up[e] x_t)` for `e = experts[t, k]` (module
    docstring), in `x`'s dtype: each product by its weight in the weights' dtype (float32 ones: Mixtral's), the
    sum over the slots rounded once to `x`'s. `grouped`: force the grouped-GEMM path (True) or the loop (False); None:
    `use_grouped_mm`."""
    num_tokens, top_k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)
    order, inverse, ends = sort_by_expert(flat, num_experts)  # (token, slot) pairs grouped by expert, tokens in order
    rows = _Permuted.apply(x, order, inverse, top_k)
    if grouped if grouped is not None else use_grouped_mm(x, gate_up):
        h = _gated(_grouped_mm(rows, gate_up.transpose(1, 2), offs=ends), act)
        out = _grouped_mm(h, down.transpose(1, 2), offs=ends)
    else:
        sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        pieces = [F.linear(_gated(F.linear(group, gate_up[e]), act), down[e])
                  for e, group in enumerate(rows.split(sizes)) if sizes[e]]
        out = torch.cat(pieces) if pieces else rows.new_zeros(0, down.shape[1])
    out = out * weights.reshape(-1)[order, None]
    # back to (token, slot) order
    return _Permuted.apply(out, inverse, order, 1).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
