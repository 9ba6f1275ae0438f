"""PF-PPO's redraw (`algorithm.use_pf_ppo`): each row drawn in proportion to its score's weight."""

import pytest
import torch

from ppo.core_algos import compute_pf_ppo_indices

# chi-square quantile of 3 degrees of freedom at 1 - 1e-6: a fair draw exceeds it once in a million
CHI2_3_1E6 = 30.66

PATTERN = torch.tensor([0.0, 1.0, -2.0, 3.0])


@pytest.mark.parametrize("method,weights", [
    ("pow", [0.0, 1.0, 4.0, 9.0]),      # |s|^2
    ("max_random", [0.1, 0.1, 0.1, 0.4]),  # 0.4 for the highest score
])
def test_rows_are_drawn_in_proportion_to_their_weights(method, weights):
    """20,000 rows (the pattern of four scores repeated): the draws of each of the four kinds
    match the hand-computed weights (+1e-8) by a chi-square bound a biased draw fails."""
    reps = 5000
    idx = compute_pf_ppo_indices(PATTERN.repeat(reps), method, 2.0, torch.Generator().manual_seed(0))
    assert idx.shape == (4 * reps,) and int(idx.min()) >= 0 and int(idx.max()) < 4 * reps
    counts = torch.bincount(idx % 4, minlength=4).double()
    p = torch.tensor(weights, dtype=torch.float64) + 1e-8
    expected = p / p.sum() * len(idx)
    seen = expected > 1
    chi2 = float((((counts - expected) ** 2 / expected)[seen]).sum())
    assert chi2 < CHI2_3_1E6, (counts, expected)
    assert float(counts[~seen].sum()) <= 1  # weight 1e-8 over 20,000 draws: expected 1e-4 / 9 rows


def test_max_min_keeps_only_the_extremes_and_a_draw_is_the_same_for_the_same_seed():
    scores = torch.tensor([0.5, 1.0, 0.0, 0.7, 1.0, 0.0] * 100)
    idx = compute_pf_ppo_indices(scores, "max_min", 2.0, torch.Generator().manual_seed(3))
    assert set(scores[idx].tolist()) == {0.0, 1.0}
    again = compute_pf_ppo_indices(scores, "max_min", 2.0, torch.Generator().manual_seed(3))
    assert torch.equal(idx, again)
    # all weights zero (pow of zero scores): every row 1e-8, a uniform draw rather than an error
    flat = compute_pf_ppo_indices(torch.zeros(20000), "pow", 2.0, torch.Generator().manual_seed(0))
    counts = torch.bincount(flat % 4, minlength=4).double()
    assert float(((counts - 5000) ** 2 / 5000).sum()) < CHI2_3_1E6, counts
    with pytest.raises(ValueError, match="unknown PF-PPO reweight_method 'best'"):
        compute_pf_ppo_indices(scores, "best", 2.0)
