"""KL estimators, controllers and guards against hand-computed and float64 references."""

import math

import pytest
import torch

from kl import (
    VALID_KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    KLCoefficients,
    KLGuard,
    KLGuardConfig,
    get_kl_controller,
    kl_penalty,
)


def _reference_kl(logp: float, ref: float, name: str) -> float:
    base = name.rstrip("+")
    if base in ("kl", "k1"):
        return logp - ref
    if base == "abs":
        return abs(logp - ref)
    if base in ("mse", "k2"):
        return 0.5 * (logp - ref) ** 2
    d = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1.0, -10.0), 10.0)


@pytest.fixture
def logprobs():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 5
    # Extreme differences exercise both k3 clamps.
    logp[0, 0], ref[0, 0] = 0.0, -30.0
    logp[0, 1], ref[0, 1] = -30.0, 0.0
    logp[0, 2], ref[0, 2] = -1.0, 2.0
    return logp, ref


@pytest.mark.parametrize("name", VALID_KL_PENALTIES)
def test_kl_penalty_matches_float64_reference(logprobs, name):
    logp, ref = logprobs
    out = kl_penalty(logp, ref, name)
    expected = torch.tensor(
        [
            [_reference_kl(a, b, name) for a, b in zip(row_p, row_r)]
            for row_p, row_r in zip(logp.tolist(), ref.tolist())
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_k3_hand_values():
    logp = torch.tensor([0.0, 0.0, -1.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -30.0, 2.0, -0.5], dtype=torch.float64)
    out = kl_penalty(logp, ref, "k3")
    # d = ref - logp: -1 -> e^-1 + 1 - 1; -30 -> clamped to -20 -> 19 + e^-20; 3 -> e^3 - 4 = 16.09 -> 10; 0 -> 0.
    expected = torch.tensor([math.exp(-1.0), 10.0, 10.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert kl_penalty(logp, ref, "low_var_kl").equal(out)


@pytest.mark.parametrize("name", ["k3+", "low_var_kl+", "k1+", "kl+", "abs+", "k2+", "mse+"])
def test_straight_through_value_and_k2_gradient(logprobs, name):
    logp, ref = (t.clone().requires_grad_(True) for t in logprobs)
    out = kl_penalty(logp, ref, name)
    base = name[:-1]
    torch.testing.assert_close(out.detach(), kl_penalty(logp.detach(), ref.detach(), base), rtol=1e-12, atol=1e-12)

    weights = torch.linspace(0.5, 2.0, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * weights).sum().backward()
    diff = (logprobs[0] - logprobs[1])
    torch.testing.assert_close(logp.grad, weights * diff, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.grad, -weights * diff, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["k3+", "low_var_kl+", "k1+", "kl+", "abs+", "k2+", "mse+"])
def test_straight_through_value_survives_bf16_at_extreme_log_ratios(name):
    # k2 is thousands here: the value must not be computed as k2 + (value - k2), which rounds a
    # value of 10 (or 100) away next to it in bf16.
    logp0 = torch.tensor([-0.05, -100.3, -0.01, -60.0, -3.0], dtype=torch.bfloat16)
    ref = torch.tensor([-100.3, -0.05, -80.0, -0.02, -3.5], dtype=torch.bfloat16)
    logp = logp0.clone().requires_grad_(True)
    out = kl_penalty(logp, ref, name)
    plain = kl_penalty(logp0, ref, name[:-1])
    assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), plain), (out, plain)
    if name in ("k3+", "low_var_kl+"):
        assert plain[0].item() == 10.0  # the clamped k3 of the example above
    weights = torch.linspace(0.5, 2.0, out.numel(), dtype=torch.bfloat16)
    (out * weights).sum().backward()
    k2_logp = logp0.clone().requires_grad_(True)
    (kl_penalty(k2_logp, ref, "k2") * weights).sum().backward()
    assert torch.equal(logp.grad, k2_logp.grad)


def test_plain_k3_gradient_is_not_k2_gradient(logprobs):
    # Guards the previous test against an implementation that always returns k2's gradient.
    logp = logprobs[0][1:].clone().requires_grad_(True)
    ref = logprobs[1][1:]
    kl_penalty(logp, ref, "k3").sum().backward()
    d = (ref - logp.detach()).clamp(-20, 20)
    torch.testing.assert_close(logp.grad, 1.0 - torch.exp(d), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(logp.grad, logp.detach() - ref)


def test_kl_penalty_rejects_full_and_unknown():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="full"):
        kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError):
        kl_penalty(x, x, "k3++")


def test_adaptive_controller_three_steps_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    # kl 0.1: error clip(1.0) = 0.2, mult 1 + 0.2 * 10 / 100 = 1.02 -> 0.102
    ctrl.update(current_kl=0.1, n_steps=10)
    assert ctrl.value == pytest.approx(0.102, rel=1e-12)
    # kl 0.04: error -0.2, mult 0.98 -> 0.09996
    ctrl.update(current_kl=0.04, n_steps=10)
    assert ctrl.value == pytest.approx(0.09996, rel=1e-12)
    # kl 0.055: error 0.1, mult 1 + 0.1 * 20 / 100 = 1.02 -> 0.1019592
    ctrl.update(current_kl=0.055, n_steps=20)
    assert ctrl.value == pytest.approx(0.1019592, rel=1e-12)
    # A non-finite KL leaves the coefficient alone.
    ctrl.update(current_kl=float("nan"), n_steps=20)
    assert ctrl.value == pytest.approx(0.1019592, rel=1e-12)


def test_adaptive_controller_state_round_trip():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.01, horizon=1000)
    for kl_value in (0.05, 0.002, 0.011):
        ctrl.update(kl_value, n_steps=64)
    resumed = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.01, horizon=1000)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value != 0.2
    for kl_value in (0.03, 0.004):
        ctrl.update(kl_value, n_steps=64)
        resumed.update(kl_value, n_steps=64)
        assert resumed.value == ctrl.value


