"""PF-PPO's redraw draws the rows verl 0.9.1's `compute_pf_ppo_reweight_data` draws from the same
generator state: verl weighs the float32 sequence scores (pow |s|^p, max_min 1 / 0, max_random 0.4 / 0.1,
each + 1e-8) and draws len(scores) rows with replacement by torch.multinomial; meshppo does so in float64,
the pow weights relative to the largest (log space)."""

import pytest
import torch

from ppo.core_algos import compute_pf_ppo_indices


def _verl_draw(scores: torch.Tensor, method: str, power: float, seed: int) -> torch.Tensor:
    s = scores.float()
    if method == "pow":
        w = s.abs() ** power
    elif method == "max_min":
        w = ((s == s.max()) | (s == s.min())).float()
    else:
        w = torch.full_like(s, 0.1).masked_fill(s == s.max(), 0.4)
    return torch.multinomial((w + 1e-8).clamp(min=1e-8), len(s), replacement=True,
                             generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_the_redraw_is_verls_for_the_same_generator(method):
    for seed in range(20):
        scores = torch.randint(-4, 5, (48,), generator=torch.Generator().manual_seed(100 + seed)) / 2
        got = compute_pf_ppo_indices(scores, method, 2.0, torch.Generator().manual_seed(seed))
        assert torch.equal(got, _verl_draw(scores, method, 2.0, seed)), (method, seed)


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0, 3.0, 7.5, 20.0])
def test_the_pow_redraw_is_verls_for_continuous_scores_and_other_powers(power):
    """meshppo forms the pow weights relative to the largest in log space (no overflow); where verl's
    float32 |s|^p is finite the draw is verl's row for row: 40 seeds of N(0, 9) scores, some exactly 0."""
    for seed in range(40):
        g = torch.Generator().manual_seed(1000 + seed)
        scores = torch.randn(int(torch.randint(2, 64, (1,), generator=g)), generator=g) * 3
        scores[::7] = 0.0
        got = compute_pf_ppo_indices(scores, "pow", power, torch.Generator().manual_seed(seed))
        assert torch.equal(got, _verl_draw(scores, "pow", power, seed)), (power, seed)
