"""Which dimension of each parameter a tensor-parallel rank shards.

The single source of truth for the TP layout, shared by the engine (`rollout/`, which slices
weights on load) and the resharder (`sharding/`, which makes FSDP shard the same dimension so
that a rank's FSDP chunk lies inside the TP shard it needs, docs/ARCHITECTURE.md).

* column-parallel (dim 0): q/k/v projections (weights and biases), gate/up projections,
  embedding rows and the LM head (vocab-parallel)
* row-parallel (dim 1): o_proj and down_proj weights; their outputs are all-reduced
* replicated (None): norms, the value head, and biases of row-parallel layers (added once,
  after the all-reduce)
"""

from __future__ import annotations

COLWISE = 0
ROWWISE = 1

_COL_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "mlp.gate_proj.weight", "mlp.gate_proj.bias",
    "mlp.up_proj.weight", "mlp.up_proj.bias",
)
_ROW_SUFFIXES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def tp_shard_dim(name: str) -> int | None:
    """TP shard dimension of the parameter called `name` (meshppo naming), or None if replicated."""
    if name in _VOCAB:
        return COLWISE
    if name.endswith(_COL_SUFFIXES):
        return COLWISE
    if name.endswith(_ROW_SUFFIXES):
        return ROWWISE
    return None
