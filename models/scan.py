"""Prefix sums that torch's deterministic mode allows on the GPU.

Under `torch.use_deterministic_algorithms(True)` (the trainer's `fsdp_config.full_determinism`)
`torch.cumsum` of a floating-point CUDA tensor raises: torch has no deterministic kernel for it.
`cumsum` then computes the same sums with GEMMs, which cuBLAS runs deterministically: each block
of `BLOCK` values is summed against a triangular matrix of ones, and the blocks' totals are scanned
the same way (recursively) and added back. The sums are those of `torch.cumsum` up to the order of
float additions. It runs inside CUDA-graph capture (no host synchronisation). Everywhere else (the
CPU, integers, the mode off) it is `torch.cumsum` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256


def cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`torch.cumsum(x, dim)`, deterministic on the GPU in torch's deterministic mode."""
    if not (x.is_cuda and x.is_floating_point() and torch.are_deterministic_algorithms_enabled()):
        return torch.cumsum(x, dim)
    return blocked_cumsum(x.movedim(dim, -1)).movedim(-1, dim)


def blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dimension of a floating-point `x` by triangular GEMMs
    (module docstring), on any device, in float64 (TF32 or a 16-bit GEMM would round the sums),
    returned in `x`'s dtype."""
    n = x.shape[-1]
    if n == 0:
        return x.clone()
    return _scan(x.double()).to(x.dtype)


def _scan(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    nb = -(-n // BLOCK)
    blocks = F.pad(x, (0, nb * BLOCK - n)).unflatten(-1, (nb, BLOCK))
    upper = torch.ones(BLOCK, BLOCK, dtype=x.dtype, device=x.device).triu()
    sums = blocks @ upper  # [..., nb, BLOCK]: sums within each block
    if nb > 1:
        totals = sums[..., -1]
        sums = sums + (_scan(totals) - totals)[..., None]  # plus the blocks before
    return sums.flatten(-2)[..., :n]
