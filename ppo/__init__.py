"""PPO algorithm core: advantages, losses and their aggregation (pure tensor maths).

Estimators and policy losses are registries with one keyword signature per kind
(``register_adv_est``, ``register_policy_loss``). The runtime that calls them is the
``trainer`` package (docs/ARCHITECTURE.md); nothing here imports ``torch.distributed``.
"""

from ppo.core_algos import (
    ADV_ESTIMATOR_INPUTS,
    ADV_ESTIMATORS,
    BYPASS_LOSS_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSS_INPUTS,
    POLICY_LOSSES,
    PolicyLossOutput,
    PolicyLossParams,
    ValueLossOutput,
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    count_loss_units,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    register_adv_est,
    register_policy_loss,
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
    "ADV_ESTIMATOR_INPUTS",
    "ADV_ESTIMATORS",
    "register_adv_est",
    "get_adv_estimator_fn",
    "LOSS_AGG_MODES",
    "agg_loss",
    "count_loss_units",
    "POLICY_LOSS_INPUTS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "PolicyLossParams",
    "BYPASS_LOSS_TYPES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss",
    "ValueLossOutput",
    "compute_value_loss",
]
