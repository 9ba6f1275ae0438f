"""Rewards: rule-based scorers (GSM8K, the demo task), the verl-style reward-function API and verl's
reward managers."""

import importlib

_EXPORTS = {
    "rewards.managers": (
        "REWARD_MANAGERS", "BatchRewardManager", "DAPORewardManager", "NaiveRewardManager", "PrimeRewardManager",
        "RewardManager", "load_reward_manager",
    ),
    "rewards.registry": (
        "BUILTIN_DATA_SOURCES", "RewardError", "default_compute_score", "get_reward_fn", "load_custom_reward_fn",
        "score_responses",
    ),
}

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


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `rewards` (or `rewards` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
