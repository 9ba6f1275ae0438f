"""KL regularisation: per-token estimators, coefficient controllers and KL guards.

Pure maths and bookkeeping; nothing here imports ``torch.distributed``.
"""

from kl.controllers import AdaptiveKLController, FixedKLController, KLCoefficients, get_kl_controller
from kl.estimators import VALID_KL_PENALTIES, kl_penalty
from kl.guards import GUARD_STATUSES, KL_GUARD_ACTIONS, GuardDecision, KLGuard, KLGuardConfig

__all__ = [
    "kl_penalty",
    "VALID_KL_PENALTIES",
    "FixedKLController",
    "AdaptiveKLController",
    "KLCoefficients",
    "get_kl_controller",
    "KLGuardConfig",
    "KLGuard",
    "GuardDecision",
    "KL_GUARD_ACTIONS",
    "GUARD_STATUSES",
]
