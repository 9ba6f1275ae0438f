"""KL coefficient controllers: a constant beta, or Ziegler et al.'s adaptive beta.

The adaptive controller follows "Fine-Tuning Language Models from Human Preferences"
(Ziegler et al. 2019, https://arxiv.org/abs/1909.08593): a proportional
controller that moves the coefficient towards the value at which the measured KL equals
``target_kl``, with the error clipped to +-20 % so one noisy step cannot swing it far.
Both controllers expose ``value`` (the coefficient to use now) and are checkpointed with
``state_dict()`` / ``load_state_dict()`` so a resumed run continues with the same beta.
"""

import math
from typing import Any

__all__ = ["FixedKLController", "AdaptiveKLController", "KLCoefficients", "get_kl_controller"]


def _check_coef(kl_coef: float) -> float:
    kl_coef = float(kl_coef)
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef}")
    return kl_coef


def _load_value(state: dict[str, Any]) -> float:
    if "value" not in state:
        raise KeyError(f"KL controller state has no 'value' entry; keys are {sorted(state)}")
    return _check_coef(state["value"])


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing.

    ``value`` stays assignable so that a KL guard's ``raise_coef`` reaction (applied by the
    trainer) also works with a fixed coefficient.
    """

    def __init__(self, kl_coef: float):
        self.value = _check_coef(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed. Same signature as the adaptive controller."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _load_value(state)


class AdaptiveKLController:
    """Proportional control of the KL coefficient (Ziegler et al. 2019).

    After each step::

        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value = value * (1 + error * n_steps / horizon)

    Args:
        init_kl_coef: starting coefficient beta_0 (>= 0).
        target_kl: the KL (same estimator and units as ``current_kl``) to steer towards (> 0).
        horizon: number of samples over which an error is corrected (> 0); ``n_steps`` in
            ``update`` is measured in the same unit (the trainer passes, as verl does, the
            responses of the step: prompts x ``rollout.n``).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = _check_coef(init_kl_coef)
        if not (math.isfinite(target_kl) and target_kl > 0):
            raise ValueError(f"target_kl must be a finite number > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the coefficient at which the KL would equal ``target_kl``.

        A non-finite ``current_kl`` leaves the coefficient unchanged: proportional control is
        undefined there, and reacting to a NaN/inf KL is the KL guard's job (see
        ``kl.guards``), which reports it as "exploding".
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the learned coefficient, the only state: ``target`` and ``horizon`` are the
        configured ones, which a resume cannot change (``algorithm.*`` are ``SAME_RUN_OPTIONS``:
        a checkpoint written under other values is refused before this runs)."""
        self.value = _load_value(state)


def get_kl_controller(
    kl_ctrl_type: str, kl_coef: float, target_kl: float, horizon: int
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (verl's option).

    Args:
        kl_ctrl_type: ``"fixed"`` or ``"adaptive"``.
        kl_coef: the (initial) coefficient.
        target_kl, horizon: used by ``"adaptive"`` only.
    """
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"Unknown kl_ctrl type {kl_ctrl_type!r}; valid types are ['fixed', 'adaptive'].")


class KLCoefficients:
    """The run's two KL coefficients as one checkpointed state: ``in_reward`` (KL in the reward,
    ``algorithm.kl_ctrl``) and ``in_loss`` (the actor's KL loss, a fixed controller at
    ``kl_loss_coef``). Both are controllers, so a guard's ``raise_coef`` acts on each the same
    way (``raise_coefs``)."""

    def __init__(self, in_reward, in_loss):
        self.in_reward, self.in_loss = in_reward, in_loss

    def raise_coefs(self, next_coef, in_reward: bool, in_loss: bool) -> None:
        """Set each enabled coefficient to ``next_coef(value)``."""
        for ctrl, enabled in ((self.in_loss, in_loss), (self.in_reward, in_reward)):
            if enabled:
                ctrl.value = next_coef(ctrl.value)

    def state_dict(self) -> dict[str, Any]:
        return {"in_reward": self.in_reward.state_dict(), "in_loss": self.in_loss.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_reward.load_state_dict(state["in_reward"])
        self.in_loss.load_state_dict(state["in_loss"])
