"""models/scan.py: the prefix sums that torch's deterministic mode allows on the GPU (triangular
GEMMs by blocks) against float64 `torch.cumsum`, over one block, its edges and the recursion over
blocks of blocks; off the GPU `cumsum` is `torch.cumsum` itself. The CUDA path under the mode is
tested in tests/gpu/test_trainer_gpu.py."""

import pytest
import torch

from models.scan import BLOCK, blocked_cumsum, cumsum


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, BLOCK * BLOCK + 3])
def test_blocked_sums_are_the_prefix_sums(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g, dtype=torch.float64)
    want = torch.cumsum(x, -1)
    got = blocked_cumsum(x)
    assert got.dtype == torch.float64 and got.shape == x.shape
    # float64 sums of at most n standard normals in another order: ~1e-16 * sqrt(n) * |partial sums|
    assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()
    # float32 in and out, summed in float64: the float64 sums of the float32 inputs, rounded once
    x32 = x.float()
    got32 = blocked_cumsum(x32)
    want32 = torch.cumsum(x32.double(), -1)
    assert got32.dtype == torch.float32 and torch.allclose(got32.double(), want32, rtol=1e-6, atol=1e-5)


def test_integers_and_empty():
    assert blocked_cumsum(torch.zeros(2, 0)).shape == (2, 0)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.equal(blocked_cumsum(x), torch.tensor([[1.0, 3.0, 6.0, 10.0]]))  # exact: small integers


def test_cumsum_off_the_gpu_is_torchs():
    x = torch.randn(4, 5, 300, dtype=torch.float32)
    for dim in (0, 1, -1):
        assert torch.equal(cumsum(x, dim), torch.cumsum(x, dim))
    ints = torch.arange(10)
    assert torch.equal(cumsum(ints, 0), torch.cumsum(ints, 0))
