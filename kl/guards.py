"""KL guards: watch the policy's KL to the reference and decide how to react.

A run whose KL to the reference grows out of control is usually lost a few steps later
(reward hacking, collapsed entropy, NaN log-probs). The guard turns the per-step mean KL
into a decision: "healthy", "warning" (above ``warn_kl``) or "exploding" (above
``explode_kl``, or non-finite), and, once a level has persisted for ``patience``
consecutive steps, the configured action. It is pure bookkeeping: the trainer applies the
action (multiply the KL coefficient, lower the learning rate, reload a checkpoint from before
the KL rose, stop), which keeps this module free of optimisers, models and ``torch.distributed``.
For a rollback it picks the checkpoint (``rollback_target``) and keeps the record of the
branches rollbacks abandoned, and of the checkpoints a resume found above the step it loaded, so
that their checkpoints are never a later rollback's target.

Both actions default to "warn": the guard monitors, and a verl config's fixed KL coefficient
stays fixed; the reactions that change the run are opt-in.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from kl.estimators import LOW_VAR_KL_MAX

__all__ = ["KL_GUARD_ACTIONS", "GUARD_STATUSES", "KLGuardConfig", "GuardDecision", "KLGuard"]

KL_GUARD_ACTIONS: tuple[str, ...] = ("warn", "raise_coef", "lower_lr", "rollback", "stop")
"""What the trainer may do when a threshold is crossed: only log ("warn"), multiply the KL
coefficient ("raise_coef"), multiply the learning rate ("lower_lr"), reload the models and
optimizers of the newest checkpoint from before the KL rose ("rollback"; the KL coefficients and
learning-rate schedules carry on) or end training ("stop")."""

GUARD_STATUSES: tuple[str, ...] = ("healthy", "warning", "exploding")


@dataclass
class KLGuardConfig:
    """Thresholds and reactions of the KL guard (``algorithm.kl_guard`` in the config)."""

    enable: bool = field(
        default=True,
        metadata={"help": "Check the KL every step (kl_guard/* metrics, log lines); the "
                          "reactions are warn_action and explode_action."},
    )
    warn_kl: float = field(
        default=0.02,
        metadata={"help": "Mean per-token KL (actor/ref_kl: low_var_kl, clamped per token to [-10, 10]) above "
                          "which the step is a 'warning' (> 0, < 10)."},
    )
    explode_kl: float = field(
        default=0.05,
        metadata={"help": "Mean per-token KL above which the step is 'exploding' (> warn_kl, < 10: the KL "
                          "watched never exceeds 10)."},
    )
    warn_action: str = field(
        default="warn", metadata={"help": f"Reaction to a persistent warning, one of {list(KL_GUARD_ACTIONS)}."}
    )
    explode_action: str = field(
        default="warn",
        metadata={"help": f"Reaction to a persistent explosion, one of {list(KL_GUARD_ACTIONS)}; 'warn' (default) "
                          "only logs, the others change the run and are opt-in."},
    )
    coef_multiplier: float = field(
        default=2.0, metadata={"help": "Factor (> 1) applied to the KL coefficient by 'raise_coef'."}
    )
    lr_multiplier: float = field(
        default=0.5, metadata={"help": "Factor in (0, 1) applied to the learning rate by 'lower_lr'."}
    )
    patience: int = field(
        default=1, metadata={"help": "Consecutive steps above a threshold before its action fires (>= 1)."}
    )
    max_kl_coef: float = field(
        default=1.0, metadata={"help": "Upper bound on the KL coefficient that 'raise_coef' can reach (> 0)."}
    )

    def __post_init__(self):
        for name in ("warn_kl", "explode_kl", "coef_multiplier", "lr_multiplier", "max_kl_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"KLGuardConfig.{name} must be a finite number, got {value!r}")
        for name in ("warn_kl", "explode_kl"):
            # The trainer's statistic is actor/ref_kl, the masked mean of the low_var_kl (k3)
            # estimate clamped per token to [-10, 10]: a threshold at or above 10 is never crossed.
            if getattr(self, name) >= LOW_VAR_KL_MAX:
                raise ValueError(
                    f"KLGuardConfig.{name}={getattr(self, name)} can never be exceeded: the guard watches "
                    f"actor/ref_kl, the mean of the low_var_kl (k3) estimate, clamped per token to "
                    f"[-{LOW_VAR_KL_MAX:g}, {LOW_VAR_KL_MAX:g}] (verl's clamp), so it is at most "
                    f"{LOW_VAR_KL_MAX:g} and only a non-finite KL would trigger; set algorithm.kl_guard.{name} "
                    f"below {LOW_VAR_KL_MAX:g}"
                )
        if self.warn_kl <= 0:
            raise ValueError(f"KLGuardConfig.warn_kl must be > 0, got {self.warn_kl}")
        if self.explode_kl <= self.warn_kl:
            raise ValueError(
                f"KLGuardConfig.explode_kl ({self.explode_kl}) must be greater than warn_kl ({self.warn_kl})"
            )
        for name in ("warn_action", "explode_action"):
            if getattr(self, name) not in KL_GUARD_ACTIONS:
                raise ValueError(
                    f"KLGuardConfig.{name} must be one of {list(KL_GUARD_ACTIONS)}, got {getattr(self, name)!r}"
                )
        if self.coef_multiplier <= 1:
            raise ValueError(f"KLGuardConfig.coef_multiplier must be > 1, got {self.coef_multiplier}")
        if not 0 < self.lr_multiplier < 1:
            raise ValueError(f"KLGuardConfig.lr_multiplier must be in (0, 1), got {self.lr_multiplier}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise ValueError(f"KLGuardConfig.patience must be an integer >= 1, got {self.patience!r}")
        if self.max_kl_coef <= 0:
            raise ValueError(f"KLGuardConfig.max_kl_coef must be > 0, got {self.max_kl_coef}")


@dataclass
class GuardDecision:
    """The guard's verdict on one step."""

    status: str
    """One of ``GUARD_STATUSES``: the level of this step alone, before patience."""
    action: str | None
    """The reaction the trainer must apply now (one of ``KL_GUARD_ACTIONS``), or None while
    the step is healthy, the level has not yet lasted ``patience`` steps, or the guard is
    disabled."""
    message: str
    """Human-readable explanation, suitable for the log."""
    streak_start: int | None = None
    """With an action and ``check``'s ``step``: the first step of the streak that fired it (the
    step itself for a non-finite KL that fires at once)."""


