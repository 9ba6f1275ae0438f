"""Activation checkpointing and activation offload, applied per transformer block.

Both wrap each block's `forward` in place instead of wrapping the block in a new module: a
wrapper module would add a prefix to every parameter name (`layers.0._checkpoint_wrapped_module.
...`), and parameter names are what `tp_shard_dim`, the resharder and checkpoints key on.

Call `apply_ac` before `apply_fsdp` (torchtitan's order): `fully_shard` then hooks the block's
`__call__`, outside the checkpointed `forward`, so FSDP all-gathers the block once before the
forward and again before the recomputation in backward.

Offload (`ActivationOffloader`) moves what a block saves for backward to host memory on copy
streams of its own, so that the compute stream never waits for the PCIe link: in forward a
tensor leaves as soon as the kernel that made it has run, and in backward the tensors of block
`i - 1` come back while block `i`'s backward runs. `torch.autograd.graph.save_on_cpu`, which
this replaced, copies synchronously on the compute stream and moves parameters too: on one H200
it made the qwen2.5-1.5b update 5.1x slower (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

_WRAPPED = "_meshppo_ac"
_OFFLOADER = "_meshppo_offloader"

#: Saved tensors below this size stay on the device: moving them frees little and each copy
#: costs a launch and an event on both copy streams (norm statistics, sequence offsets).
MIN_OFFLOAD_BYTES = 1 << 20


def apply_ac(model: nn.Module, enable_gradient_checkpointing: bool = False,
             enable_activation_offload: bool = False) -> nn.Module:
    """Checkpoint and/or offload the activations of every block in `model.layers`.

    * `enable_gradient_checkpointing`: keep only each block's inputs and recompute the block in
      backward (non-reentrant `torch.utils.checkpoint`).
    * `enable_activation_offload`: tensors saved for backward inside a block wait in host memory
      between forward and backward (`ActivationOffloader`; pinned on CUDA). Combined with
      checkpointing, what moves is exactly the checkpointed block inputs: the non-reentrant
      checkpoint saves its inputs through the saved-tensor hooks that the offloader installs,
      and its recomputation in backward saves through its own.

    Returns `model` (modified in place). Applying twice is an error rather than a silent
    double wrap.
    """
    if not (enable_gradient_checkpointing or enable_activation_offload):
        return model
    offloader = ActivationOffloader(len(model.layers)) if enable_activation_offload else None
    for i, block in enumerate(model.layers):
        if getattr(block, _WRAPPED, False):
            raise RuntimeError("apply_ac was already applied to this model")
        block.forward = functools.partial(_block_forward, block.forward, enable_gradient_checkpointing, offloader, i)
        setattr(block, _WRAPPED, True)
    setattr(model, _OFFLOADER, offloader)
    return model


def activation_offloader(model: nn.Module) -> "ActivationOffloader | None":
    """The offloader `apply_ac` installed on `model`'s blocks, or None."""
    return getattr(model, _OFFLOADER, None)


def _block_forward(forward, checkpointing: bool, offloader: "ActivationOffloader | None", index: int, *args, **kwargs):
    if offloader is not None and torch.is_grad_enabled():
        return _offloaded_forward(forward, checkpointing, offloader, index, *args, **kwargs)
    return _maybe_checkpoint(forward, checkpointing, *args, **kwargs)


@torch.compiler.disable(recursive=False)
def _offloaded_forward(forward, checkpointing: bool, offloader: "ActivationOffloader", index: int, *args, **kwargs):
    # Under `torch.compile` (`apply_compile` wraps `_block_forward`) this frame runs eagerly and
    # the block it calls is compiled. Were the offloader traced, Dynamo would guard on its
    # per-block state and compile again for each block index, up to its recompile limit.
    # Every block gets the same rotary tables, masks and offsets: they stay on the device.
    shared = [t for t in tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor)]
    with offloader.block(index, shared):
        return _maybe_checkpoint(forward, checkpointing, *args, **kwargs)


def _maybe_checkpoint(forward, checkpointing: bool, *args, **kwargs):
    if checkpointing and torch.is_grad_enabled():
        # preserve_rng_state=False: the blocks have no dropout, so there is no RNG state to
        # replay, and skipping it saves a state capture and restore per block.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return forward(*args, **kwargs)


@dataclass(eq=False)
class _Kept:
    """A saved tensor left on the device; its unpack still starts the previous block's copies."""

    t: torch.Tensor
    key: tuple  # (pass, block)


@dataclass(eq=False)
class _Moved:
    """One saved tensor in host memory: `host`, and while it is on its way back, `back`."""

    host: torch.Tensor
    device: torch.device
    key: tuple  # (pass, block)
    left: torch.cuda.Event | None = None  # the copy to the host has run (CUDA)
    back: torch.Tensor | None = None
    arrived: torch.cuda.Event | None = None  # the copy back has run (CUDA)


@dataclass
class OffloadStats:
    """What the last forward pass moved: bytes and tensors offloaded, by block, and the saved
    tensors left on the device (parameters, small tensors, the blocks' shared inputs, and the
    last block's)."""

    bytes_by_block: dict[int, int] = field(default_factory=dict)
    tensors: int = 0
    kept: int = 0