def test_fixed_controller_and_factory():
    ctrl = get_kl_controller("fixed", kl_coef=0.05, target_kl=0.1, horizon=10)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(10.0, n_steps=1000)
    assert ctrl.value == 0.05
    other = FixedKLController(0.3)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05

    adaptive = get_kl_controller("adaptive", kl_coef=0.05, target_kl=0.1, horizon=10)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.05, 0.1, 10)
    with pytest.raises(ValueError, match="adaptive"):
        get_kl_controller("pid", kl_coef=0.05, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", kl_coef=0.05, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)
    with pytest.raises(KeyError):
        other.load_state_dict({})


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"warn_kl": 0.05, "explode_kl": 0.05}, "explode_kl"),
        ({"warn_kl": -0.1}, "warn_kl"),
        ({"warn_action": "panic"}, "warn_action"),
        ({"explode_action": "restart"}, "explode_action"),
        ({"coef_multiplier": 1.0}, "coef_multiplier"),
        ({"lr_multiplier": 1.5}, "lr_multiplier"),
        ({"patience": 0}, "patience"),
        ({"max_kl_coef": 0.0}, "max_kl_coef"),
        ({"warn_kl": float("nan")}, "warn_kl"),
    ],
)
def test_guard_config_validation_names_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        KLGuardConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field_name", [({"explode_kl": 10.0}, "explode_kl"), ({"explode_kl": 1e9}, "explode_kl"),
                                                ({"warn_kl": 10.0, "explode_kl": 20.0}, "warn_kl"),
                                                ({"warn_kl": 12.0}, "warn_kl")])
def test_guard_config_refuses_thresholds_the_clamped_kl_never_crosses(kwargs, field_name):
    # The guard watches actor/ref_kl, a mean of k3 values clamped to [-10, 10]: it is at most 10.
    with pytest.raises(ValueError, match=rf"KLGuardConfig.{field_name}=.* can never be exceeded: .*clamped per token "
                                         rf"to \[-10, 10\].*set algorithm.kl_guard.{field_name} below 10"):
        KLGuardConfig(**kwargs)
    big = torch.tensor([[0.0, -50.0], [-40.0, 0.0]], dtype=torch.float64)
    assert kl_penalty(big, big.flip(0), "low_var_kl").max().item() == 10.0  # the bound the message states
    KLGuardConfig(warn_kl=9.0, explode_kl=9.99)  # below it: accepted


def test_guard_config_fields_have_help():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(KLGuardConfig))


def test_guard_defaults_only_warn_and_leave_a_fixed_coefficient_alone():
    # verl has no guard: its kl_loss_coef / kl_ctrl.kl_coef stay as configured. With the default
    # guard a KL above explode_kl every step only warns (it used to double the coefficient each
    # step: 0.001 -> 0.128 over these 8 steps).
    cfg = KLGuardConfig()
    assert cfg.enable and (cfg.warn_action, cfg.explode_action) == ("warn", "warn")
    guard, coefs = KLGuard(cfg), KLCoefficients(FixedKLController(0.001), FixedKLController(0.001))
    statuses = []
    for kl_value in (0.03, 0.06, 0.07, 0.08, 0.06, 0.09, 0.1, 0.055):
        decision = guard.check(kl_value)
        statuses.append(decision.status)
        assert decision.action in (None, "warn")
        if decision.action == "raise_coef":
            coefs.raise_coefs(guard.next_kl_coef, in_reward=True, in_loss=True)
    assert statuses == ["warning"] + ["exploding"] * 7
    assert guard.num_actions == 8
    assert (coefs.in_reward.value, coefs.in_loss.value) == (0.001, 0.001)


