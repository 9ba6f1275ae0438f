"""Rewards: rule-based scorers (GSM8K, the demo task) and the verl-style reward-function API."""

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
    "RewardError",
    "default_compute_score",
    "get_reward_fn",
    "load_custom_reward_fn",
    "score_responses",
]
