"""Host arrays onto the device without waiting for it.

A non-blocking copy from pageable host memory may first wait for the stream (the driver stages
it through pinned memory it owns), so a host that copies a step's inputs that way waits for the
previous step's kernels and leaves the GPU idle while it launches the next ones. From pinned
memory the copy is queued behind the work already queued, and the host goes on.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(arrays: list, device) -> list[torch.Tensor]:
    """Host arrays of one dtype (NumPy arrays or CPU tensors) as tensors on `device`. On CUDA they
    are written once, by NumPy, into one pinned buffer and moved by one non-blocking copy (the
    caching host allocator keeps the pinned block until the copy is done)."""
    device = torch.device(device)
    arrays = [a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for a in arrays]
    sizes = [a.size for a in arrays]
    if device.type == "cuda":
        dtype = torch.from_numpy(np.empty(0, dtype=arrays[0].dtype)).dtype
        flat = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        np.concatenate([a.reshape(-1) for a in arrays], out=flat.numpy())
        flat = flat.to(device, non_blocking=True)
    else:
        flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays])).to(device)
    return [piece.view(a.shape) for piece, a in zip(flat.split(sizes), arrays)]