def test_guard_decisions_with_patience_and_nan():
    guard = KLGuard(KLGuardConfig(patience=2, warn_action="lower_lr", explode_action="raise_coef"))
    sequence = [
        (0.01, "healthy", None),
        (0.03, "warning", None),  # 1/2 steps above warn_kl
        (0.03, "warning", "lower_lr"),  # 2/2: fires, counter restarts
        (0.03, "warning", None),  # 1/2 again
        (0.06, "exploding", "lower_lr"),  # 2 steps above warn_kl, only 1 above explode_kl
        (0.07, "exploding", "raise_coef"),  # 2 steps above explode_kl
        (0.01, "healthy", None),  # resets everything
        (0.06, "exploding", None),  # 1/2
        (0.01, "healthy", None),
        (float("nan"), "exploding", "raise_coef"),  # non-finite: immediate, whatever patience says
        (0.06, "exploding", None),  # counters were restarted by the NaN reaction
    ]
    for step, (kl_value, status, action) in enumerate(sequence):
        decision = guard.check(kl_value)
        assert (decision.status, decision.action) == (status, action), f"step {step}: {decision}"
        assert decision.message
    assert guard.num_actions == 4


def test_guard_max_kl_infinite_and_disabled():
    guard = KLGuard(KLGuardConfig(patience=3, explode_action="raise_coef"))
    decision = guard.check(0.001, max_kl=float("inf"))
    assert (decision.status, decision.action) == ("exploding", "raise_coef")
    assert "non-finite" in decision.message
    decision = guard.check(0.001, max_kl=4.0)
    assert (decision.status, decision.action) == ("healthy", None)

    off = KLGuard(KLGuardConfig(enable=False))
    for kl_value in (0.03, 0.5, float("nan")):
        decision = off.check(kl_value)
        assert decision.action is None
    assert decision.status == "exploding"
    assert off.state_dict() == {"warn_steps": 0, "explode_steps": 0, "num_actions": 0, "rollbacks": [],
                                "unhealthy_since": None, "stale_steps": []}


def test_guard_state_round_trip_and_reactions():
    cfg = KLGuardConfig(patience=3, explode_action="raise_coef", coef_multiplier=2.0, max_kl_coef=1.0,
                        lr_multiplier=0.5)
    guard = KLGuard(cfg)
    for kl_value in (0.06, 0.07):
        assert guard.check(kl_value).action is None
    resumed = KLGuard(cfg)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.state_dict() == {"warn_steps": 2, "explode_steps": 2, "num_actions": 0, "rollbacks": [],
                                    "unhealthy_since": None, "stale_steps": []}  # (no step given)
    # Both continue identically: the third exploding step fires the exploding action.
    assert guard.check(0.08).action == resumed.check(0.08).action == "raise_coef"

    assert guard.next_kl_coef(0.3) == pytest.approx(0.6)
    assert guard.next_kl_coef(0.6) == 1.0
    assert guard.next_kl_coef(2.0) == 2.0
    assert guard.next_kl_coef(0.0) == 0.0
    assert guard.next_lr(1e-6) == pytest.approx(5e-7)


def test_guard_decision_names_the_step_its_streak_began():
    guard = KLGuard(KLGuardConfig(patience=3, warn_action="lower_lr", explode_action="rollback"))
    decisions = {step: guard.check(kl_value, step=step)
                 for step, kl_value in enumerate([0.01, 0.03, 0.06, 0.06, 0.06, 0.03, 0.01, 0.06, float("nan")], 1)}
    # steps 2..4 above warn_kl: the warning fires at 4 (streak from 2); 3..5 above explode_kl: fires at 5,
    # in the run of unhealthy steps that began at 2 (the KL rose there); 8 and 9 after the healthy step 7
    assert [(s, d.action, d.streak_start) for s, d in decisions.items() if d.action] == [
        (4, "lower_lr", 2), (5, "rollback", 2), (9, "rollback", 8)]
    assert all(d.streak_start is None for d in decisions.values() if not d.action)
    assert KLGuard(KLGuardConfig()).check(float("nan")).streak_start is None  # no step given
    # A reaction restarts the patience count, not the streak: a rollback at step 4 that found no checkpoint,
    # fired again at 6, still goes back to before step 3 (it named step 5, letting it load weights step 4
    # had judged too high); after a rollback that loaded one, the next unhealthy step begins a new streak.
    guard = KLGuard(KLGuardConfig(patience=2, explode_action="rollback"))
    fired = [(step, d.streak_start) for step in range(1, 7)
             if (d := guard.check(0.0 if step < 3 else 0.06, step=step)).action]
    assert fired == [(4, 3), (6, 3)] and guard.rollback_target([2, 3, 4, 5], 6, 3) is None
    guard.record_rollback(1, 6)
    assert [guard.check(0.06, step=step).streak_start for step in (7, 8)] == [None, 7]
    resumed = KLGuard(KLGuardConfig(patience=2, explode_action="rollback"))
    resumed.load_state_dict(guard.state_dict())
    assert resumed.unhealthy_since == 7


