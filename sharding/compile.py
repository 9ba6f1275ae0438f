"""`torch.compile` of each transformer block (`actor_rollout_ref.actor.use_torch_compile`).

Each block's `forward` is compiled in place (after activation checkpointing wrapped it, as
torchtitan orders it): parameter names do not change, FSDP2's hooks on the block's
`__call__` stay outside the compiled graph, and every block re-uses the same compiled code,
so compile time does not grow with depth. Compiling the whole block rather than its attention
and MLP lets Inductor fuse the RMSNorms, residual adds, RoPE and SwiGLU with their
neighbours: on an H200 this took the 1.5b actor update from 30 % to 35 % MFU, where
compiling attention and MLP alone gained nothing (BENCHMARKS.md).

Python floats the block reads (norm epsilons, the LoRA scaling) are compiled in as constants
(`specialize_float`): left unspecialised, Dynamo passes each as a 0-d float64 CPU tensor, and
with LoRA's `* scaling` Inductor then built a CPU kernel inside the GPU block (a host C++
compile on the first step, which failed on the H200 machine).
"""

from __future__ import annotations

import torch

_COMPILED = "_meshppo_compiled"


def apply_compile(model, backend: str = "inductor") -> None:
    """Compile every block of `model.layers` (dynamic shapes: micro-batches vary in length)."""
    for block in model.layers:
        if getattr(block, _COMPILED, False):
            raise RuntimeError("apply_compile was already applied to this model")
        compiled = torch.compile(block.forward, backend=backend, dynamic=True)
        block.forward = torch._dynamo.config.patch(specialize_float=True)(compiled)
        setattr(block, _COMPILED, True)
