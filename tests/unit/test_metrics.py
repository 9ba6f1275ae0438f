"""The step's data and timing metrics (`trainer.metrics`) against verl 0.9.1's definitions at their
edges, on one process: values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

WIDTH = 4


def _batch(lengths: list[int], keep: list[list[int]] | None = None):
    """Rows with these response lengths (prompts of 2 tokens), every token's advantage, return and
    value distinct; `keep` (per row, per token 1 / 0) is rollout rejection's mask, if any."""
    from trainer.rollout_batch import RolloutBatch

    n = len(lengths)
    ro = RolloutBatch([[7, 8]] * n, [[5] * m for m in lengths], list(range(n)), ["d"] * n, ["g"] * n, [{}] * n,
                      ["stop"] * n, [[0.0] * m for m in lengths], WIDTH, torch.device("cpu"))
    if keep is not None:
        ro.rollout_rs_mask = torch.tensor(keep, dtype=torch.float32)
    mask = ro.loss_mask.double()
    grid = torch.arange(n * WIDTH, dtype=torch.float64).reshape(n, WIDTH)
    ro.token_level_rewards = torch.zeros(n, WIDTH)
    ro.advantages, ro.returns, ro.values = grid * mask, (2.0 + grid * grid) * mask, (1.0 - grid) * mask
    return ro


def _metrics(ro):
    from trainer.metrics import data_metrics

    return data_metrics(ro, torch.ones(len(ro)), {}, max_prompt_length=2, max_response_length=WIDTH)


def test_explained_variance_over_fewer_than_two_tokens_is_nan():
    """verl's `torch.var` (unbiased) of one token, or its branch for none, gives NaN; a denominator
    clamped to 1 gave 1 - 0 / (0 + 1e-5) = 1.0, a perfect critic."""
    # every token rejected: none to count
    m = _metrics(_batch([2, 1], keep=[[0, 0, 0, 0], [0, 0, 0, 0]]))
    assert math.isnan(m["critic/vf_explained_var"]) and math.isnan(m["critic/values/mean"])
    # one token left (row 1's first: token index 4): returns 2 + 16 = 18, values 1 - 4 = -3
    m = _metrics(_batch([2, 1], keep=[[0, 0, 0, 0], [1, 0, 0, 0]]))
    assert (m["critic/returns/mean"], m["critic/values/mean"]) == (18.0, -3.0)
    assert math.isnan(m["critic/vf_explained_var"])
    # two tokens (0 and 4): returns 2, 18 (unbiased var 128), returns - values 1, 21 (var 200)
    m = _metrics(_batch([2, 1], keep=[[1, 0, 0, 0], [1, 0, 0, 0]]))
    assert m["critic/vf_explained_var"] == pytest.approx(1.0 - 200.0 / (128.0 + 1e-5), rel=1e-12)
