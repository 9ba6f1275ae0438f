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


def _perf(ro, timings: dict, world_size: int = 1) -> dict:
    """`PPOTrainer._perf_metrics` of `ro` on a trainer holding only what it reads (CPU, no critic, no
    update counted: no MFU)."""
    from types import SimpleNamespace

    import numpy as np

    import trainer.ppo_trainer as pt

    trainer = object.__new__(pt.PPOTrainer)
    trainer.device, trainer.ctx = torch.device("cpu"), SimpleNamespace(rank=0, world_size=world_size)
    trainer.actor, trainer.critic = SimpleNamespace(sp_size=1, share_prefix=False), None
    trainer._update_work = trainer._critic_work = trainer._infer_work = np.zeros(3)
    return trainer._perf_metrics(ro, dict(timings))


def test_timing_per_token_and_throughput():
    """verl's `compute_timing_metrics` / `compute_throughout_metrics`: generation's seconds per generated
    token, the other phases' per prompt + response token, 0.0 for a phase with no token to count (every
    response empty: verl's guard), where a count clamped to 1 gave 1000 x the phase's seconds."""
    timings = {"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/ref": 0.25, "timing_s/update_actor": 1.0}
    out = _perf(_batch([3, 1]), timings, world_size=2)  # 4 prompt + 4 response tokens
    assert out["timing_per_token_ms/gen"] == pytest.approx(1000 * 0.5 / 4, rel=1e-12)
    assert out["timing_per_token_ms/ref"] == pytest.approx(1000 * 0.25 / 8, rel=1e-12)
    assert out["timing_per_token_ms/update_actor"] == pytest.approx(1000 / 8, rel=1e-12)
    assert (out["perf/total_num_tokens"], out["perf/time_per_step"]) == (8.0, 2.0)
    assert out["perf/throughput"] == pytest.approx(8 / (2.0 * 2), rel=1e-12)
    assert "timing_per_token_ms/values" not in out  # not timed: none, as in verl
    out = _perf(_batch([0, 0]), timings)  # every response aborted: no generated token
    assert out["timing_per_token_ms/gen"] == 0.0
    assert out["timing_per_token_ms/ref"] == pytest.approx(1000 * 0.25 / 4, rel=1e-12)