class ActivationOffloader:
    """Saved-tensor hooks that keep each block's activations in host memory between its forward
    and its backward, off the compute stream.

    Forward (`pack`): a tensor that a block saves is copied into pinned host memory on a copy
    stream that waits for the compute stream up to that point, and its device memory is handed
    back to the allocator for reuse after that copy (`record_stream`); the compute stream never
    waits for it. The host, before block `i`'s forward, waits for block `i - 2`'s copies: that
    bounds the memory in flight to two blocks' tensors, and where the link is slower than the
    blocks' compute (everything offloaded, no checkpointing) it paces the forward to the link.
    Backward (`unpack`): the first tensor that block `i` asks for starts the copies back of
    block `i - 1`'s tensors on a second copy stream, into memory allocated in the compute
    stream's order; each tensor is handed out after an event wait for its own copy. Backward
    visits the blocks from the last to the first, so block `i - 1`'s tensors travel while block
    `i`'s backward runs, and at most two blocks' activations are on the device at a time.

    Left on the device: parameters and views of them (FSDP gathers them again for backward;
    moving them would only add traffic), tensors below `min_bytes`, the inputs that every block
    receives (rotary tables, masks: `shared`), and everything the last block saves (backward
    starts there).

    On a CPU device the copies are plain host copies, in the same order: the CPU test suite runs
    the bookkeeping that the GPU runs.

    `torch.compile` never traces these methods (`torch.compiler.disable`): they keep Python state
    per block and pass, and wait on events, which Dynamo would guard on or graph-break at.
    """

    def __init__(self, num_blocks: int, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.num_blocks = num_blocks
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._pass = 0
        self._block: int | None = None
        self._shared: set[int] = set()  # storages of the current block's shared inputs
        self._waiting: dict[tuple, list[_Moved]] = {}  # (pass, block) -> its tensors in host memory
        self._fetched: set[tuple] = set()
        self._last_left: dict[int, torch.cuda.Event] = {}  # block -> its last copy to the host (this pass)
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    # -- forward ---------------------------------------------------------------------------

    @torch.compiler.disable
    def block(self, index: int, shared: list[torch.Tensor] = ()):
        """The saved-tensor hooks for block `index`'s forward, whose inputs `shared` (alive for
        the whole call) every block receives. Block 0 starts a new pass."""
        if index == 0:
            self._pass += 1
            self._waiting = {k: v for k, v in self._waiting.items() if k[0] == self._pass - 1}
            self._fetched = {k for k in self._fetched if k[0] == self._pass - 1}
            self._last_left.clear()
            self.stats = OffloadStats()
        # At most two blocks' copies in flight: the host waits for block `index - 2`'s to finish
        # (as FSDP1's `limit_all_gathers` waits for all-gathers). Without this the host, running
        # ahead of the GPU, would allocate block after block before any copy had freed memory:
        # the allocator can only reuse a block once its copy's event has completed.
        if (left := self._last_left.pop(index - 2, None)) is not None:
            left.synchronize()
        self._block = index
        self._shared = {t.untyped_storage().data_ptr() for t in shared}
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _keeps(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if type(t) is not torch.Tensor:
            return True  # a tensor subclass (DTensor, ...): its layout is not ours to copy
        if t.layout != torch.strided or t.numel() * t.element_size() < self.min_bytes:
            return True
        # (A storage's address identifies it only while it is alive: memory that an earlier block's
        # moved tensor freed is handed to later blocks' tensors. The shared inputs are alive.)
        return self._block == self.num_blocks - 1 or t.untyped_storage().data_ptr() in self._shared

    @torch.compiler.disable
    def pack(self, t: torch.Tensor):
        if self._keeps(t):
            self.stats.kept += 1
            return _Kept(t, (self._pass, self._block))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        moved = _Moved(host, t.device, (self._pass, self._block))
        if t.is_cuda:
            to_host, _ = self._copy_streams(t.device)
            to_host.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(to_host):
                host.copy_(t, non_blocking=True)
                moved.left = torch.cuda.Event()
                moved.left.record(to_host)
            self._last_left[self._block] = moved.left  # the copy stream runs in order: covers the block
            t.record_stream(to_host)  # the allocator reuses t's memory only after the copy
        else:
            host.copy_(t)
        self._waiting.setdefault(moved.key, []).append(moved)
        self.stats.tensors += 1
        self.stats.bytes_by_block[self._block] = self.stats.bytes_by_block.get(self._block, 0) + host.nbytes
        return moved

    # -- backward --------------------------------------------------------------------------

    @torch.compiler.disable
    def unpack(self, packed):
        p, b = packed.key
        if packed.key not in self._fetched:
            self._fetch(packed.key)
        if b > 0 and (p, b - 1) not in self._fetched:
            self._fetch((p, b - 1))  # travels while this block's backward runs
        if isinstance(packed, _Kept):
            return packed.t
        if packed.back is None:  # unpacked before (a second backward through a kept graph)
            self._fetch_one(packed)
        t, packed.back = packed.back, None
        if packed.arrived is not None:
            torch.cuda.current_stream(t.device).wait_event(packed.arrived)
        return t

    def _fetch(self, key: tuple) -> None:
        self._fetched.add(key)
        for moved in self._waiting.pop(key, ()):
            self._fetch_one(moved)

    def _fetch_one(self, moved: _Moved) -> None:
        # Allocated in the compute stream's order; the copy stream first catches up with the
        # compute stream, so the memory is no longer read by kernels queued before the allocation.
        back = torch.empty(moved.host.shape, dtype=moved.host.dtype, device=moved.device)
        if moved.device.type == "cuda":
            _, to_device = self._copy_streams(moved.device)
            to_device.wait_stream(torch.cuda.current_stream(moved.device))
            to_device.wait_event(moved.left)
            with torch.cuda.stream(to_device):
                back.copy_(moved.host, non_blocking=True)
                moved.arrived = torch.cuda.Event()
                moved.arrived.record(to_device)
        else:
            back.copy_(moved.host)
        moved.back = back

    def _copy_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]
