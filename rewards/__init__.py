"""Rewards: rule-based scorers (GSM8K, the demo task), the verl-style reward-function API and verl's
reward managers."""

from rewards.managers import (
    REWARD_MANAGERS,
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardManager,
    load_reward_manager,
)
from rewards.registry import (
    BUILTIN_DATA_SOURCES,
    RewardError,
    default_compute_score,
    get_reward_fn,
    load_custom_reward_fn,
    score_responses,
)

__all__ = [
    "BUILTIN_DATA_SOURCES",
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardError",
    "RewardManager",
    "default_compute_score",
    "get_reward_fn",
    "load_custom_reward_fn",
    "load_reward_manager",
    "score_responses",
]
