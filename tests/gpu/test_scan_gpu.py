"""models/scan.py on the GPU in torch's deterministic mode (`fsdp_config.full_determinism`): the
prefix sums that `torch.cumsum` refuses there come out of cuBLAS GEMMs, match float64 sums,
repeat to the bit, and serve the engine's top-p threshold and sampler and the advantage
estimators' returns."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_prefix_sums_in_deterministic_mode(deterministic):
    from models.scan import cumsum
    from ppo.core_algos import compute_remax_outcome_advantage
    from rollout.sampler import truncation_threshold

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, dim in (((8, 151_936), -1), ((4, 33, 70), 1), ((5_000,), 0)):
        x = torch.randn(shape, device="cuda", generator=g)
        got = cumsum(x, dim)
        want = torch.cumsum(x.double().cpu(), dim).cuda()
        assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=1e-4), shape
        assert torch.equal(got, cumsum(x, dim))
    # the engine's top-p threshold and the remax returns run under the mode, twice the same
    s = torch.randn(16, 151_936, device="cuda", generator=g) * 3
    assert torch.equal(truncation_threshold(s, 50, 0.9), truncation_threshold(s, 50, 0.9))
    rewards = torch.randn(6, 40, device="cuda", generator=g)
    mask = torch.ones(6, 40, device="cuda")
    adv, ret = compute_remax_outcome_advantage(rewards, mask, reward_baselines=torch.zeros(6, device="cuda"))
    want = torch.flip(torch.cumsum(torch.flip(rewards.double().cpu(), [-1]), -1), [-1]).cuda()
    assert torch.allclose(ret.double(), want, atol=1e-5)
