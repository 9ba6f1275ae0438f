"""PPO algorithm core: advantages, losses and their aggregation (pure tensor maths).

Only ``ppo.core_algos`` is re-exported here so that ``import ppo`` stays light and has no
side effects; the trainer is imported explicitly from ``trainer.ppo_trainer``.
"""

from ppo.core_algos import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    count_loss_units,
    entropy_from_logits,
    get_adv_estimator_fn,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "ADV_ESTIMATORS",
    "get_adv_estimator_fn",
    "LOSS_AGG_MODES",
    "agg_loss",
    "count_loss_units",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
]
