"""Whether meshppo's Triton kernels can run: one answer for the engine and the LM-head loss."""

from __future__ import annotations

import importlib.util
import os

import torch


# Looked up once, at import (a path search: triton itself is not imported): `torch.compile` traces `triton_usable` in
# the compiled blocks (the capped attention's dispatch, `models.attention.capped_triton`), and a lookup there is a
# function dynamo will not trace, a graph break
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, when triton is importable (CPU runs them only under
    `TRITON_INTERPRET=1`, which callers ask for explicitly)."""
    return device.type == "cuda" and TRITON_IMPORTABLE


def path_choice(variable: str) -> str:
    """The environment's choice between a Triton path and its PyTorch reference: `variable`'s
    value, `auto` (default: Triton where `triton_usable`), `torch` or `triton` (forced, on CPU
    tensors too, which tests run under `TRITON_INTERPRET=1`); anything else is an error naming it."""
    choice = os.environ.get(variable, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{variable} must be auto, torch or triton, got {choice!r}")
    return choice
