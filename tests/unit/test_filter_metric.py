"""`PPOTrainer._filter_metric`: a filter_groups.metric that is neither a numeric extra of the reward function
nor one of the sequence metrics is refused with a message listing what it accepts, and every metric the
message lists is accepted (`reward`, verl 0.9.1's summed reward, the score, included)."""

from types import SimpleNamespace

import pytest
import torch

from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.errors import UserError
from trainer.ppo_trainer import PPOTrainer

# two rows: (the score, the function's own score, the extra acc)
COLS = torch.tensor([[1.5, 1.0, 1.0], [0.5, 0.25, 0.0]], dtype=torch.float64)


def _metric_of(metric: str):
    cfg = load_config(PPOConfig, None, ["algorithm.filter_groups.enable=true",
                                        f"algorithm.filter_groups.metric={metric}"])
    return PPOTrainer._filter_metric(SimpleNamespace(cfg=cfg), COLS, ["acc"], None).tolist()


def test_an_unknown_metric_names_every_accepted_one_and_each_is_accepted():
    with pytest.raises(UserError) as raised:
        _metric_of("parity")
    assert str(raised.value) == ("algorithm.filter_groups.metric=parity is not one of the reward function's numeric "
                                 "results (acc) nor seq_reward / seq_final_reward / score / reward")
    wanted = {"acc": [1.0, 0.0], "seq_reward": [1.5, 0.5], "seq_final_reward": [1.5, 0.5], "score": [1.0, 0.25],
              "reward": [1.5, 0.5]}
    for metric, values in wanted.items():
        assert _metric_of(metric) == values, metric