def test_rollback_target_skips_the_judged_weights_and_abandoned_branches():
    guard = KLGuard(KLGuardConfig(explode_action="rollback"))
    # A streak that began at step 4 judged the weights of step 3 (measured before step 4's update):
    # the newest good ones are checkpoint 2's, not the latest (3).
    assert guard.rollback_bound(4, 4) == 2
    assert guard.rollback_target([1, 2, 3], 4, 4) == 2
    assert guard.rollback_target([1, 3], 6, 4) == 1  # patience 3: from before step 4, whatever step it fires
    assert guard.rollback_target([3], 4, 4) is None and guard.rollback_target([], 2, 2) is None
    guard.record_rollback(2, 4)  # checkpoint 3 now holds an abandoned branch's weights; 4's the restored ones
    assert [s for s in range(1, 6) if guard.abandoned(s)] == [3]
    # Step 5's KL was measured on the restored weights (checkpoint 2's): the target is older than them.
    assert guard.rollback_bound(5, 5) == 1 and guard.rollback_target([1, 2, 3, 4], 5, 5) == 1
    # Step 6's on the weights of step 5, after the rollback: checkpoint 4 (the restored weights) is fine
    # and checkpoint 3, the abandoned branch, is never picked.
    assert guard.rollback_target([1, 2, 3, 4, 5], 6, 6) == 4
    assert guard.rollback_target([1, 2, 3], 6, 6) == 2
    assert guard.rollback_target([3], 9, 9) is None
    # The record survives a resume (it is in the guard's checkpointed state).
    resumed = KLGuard(KLGuardConfig(explode_action="rollback"))
    resumed.load_state_dict(guard.state_dict())
    assert resumed.rollbacks == [(2, 4)] and resumed.rollback_target([1, 2, 3], 6, 6) == 2
    # a state written before the record existed: no rollback known
    older = {k: v for k, v in guard.state_dict().items() if k != "rollbacks"}
    resumed.load_state_dict(older)
    assert resumed.rollbacks == []


def test_rollback_target_skips_the_checkpoints_a_resume_left_above_it():
    """An earlier run saved every step 1..10; this one resumed checkpoint 3 (trainer.resume_mode=resume_path)
    and saves every 5th step. The checkpoints above 3 hold that run's later weights, a branch the user
    left: a rollback loads checkpoint 3 or an earlier one, or one this run wrote since."""
    guard = KLGuard(KLGuardConfig(explode_action="rollback"))  # its state as checkpoint 3 had it
    guard.note_resume(3, list(range(1, 11)))
    assert guard.stale_steps == [4, 5, 6, 7, 8, 9, 10]
    assert guard.rollback_target(list(range(1, 11)), 6, 6) == 3  # (the bound is 4: not the stale 4)
    guard.note_checkpoint(5)  # written by this run at step 5, over the earlier run's
    assert guard.stale_steps == [4, 6, 7, 8, 9, 10]
    for step in (8, 9):  # bounds 6 and 7: the stale 6 and 7 are never picked, this run's 5 is
        assert guard.rollback_target(list(range(1, 11)), step, step) == 5
    assert guard.rollback_target([1, 2, 3, 4], 6, 6) == 3
    # The record survives a resume from this run's checkpoint 5, which adds whatever lies above it then (a
    # later checkpoint of this run's that a resume from 5 leaves, as the earlier run's): 4 stays stale.
    resumed = KLGuard(KLGuardConfig(explode_action="rollback"))
    resumed.load_state_dict(guard.state_dict())
    resumed.note_resume(5, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert resumed.stale_steps == [4, 6, 7, 8, 9, 10]
    assert resumed.rollback_target([1, 2, 3, 4, 5], 7, 7) == 5 and resumed.rollback_target([1, 4], 7, 7) == 1
    # with a rollback's record too: both kinds of abandoned checkpoint are skipped
    resumed.note_checkpoint(6)
    resumed.record_rollback(3, 7)  # checkpoints 4..6 abandoned by the rollback
    assert [s for s in range(1, 11) if resumed.abandoned(s)] == [4, 5, 6, 7, 8, 9, 10]
    # a state written before the record existed: no stale checkpoint known
    older = {k: v for k, v in guard.state_dict().items() if k != "stale_steps"}
    resumed.load_state_dict(older)
    assert resumed.stale_steps == []
