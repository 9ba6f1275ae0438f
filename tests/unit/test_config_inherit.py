"""Options that default to the actor's value, as in verl (`${oc.select:actor_rollout_ref.actor.X,...}`):
unset, they take the actor's (non-default) value in `PPOConfig.resolve`; set, they keep their own."""

import dataclasses
import os

import pytest

from trainer.config import PPOConfig, validate
from trainer.configlib import load_config, to_commented_yaml
from trainer.roles import MicroBatching, plan_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
ACTOR = "actor_rollout_ref.actor"


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _get(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


# (inheriting option, the option it inherits from, a non-default value of that source, an explicit value)
INHERITED = [
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz", True, False),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu", 1024, 4096),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz", True, False),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu", 1024, 4096),
    ("critic.use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz", True, False),
    ("critic.loss_agg_mode", f"{ACTOR}.loss_agg_mode", "seq-mean-token-mean", "token-mean"),
    ("critic.shuffle", f"{ACTOR}.shuffle", True, False),
    ("critic.forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu", 2048, 4096),
]
IDS = [key for key, *_ in INHERITED]


def _fmt(value):
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("key,source,value,explicit", INHERITED, ids=IDS)
def test_unset_option_takes_the_source_value(key, source, value, explicit):
    assert _get(_cfg(), source) != value  # the source value used is not its default
    cfg = _cfg(f"{source}={_fmt(value)}")
    assert _get(cfg, key) == value
    # null written out means the same as leaving it unset
    assert _get(_cfg(f"{source}={_fmt(value)}", f"{key}=null"), key) == value


@pytest.mark.parametrize("key,source,value,explicit", INHERITED, ids=IDS)
def test_explicit_option_wins_over_the_source(key, source, value, explicit):
    assert explicit != value
    cfg = _cfg(f"{source}={_fmt(value)}", f"{key}={_fmt(explicit)}")
    assert _get(cfg, key) == explicit
    assert _get(cfg, source) == value


def test_defaults_without_overrides_match_verl():
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    for sec in (arr.rollout, arr.ref):
        assert sec.log_prob_use_dynamic_bsz is False
        assert sec.log_prob_max_token_len_per_gpu == 16384
    c = cfg.critic
    assert (c.use_dynamic_bsz, c.shuffle, c.loss_agg_mode) == (False, False, "token-mean")
    assert c.forward_max_token_len_per_gpu == c.ppo_max_token_len_per_gpu == 32768


def test_resolve_is_idempotent_and_printed_config_is_resolved():
    cfg = _cfg(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=1024",
               f"{ACTOR}.loss_agg_mode=seq-mean-token-sum", f"{ACTOR}.shuffle=true")
    before = dataclasses.asdict(cfg)
    cfg.resolve()
    assert dataclasses.asdict(cfg) == before
    text = to_commented_yaml(cfg)
    assert "log_prob_max_token_len_per_gpu: 1024" in text
    assert "loss_agg_mode: seq-mean-token-sum" in text
    assert "log_prob_use_dynamic_bsz: null" not in text and "loss_agg_mode: null" not in text


def _log_prob_batchings(cfg):
    """The `MicroBatching`s trainer/ppo_trainer.py builds for the old-log-prob, reference and value forwards."""
    lp, rc, cc = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    return {"old_log_prob": MicroBatching(lp.log_prob_micro_batch_size_per_gpu, lp.log_prob_use_dynamic_bsz,
                                          lp.log_prob_max_token_len_per_gpu),
            "ref": MicroBatching(rc.log_prob_micro_batch_size_per_gpu, rc.log_prob_use_dynamic_bsz,
                                 rc.log_prob_max_token_len_per_gpu),
            "critic": MicroBatching(cc.forward_micro_batch_size_per_gpu, cc.use_dynamic_bsz,
                                    cc.forward_max_token_len_per_gpu)}


def test_dynamic_actor_plans_log_prob_forwards_under_its_token_budget():
    # actor.use_dynamic_bsz with no micro-batch size: validate() accepts it, and the forward-only
    # passes must not fall back to one micro-batch of every local row
    cfg = _cfg("algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
               f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_micro_batch_size_per_gpu=null",
               f"{ACTOR}.ppo_max_token_len_per_gpu=1024", "critic.ppo_max_token_len_per_gpu=2048")
    validate(cfg)
    batchings = _log_prob_batchings(cfg)
    assert batchings["old_log_prob"] == MicroBatching(None, True, 1024)
    assert batchings["ref"] == MicroBatching(None, True, 1024)
    assert batchings["critic"] == MicroBatching(None, True, 2048)
    rows, length = 512, 200
    for name, budget in (("old_log_prob", 1024), ("ref", 1024), ("critic", 2048)):
        plan = plan_micro_batches(list(range(rows)), [length] * rows, *batchings[name])
        assert sorted(i for part in plan for i in part) == list(range(rows)), name
        assert max(len(part) for part in plan) * length <= budget, name
        assert len(plan) >= rows * length // budget, name


def test_explicit_log_prob_batching_still_wins_with_a_dynamic_actor():
    cfg = _cfg(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=1024",
               "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192")
    batchings = _log_prob_batchings(cfg)
    assert batchings["old_log_prob"] == MicroBatching(8, False, 1024)
    assert batchings["ref"] == MicroBatching(8, True, 8192)
