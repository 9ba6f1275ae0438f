"""`algorithm.adv_estimator=optimal_token_baseline` through the trainer (2 CPU ranks, gloo, fp32):
the old-log-prob pass runs though the update is on-policy, its sums of squared probabilities
equal a float64 softmax of the actor's full logits at the rollout temperature, and the
advantages equal verl's per-group loops over the whole batch (with the rollout importance
weights in the second run), as do verl's variance_proxy/* metrics. Config errors: the estimator without calculate_sum_pi_squared,
and with bypass mode."""

import os

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import DENSE_REWARD, ROOT, _config

RUNS = {
    # on-policy (one mini-batch, one epoch, no engine log-probs): the pass would be skipped without OTB
    "on_policy": ["actor_rollout_ref.rollout.calculate_log_probs=false"],
    "token_is": ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.5"],
}


def _otb_body(rank, world_size, assets, run_root):
    from tests.unit.test_optimal_token_baseline import _reference
    from trainer.forward import _scatter
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    for name, extra in RUNS.items():
        trainer = PPOTrainer(_config(assets, run_root, name, "algorithm.adv_estimator=optimal_token_baseline",
                                     "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=false",
                                     "actor_rollout_ref.actor.calculate_sum_pi_squared=true", *extra), ctx)
        if name == "on_policy":
            assert trainer._on_policy_update()
        seen = {}
        compute = trainer._compute_advantages

        def checked(full, ro, parts, metrics, baselines):
            # the actor's full logits before the update, in float64
            mb = trainer.actor._micro_batch(ro)
            with torch.no_grad():
                logits = trainer.actor.model(mb.input_ids, **mb.model_kwargs()).double() / trainer.actor.temperature
            log_p = torch.log_softmax(logits, -1)
            want_sps = _scatter(mb, log_p.exp().pow(2).sum(-1), ro.width)
            want_logp = _scatter(mb, log_p.gather(-1, mb.labels[..., None]).squeeze(-1), ro.width)
            mask = ro.response_mask.bool()
            assert mask.any()
            torch.testing.assert_close(ro.sum_pi_squared[mask].double(), want_sps[mask], rtol=1e-4, atol=0)
            torch.testing.assert_close(ro.old_log_probs[mask].double(), want_logp[mask], rtol=0, atol=1e-4)
            compute(full, ro, parts, metrics, baselines)
            gather = lambda t: trainer._gather_rows(t, parts, len(full)).double()  # noqa: E731
            weights = gather(ro.rollout_is_weights) if ro.rollout_is_weights is not None else None
            assert (weights is not None) == (name == "token_is")
            seen["want"] = _reference(gather(ro.token_level_rewards), full.loss_mask.long(), np.asarray(full.uids),
                                      gather(ro.old_log_probs), gather(ro.sum_pi_squared), weights,
                                      handle_zero_tail=True, tir=False)[0]
            seen["got"] = gather(ro.advantages)
            seen["proxies"] = _variance_proxies(full.loss_mask, gather(ro.old_log_probs), gather(ro.sum_pi_squared),
                                                weights, seen["got"])

        trainer._compute_advantages = checked
        metrics = trainer.step()
        torch.testing.assert_close(seen["got"], seen["want"], rtol=1e-5, atol=1e-6)
        assert seen["want"].abs().sum() > 0
        a2, w, power = seen["proxies"]
        noise = max(0.0, (power - metrics["actor/grad_norm"] ** 2) / (len(seen["got"]) - 1))
        for key, want in (("expected_a_squared", a2), ("expected_w", w), ("proxy2_total_power", power),
                          ("proxy1_signal_strength", metrics["actor/grad_norm"] ** 2), ("proxy3_pure_noise", noise)):
            assert abs(metrics[f"variance_proxy/{key}"] - want) <= 1e-6 * max(1.0, abs(want)), (key, want)
        assert a2 > 0 and w > 0


def _variance_proxies(mask, old_log_probs, sum_pi_squared, weights, advantages):
    """verl's compute_variance_proxy_metrics as loops over the responses: the means of A^2, W and
    (rho^2) A^2 max(W, 0) over the batch."""
    a2 = w_total = power = 0.0
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[i, t]]
        a = sum(advantages[i, t].item() for t in cols) / max(len(cols), 1)
        w = [1 - 2 * old_log_probs[i, t].exp().item() + sum_pi_squared[i, t].item() for t in cols]
        if weights is None:
            w_row = sum(w)
            power += a * a * max(w_row, 0.0)
        else:
            rho = [weights[i, t].item() for t in cols]
            w_row = sum(x * r * r for x, r in zip(w, rho))
            power += (sum(rho) / max(len(cols), 1)) ** 2 * a * a * max(sum(w), 0.0)
        a2, w_total = a2 + a * a, w_total + w_row
    n = mask.shape[0]
    return a2 / n, w_total / n, power / n


def test_optimal_token_baseline_trainer(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_otb_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


@pytest.mark.parametrize("adv", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_config_errors(adv):
    from trainer.config import PPOConfig, validate
    from trainer.configlib import ConfigError, load_config

    demo = os.path.join(ROOT, "configs", "demo.yaml")
    with pytest.raises(ConfigError, match=f"adv_estimator={adv} needs .*actor_rollout_ref.actor.calculate_sum_pi_"):
        validate(load_config(PPOConfig, demo, [f"algorithm.adv_estimator={adv}"]))
    with pytest.raises(ConfigError, match="bypass_mode=true: bypass mode skips the actor's old-log-prob pass"):
        validate(load_config(PPOConfig, demo, [f"algorithm.adv_estimator={adv}",
                                               "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                                               "algorithm.rollout_correction.bypass_mode=true"]))
    validate(load_config(PPOConfig, demo, [f"algorithm.adv_estimator={adv}",
                                           "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]))


def test_sum_pi_squared_notes():
    from trainer.config import PPOConfig, config_notes
    from trainer.configlib import load_config

    demo = os.path.join(ROOT, "configs", "demo.yaml")
    notes = config_notes(load_config(PPOConfig, demo, ["actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                                                       "algorithm.rollout_correction.bypass_mode=true",
                                                       "actor_rollout_ref.actor.sum_pi_squared_checkpointing=true"]))
    assert any(n.startswith("actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect with algorithm."
                            "rollout_correction.bypass_mode=true") for n in notes), notes
    assert any(n.startswith("actor_rollout_ref.actor.sum_pi_squared_checkpointing=true has no effect: meshppo "
                            "computes it in the forward-only") for n in notes), notes
    assert not any("sum_pi_squared" in n for n in config_notes(load_config(
        PPOConfig, demo, ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"])))
