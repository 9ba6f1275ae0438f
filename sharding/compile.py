"""`torch.compile` inside each transformer block (`actor_rollout_ref.actor.use_torch_compile`).

The attention and MLP sub-modules are compiled in place (`Module.compile`): parameter names
do not change, FSDP2's hooks (on the blocks) stay outside the compiled graphs, and every
block re-uses the same compiled code, so compile time does not grow with depth.
"""

from __future__ import annotations


def apply_compile(model) -> None:
    for block in model.layers:
        block.self_attn.compile(dynamic=True)
        block.mlp.compile(dynamic=True)
