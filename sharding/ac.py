"""Activation checkpointing and activation offload, applied per transformer block.

Both wrap each block's `forward` in place instead of wrapping the block in a new module: a
wrapper module would add a prefix to every parameter name (`layers.0._checkpoint_wrapped_module.
...`), and parameter names are what `tp_shard_dim`, the resharder and checkpoints key on.

Call `apply_ac` before `apply_fsdp` (torchtitan's order): `fully_shard` then hooks the block's
`__call__`, outside the checkpointed `forward`, so FSDP all-gathers the block once before the
forward and again before the recomputation in backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_WRAPPED = "_meshppo_ac"


def apply_ac(model: nn.Module, enable_gradient_checkpointing: bool = False,
             enable_activation_offload: bool = False) -> nn.Module:
    """Checkpoint and/or offload the activations of every block in `model.layers`.

    * `enable_gradient_checkpointing`: keep only each block's inputs and recompute the block in
      backward (non-reentrant `torch.utils.checkpoint`).
    * `enable_activation_offload`: tensors saved for backward inside a block go to CPU memory
      (pinned on CUDA) during forward and come back in backward
      (`torch.autograd.graph.save_on_cpu`). Combined with checkpointing, what goes to CPU is
      exactly the checkpointed block inputs: the non-reentrant checkpoint saves its inputs
      through the saved-tensor hooks that `save_on_cpu` installs.

    Returns `model` (modified in place). Applying twice is an error rather than a silent
    double wrap.
    """
    if not (enable_gradient_checkpointing or enable_activation_offload):
        return model
    for block in model.layers:
        if getattr(block, _WRAPPED, False):
            raise RuntimeError("apply_ac was already applied to this model")
        block.forward = functools.partial(
            _block_forward, block.forward, enable_gradient_checkpointing, enable_activation_offload)
        setattr(block, _WRAPPED, True)
    return model


def _block_forward(forward, checkpointing: bool, offload: bool, *args, **kwargs):
    if offload:
        x = args[0] if args else kwargs.get("x")
        pin = x is not None and x.is_cuda
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return _maybe_checkpoint(forward, checkpointing, *args, **kwargs)
    return _maybe_checkpoint(forward, checkpointing, *args, **kwargs)


def _maybe_checkpoint(forward, checkpointing: bool, *args, **kwargs):
    if checkpointing and torch.is_grad_enabled():
        # preserve_rng_state=False: the blocks have no dropout, so there is no RNG state to
        # replay, and skipping it saves a state capture and restore per block.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return forward(*args, **kwargs)