class KLGuard:
    """Stateful threshold monitor over the per-step mean KL.

    Counting rules:

    - a step above ``explode_kl`` (or with a non-finite KL) is also above ``warn_kl``, so it
      advances both the exploding and the warning counters; a warning step resets the
      exploding counter; a healthy step resets both;
    - when a counter reaches ``patience`` its action fires (the exploding action wins) and
      that counter restarts, so a condition that persists fires again every ``patience``
      steps (with ``raise_coef`` the coefficient keeps growing, up to ``max_kl_coef``);
    - a non-finite KL fires the exploding action at once, whatever ``patience`` says: the
      update that produced it must not be followed by more of the same.
    """

    def __init__(self, config: KLGuardConfig):
        self.config = config
        self.warn_steps = 0
        self.explode_steps = 0
        self.num_actions = 0
        self.unhealthy_since: int | None = None
        """The first step of the current run of unhealthy steps (``check``'s ``step``), None after a
        healthy one or a rollback."""
        self.rollbacks: list[tuple[int, int]] = []
        """``(target, step)`` of every rollback done: at ``step`` the models went back to the
        checkpoint of ``target``, so the checkpoints of the steps in between (exclusive) hold an
        abandoned branch's weights."""
        self.stale_steps: list[int] = []
        """Steps whose checkpoints hold the weights of a run this one does not continue: those a resume
        found above the step it loaded (an earlier run's, left by a resume from an earlier checkpoint or
        by the rotation), until this run writes its own of the step (``note_resume``, ``note_checkpoint``)."""

    def check(self, mean_kl: float, max_kl: float | None = None, step: int | None = None) -> GuardDecision:
        """Classify one step and return the action to take, if any.

        Args:
            mean_kl: mean per-token KL of the step (masked mean over response tokens).
            max_kl: optional largest per-token KL of the step; reported in the message, and a
                non-finite value marks the step as exploding.
            step: the step's number (1 for the first), from which a decision with an action
                gets its ``streak_start``; checked once per step, in order.
        """
        cfg = self.config
        mean_kl = float(mean_kl)
        max_kl = None if max_kl is None else float(max_kl)
        non_finite = not math.isfinite(mean_kl) or (max_kl is not None and not math.isfinite(max_kl))

        if non_finite or mean_kl > cfg.explode_kl:
            status = "exploding"
        elif mean_kl > cfg.warn_kl:
            status = "warning"
        else:
            status = "healthy"

        detail = f"mean KL {mean_kl:.6g}" + ("" if max_kl is None else f", max KL {max_kl:.6g}")
        if not cfg.enable:
            return GuardDecision(status, None, f"{detail}; KL guard disabled")

        if status == "healthy":
            self.warn_steps = 0
            self.explode_steps = 0
            self.unhealthy_since = None
            return GuardDecision(status, None, f"{detail} <= warn_kl {cfg.warn_kl}")

        if self.unhealthy_since is None:
            self.unhealthy_since = step
        self.warn_steps += 1
        self.explode_steps = self.explode_steps + 1 if status == "exploding" else 0

        if status == "exploding":
            reason = "non-finite KL" if non_finite else f"{detail} > explode_kl {cfg.explode_kl}"
            if non_finite or self.explode_steps >= cfg.patience:
                steps = self.explode_steps
                self.explode_steps = 0
                self.warn_steps = 0
                return self._fire(status, cfg.explode_action, f"{reason} for {steps} consecutive step(s)")
        else:
            reason = f"{detail} > warn_kl {cfg.warn_kl}"
        if self.warn_steps >= cfg.patience:
            steps = self.warn_steps
            self.warn_steps = 0
            return self._fire(status, cfg.warn_action, f"{reason} for {steps} consecutive step(s)")
        return GuardDecision(
            status, None, f"{reason}; {self.warn_steps}/{cfg.patience} consecutive step(s) before reacting"
        )

    def _fire(self, status: str, action: str, reason: str) -> GuardDecision:
        self.num_actions += 1
        # the streak began where the run of unhealthy steps did: a reaction (or a rollback that found no
        # checkpoint) restarts the patience count, not that run
        return GuardDecision(status, action, f"{reason}: action {action!r}", self.unhealthy_since)

    def rollback_bound(self, step: int, streak_start: int) -> int:
        """The newest step whose checkpoint a rollback at ``step``, for a streak that began at
        ``streak_start``, may load.

        The KL of step K is measured before K's update, on the weights that step K-1 left: those
        of checkpoint K-1, or those of checkpoint T where step K-1 rolled back to T. Every step
        of the streak judged such weights too high, so the newest weights not judged bad are
        those before the oldest judged ones: checkpoint ``streak_start - 2``, or T - 1 where a
        step of ``[streak_start - 1, step - 1]`` rolled back to T.
        """
        bound = streak_start - 2
        for target, at in self.rollbacks:
            if streak_start - 1 <= at < step:
                bound = min(bound, target - 1)
        return bound

    def abandoned(self, checkpoint_step: int) -> bool:
        """Whether the checkpoint of ``checkpoint_step`` holds weights that a rollback abandoned, or
        another run's that a resume left (``stale_steps``)."""
        return checkpoint_step in self.stale_steps or any(target < checkpoint_step < at for target, at in self.rollbacks)

    def rollback_target(self, checkpoint_steps: list[int], step: int, streak_start: int) -> int | None:
        """The checkpoint a rollback at ``step`` loads: the newest of ``checkpoint_steps`` (the
        complete ones) at or before ``rollback_bound`` and not ``abandoned``; None if none is."""
        bound = self.rollback_bound(step, streak_start)
        fit = [s for s in checkpoint_steps if s <= bound and not self.abandoned(s)]
        return max(fit) if fit else None

    def record_rollback(self, target: int, step: int) -> None:
        """Note that the models went back to the checkpoint of ``target`` at ``step``: the next unhealthy
        step begins a new run of them (on the restored weights)."""
        self.rollbacks.append((int(target), int(step)))
        self.unhealthy_since = None

    def note_resume(self, step: int, checkpoint_steps: list[int]) -> None:
        """Note that the run resumed the checkpoint of ``step`` with the complete checkpoints of
        ``checkpoint_steps`` present: those above ``step`` come from a run this one does not continue
        (it goes on from ``step``), as do the earlier ``stale_steps`` the resumed state names."""
        self.stale_steps = sorted(set(self.stale_steps).union(s for s in checkpoint_steps if s > step))

    def note_checkpoint(self, step: int) -> None:
        """Note that this run writes the checkpoint of ``step`` (over any other run's of the step)."""
        self.stale_steps = [s for s in self.stale_steps if s != step]

    def next_kl_coef(self, kl_coef: float) -> float:
        """The coefficient after a ``raise_coef`` action: multiplied, capped at ``max_kl_coef``.

        A coefficient already above the cap is left as it is (raising never lowers it), and a
        zero coefficient stays zero: multiplying cannot create a penalty the run disabled.
        """
        return max(kl_coef, min(kl_coef * self.config.coef_multiplier, self.config.max_kl_coef))

    def next_lr(self, lr: float) -> float:
        """The learning rate after a ``lower_lr`` action."""
        return lr * self.config.lr_multiplier

    def state_dict(self) -> dict[str, Any]:
        return {"warn_steps": self.warn_steps, "explode_steps": self.explode_steps, "num_actions": self.num_actions,
                "rollbacks": [list(r) for r in self.rollbacks], "unhealthy_since": self.unhealthy_since,
                "stale_steps": list(self.stale_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warn_steps = int(state["warn_steps"])
        self.explode_steps = int(state["explode_steps"])
        self.num_actions = int(state["num_actions"])
        # (a checkpoint written before rollbacks were recorded: none is known)
        self.rollbacks = [(int(target), int(at)) for target, at in state.get("rollbacks", [])]
        self.unhealthy_since = state.get("unhealthy_since")
        # (a checkpoint written before stale steps were recorded: none is known)
        self.stale_steps = [int(s) for s in state.get("stale_steps", [])]
