"""The learning-rate schedule against verl's, update for update.

`verl_constant` and `verl_cosine` transcribe the lr_lambda of verl's
get_constant_schedule_with_warmup and get_cosine_schedule_with_warmup
(verl/utils/torch_functional.py; transformers' convention): update s (from 0) runs at
lr x lambda(s), so the first update of a warm-up runs at lr 0.
"""

import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.setup import make_optimizer


def verl_constant(num_warmup_steps):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1.0, num_warmup_steps))
        return 1.0
    return lr_lambda


def verl_cosine(num_warmup_steps, num_training_steps, min_lr_ratio=0.0, num_cycles=0.5):
    coef = (1 - min_lr_ratio) * 0.5
    intercept = (1 + min_lr_ratio) * 0.5

    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
        return max(min_lr_ratio, x * coef + intercept)
    return lr_lambda


def lrs_of(oc: OptimConfig, total: int) -> list[float]:
    """The lr each of `total` updates runs at, stepping the schedule after each as the trainer does."""
    optim, sched = make_optimizer(torch.nn.Linear(2, 2), oc, total, torch.device("cpu"))
    out = []
    for _ in range(total):
        out.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    return out


LR, TOTAL = 1e-5, 40


@pytest.mark.parametrize("warmup", [0, 1, 8])
def test_constant_schedule_is_verls(warmup):
    lrs = lrs_of(OptimConfig(lr=LR, lr_warmup_steps=warmup), TOTAL)
    verl = verl_constant(warmup)
    for s in sorted({0, 1, max(warmup - 1, 0), warmup, TOTAL // 2, TOTAL - 1}):
        assert lrs[s] == pytest.approx(LR * verl(s), abs=1e-15), s
    if warmup:
        assert lrs[0] == 0.0  # the first update of a warm-up does not move the weights
    if warmup > 1:
        assert lrs[1] == pytest.approx(LR / warmup) and lrs[warmup - 1] == pytest.approx(LR * (warmup - 1) / warmup)
    assert lrs[warmup] == lrs[-1] == LR


@pytest.mark.parametrize("warmup,min_lr_ratio,num_cycles", [(0, 0.0, 0.5), (8, 0.0, 0.5), (8, 0.1, 0.5),
                                                            (5, 0.3, 0.5), (8, 0.1, 1.0), (4, 0.2, 0.25)])
def test_cosine_schedule_is_verls(warmup, min_lr_ratio, num_cycles):
    oc = OptimConfig(lr=LR, lr_warmup_steps=warmup, lr_scheduler_type="cosine", min_lr_ratio=min_lr_ratio,
                     num_cycles=num_cycles)
    lrs = lrs_of(oc, TOTAL)
    verl = verl_cosine(warmup, TOTAL, min_lr_ratio, num_cycles)
    middle = warmup + (TOTAL - warmup) // 2
    for s in sorted({0, 1, max(warmup - 1, 0), warmup, middle, TOTAL - 1}):
        assert lrs[s] == pytest.approx(LR * verl(s), abs=1e-15), s
    assert lrs[warmup] == pytest.approx(LR)  # the peak right after the warm-up
    # half-way through the decay (progress 1/2): cos(pi x num_cycles) between the peak and the floor
    if (TOTAL - warmup) % 2 == 0:
        floor, x = LR * min_lr_ratio, math.cos(math.pi * num_cycles)
        assert lrs[middle] == pytest.approx(floor + (LR - floor) * (1 + x) / 2)


def test_warmup_style_is_verls_older_name_of_lr_scheduler_type():
    # verl's FSDPOptimizerConfig: a set warmup_style replaces lr_scheduler_type; null leaves it
    assert OptimConfig(warmup_style="cosine").lr_scheduler_type == "cosine"
    assert OptimConfig(lr_scheduler_type="cosine", warmup_style="constant").lr_scheduler_type == "constant"
    assert OptimConfig(lr_scheduler_type="cosine", warmup_style=None).lr_scheduler_type == "cosine"
    by_old = lrs_of(OptimConfig(lr=LR, lr_warmup_steps=4, warmup_style="cosine", min_lr_ratio=0.1), TOTAL)
    assert by_old == lrs_of(OptimConfig(lr=LR, lr_warmup_steps=4, lr_scheduler_type="cosine", min_lr_ratio=0.1),
                            TOTAL)
    assert by_old[-1] < LR / 2


def test_warmup_ratio_counts_steps_of_the_schedule_length():
    # lr_warmup_steps=-1: int(ratio x total) steps, as verl's workers compute them
    lrs = lrs_of(OptimConfig(lr=LR, lr_warmup_steps_ratio=0.1), TOTAL)
    assert lrs[:5] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR], abs=1e-15)


@pytest.mark.parametrize("kind", ["constant", "cosine"])
def test_zero_warmup_steps_use_the_ratio_as_verl(kind):
    # verl's workers read lr_warmup_steps <= 0 (not only -1) as "use lr_warmup_steps_ratio"
    lrs = lrs_of(OptimConfig(lr=LR, lr_warmup_steps=0, lr_warmup_steps_ratio=0.1, lr_scheduler_type=kind), TOTAL)
    verl = (verl_constant(4) if kind == "constant" else verl_cosine(4, TOTAL))
    assert lrs == pytest.approx([LR * verl(s) for s in range(TOTAL)], abs=1e-15)
    assert lrs[:5] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR], abs=1e-15)
