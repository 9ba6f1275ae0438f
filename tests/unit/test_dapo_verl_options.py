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


def test_dynamic_sampling_with_greedy_groups_is_refused():
    """Greedy decoding gives a prompt n identical responses: no group's metric varies, every prompt is
    dropped and the rounds never fill a step. Refused before any work (gae: the group estimators refuse
    greedy groups on their own)."""
    import os

    import pytest

    from trainer.config import validate
    from trainer.configlib import ConfigError

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "demo.yaml")
    base = ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=1"]
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.enable=true with actor_rollout_ref.rollout."
                                          r"temperature=0, which decodes greedily: the 8 responses"):
        validate(load_config(PPOConfig, demo, base + ["actor_rollout_ref.rollout.temperature=0"]), 1, 1)
    validate(load_config(PPOConfig, demo, base), 1, 1)  # sampling (the demo's n=8, temperature 1)
    # groups of one (kept whatever the decoding)
    validate(load_config(PPOConfig, demo, base + ["actor_rollout_ref.rollout.n=1", "data.train_batch_size=64",
                                                  "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                                                  "actor_rollout_ref.rollout.temperature=0"]), 1, 1)
