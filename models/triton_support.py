"""Whether meshppo's Triton kernels can run: one answer for the engine and the LM-head loss."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, when triton is importable (CPU runs them only under
    `TRITON_INTERPRET=1`, which callers ask for explicitly)."""
    return device.type == "cuda" and triton_importable()
