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


def test_a_power_that_overflows_the_weights_still_draws_by_them():
    """A weight_pow whose |s|^p overflows float64 (verl's float32 |s|^p overflows far sooner; both
    stopped in torch.multinomial on an inf weight): the scores e^(1 + k/1000) under p = 1000 weigh
    e^1000 * (e^0, e^1, e^2), finite as a distribution, so the rows are drawn 1 : e : e^2 (chi-square
    bound); scores 2.5 and 2.4 under p = 1000 weigh 1 : 0.96^1000 (2e-18), so only the first is drawn;
    scores below 1 under p = 2000 weigh under 1e-8 each, so the 1e-8 floor makes the draw uniform."""
    k = torch.arange(3, dtype=torch.float64)
    scores = torch.exp(1 + k / 1000).float().repeat(10000)
    idx = compute_pf_ppo_indices(scores, "pow", 1000.0, torch.Generator().manual_seed(0))
    counts = torch.bincount(idx % 3, minlength=3).double()
    expected = torch.exp(k) / torch.exp(k).sum() * len(idx)
    assert float(((counts - expected) ** 2 / expected).sum()) < 27.63, (counts, expected)  # chi2(2) at 1 - 1e-6

    idx = compute_pf_ppo_indices(torch.tensor([2.5, 2.4, 0.0, -1.0]), "pow", 1000.0, torch.Generator().manual_seed(0))
    assert idx.tolist() == [0, 0, 0, 0]

    tiny = torch.tensor([0.5, 0.1, 0.0, -0.9]).repeat(5000)
    idx = compute_pf_ppo_indices(tiny, "pow", 2000.0, torch.Generator().manual_seed(0))
    counts = torch.bincount(idx % 4, minlength=4).double()
    assert float(((counts - 5000) ** 2 / 5000).sum()) < CHI2_3_1E6, counts
