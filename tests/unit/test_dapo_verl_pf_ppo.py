"""PF-PPO's redraw draws the rows verl 0.9.1's `compute_pf_ppo_reweight_data` draws from the same
generator state: verl weighs the float32 sequence scores (pow |s|^p, max_min 1 / 0, max_random 0.4 / 0.1,
each + 1e-8) and draws len(scores) rows with replacement by torch.multinomial; meshppo does so in float64."""

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
