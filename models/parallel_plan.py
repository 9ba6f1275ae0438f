"""Which dimension of each parameter a tensor-parallel rank shards.

The single source of truth for the TP layout, shared by the engine (`rollout/`, which slices
weights on load) and the resharder (`sharding/`, which makes FSDP shard the same dimension so
that a rank's FSDP chunk lies inside the TP shard it needs, docs/ARCHITECTURE.md).

* column-parallel (dim 0): q/k/v projections (weights and biases), gate/up projections (a Qwen2-MoE or
  Granite-MoE-Shared sparse layer's shared expert's too: `mlp.shared_expert.gate_proj`), embedding rows and the LM
  head (vocab-parallel)
* row-parallel (dim 1): o_proj and down_proj weights (the shared expert's too); their outputs are all-reduced (a
  sparse layer's shared expert's with its routed experts', in one all-reduce)
* a mixture-of-experts layer's experts (Qwen3-MoE), sharded along their intermediate size, every
  expert alike: `mlp.experts.gate_up_proj` `[E, 2I, H]` on dim 1 in two parts (each expert's gate
  rows, then its up rows: a rank holds the same rows `[j I/t, (j+1) I/t)` of both, `tp_shard_parts`),
  `mlp.experts.down_proj` `[E, H, I]` on dim 2 (row-parallel: the layer's output is all-reduced once)
* replicated (None): norms, the value head, a MoE layer's router (`mlp.gate.weight`) and shared expert's gate
  (`mlp.shared_expert_gate.weight`, `[1, H]`), and biases of row-parallel layers (added once, after the all-reduce)
"""

from __future__ import annotations

import torch

COLWISE = 0
ROWWISE = 1

_COL_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "mlp.gate_proj.weight", "mlp.gate_proj.bias",
    "mlp.up_proj.weight", "mlp.up_proj.bias",
    "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
)
_ROW_SUFFIXES = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_expert.down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
# an expert parameter's shard dimension (its intermediate size) and how many equal parts that dimension fuses
_EXPERTS = {"mlp.experts.gate_up_proj": (1, 2), "mlp.experts.down_proj": (2, 1)}


def _expert(name: str) -> tuple[int, int] | None:
    return _EXPERTS.get(".".join(name.split(".")[-3:]))


def tp_shard_dim(name: str) -> int | None:
    """TP shard dimension of the parameter called `name` (meshppo naming), or None if replicated."""
    if name in _VOCAB:
        return COLWISE
    if name.endswith(_COL_SUFFIXES):
        return COLWISE
    if name.endswith(_ROW_SUFFIXES):
        return ROWWISE
    expert = _expert(name)
    return None if expert is None else expert[0]


def tp_shard_parts(name: str) -> int:
    """How many equal consecutive parts the TP dimension of `name` fuses, each sharded alike (a rank holds the
    same rows of every part, `tp_narrow`): 2 for `mlp.experts.gate_up_proj` (each expert's gate rows, then its up
    rows, as transformers' `chunk(2)` splits them), 1 for every other parameter."""
    expert = _expert(name)
    return 1 if expert is None else expert[1]


def tp_narrow(full: torch.Tensor, dim: int, parts: int, start: int, length: int) -> torch.Tensor:
    """Rows `[start, start + length)` along `dim` of each of the `parts` equal parts of `full`, fused as `full`
    fuses them: the TP shard of a parameter (`tp_shard_dim`, `tp_shard_parts`, and the range that
    `rollout.model.tp_shard_range` gives), its dimension `dim` `parts * length` long. A view of `full` when
    `parts` is 1, else a copy."""
    if parts == 1:
        return full.narrow(dim, start, length)
    return full.unflatten(dim, (parts, -1)).narrow(dim + 1, start, length).flatten(dim, dim + 1)
