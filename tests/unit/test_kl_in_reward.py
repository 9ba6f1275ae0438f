"""KL in the reward: the trainer's penalty, logged KL and adaptive-controller step against verl's
`apply_kl_penalty`, by hand (float64)."""

import types

import numpy as np
import pytest
import torch

from kl import FixedKLController, KLCoefficients, get_kl_controller
from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.ppo_trainer import PPOTrainer
from trainer.tracking import Timer


class _Rows:
    def __init__(self, n, **fields):
        self._n = n
        self.__dict__.update(fields)

    def __len__(self):
        return self._n


@pytest.mark.parametrize("target_kl,expected_beta", [(1.0, 0.1 * (1 + 0.2 * 4 / 10)), (2.0, 0.1 * (1 - 0.2 * 4 / 10))])
def test_kl_in_reward_is_verls_sequence_mean_and_steps_by_responses(target_kl, expected_beta):
    """2 prompts x rollout.n 2 = 4 responses of 1, 1, 1 and 5 tokens; per-token k1 KL 2, 2, 2 and 0.
    verl: the KL is the mean over responses of each response's token mean, (2 + 2 + 2 + 0) / 4 = 1.5
    (a token mean would give 6 / 8 = 0.75), and the controller steps by the 4 responses
    (beta *= 1 + clip(1.5 / target - 1, +-0.2) * 4 / horizon): 0.1 -> 0.108 for target 1 (a token mean would
    lower beta), and 0.1 -> 0.092 for target 2."""
    cfg = load_config(PPOConfig, None, [
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1", f"algorithm.kl_ctrl.target_kl={target_kl}", "algorithm.kl_ctrl.horizon=10"])
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    ref = torch.tensor([[-2.0] * 5, [-2.0] * 5, [-2.0] * 5, [0.0] * 5])
    scores = torch.zeros(4, 5)
    scores[torch.arange(4), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    ro = _Rows(4, response_mask=mask, old_log_probs=torch.zeros(4, 5), ref_log_probs=ref, token_level_scores=scores,
               values=None)
    full = _Rows(4, response_mask=mask, loss_mask=mask, uids=["a", "a", "b", "b"])
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.timer, trainer.ctx = Timer(trainer.device), types.SimpleNamespace(rank=0)
    kc = cfg.algorithm.kl_ctrl
    trainer.kl = KLCoefficients(get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon), FixedKLController(0.0))
    metrics = {}
    trainer._compute_advantages(full, ro, [[0, 1, 2, 3]], metrics)

    assert metrics["actor/reward_kl_penalty"] == pytest.approx(1.5, abs=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the coefficient the penalty used
    assert trainer.kl.in_reward.value == pytest.approx(expected_beta, abs=1e-12)
    expected_rewards = scores.double() - 0.1 * torch.tensor([[2.0] * 5] * 3 + [[0.0] * 5]).double() * mask.double()
    np.testing.assert_allclose(ro.token_level_rewards.double().numpy(), expected_rewards.numpy(), atol=1e-6)
