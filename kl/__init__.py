"""KL regularisation: per-token estimators, coefficient controllers and KL guards.

Pure maths and bookkeeping; nothing here imports ``torch.distributed``.
"""

import importlib

_EXPORTS = {
    "kl.controllers": ("AdaptiveKLController", "FixedKLController", "KLCoefficients", "get_kl_controller"),
    "kl.estimators": ("VALID_KL_PENALTIES", "kl_penalty"),
    "kl.guards": ("GUARD_STATUSES", "KL_GUARD_ACTIONS", "GuardDecision", "KLGuard", "KLGuardConfig"),
}

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


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `kl` (or `kl` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
