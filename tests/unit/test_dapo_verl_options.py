"""Options of DAPO's dynamic sampling and PF-PPO that a run would not read are said at start-up."""

from trainer.config import PPOConfig, config_notes
from trainer.configlib import load_config

GAE = ("algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true")


def _notes(text, *overrides):
    return [n for n in config_notes(load_config(PPOConfig, None, list(overrides))) if text in n]


def test_pf_ppo_weight_pow_outside_the_pow_method_is_noted():
    for method in ("max_min", "max_random"):
        assert _notes("weight_pow", *GAE, f"algorithm.pf_ppo.reweight_method={method}",
                      "algorithm.pf_ppo.weight_pow=3") == [
            f"algorithm.pf_ppo.weight_pow=3.0 has no effect: algorithm.pf_ppo.reweight_method={method} (it is the "
            "pow method's power)"]
        assert _notes("weight_pow", *GAE, f"algorithm.pf_ppo.reweight_method={method}") == []
    assert _notes("weight_pow", *GAE, "algorithm.pf_ppo.weight_pow=3") == []  # pow reads it


def test_dynamic_sampling_of_groups_of_one_is_noted():
    fg = ("algorithm.filter_groups.enable=true", "algorithm.adv_estimator=gae")
    assert _notes("filter_groups.enable", *fg, "actor_rollout_ref.rollout.n=1") == [
        "algorithm.filter_groups.enable=true has no effect with actor_rollout_ref.rollout.n=1: each prompt's group is "
        "its one response, and a group of one is always kept (as in verl)"]
    assert _notes("filter_groups.enable", *fg, "actor_rollout_ref.rollout.n=2") == []
    assert _notes("filter_groups.enable", "actor_rollout_ref.rollout.n=1") == []
