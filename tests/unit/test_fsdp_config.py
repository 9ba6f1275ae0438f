"""The roles' `fsdp_config` options as a verl config sets them: how each model's `fsdp_size` reads
against the actor's training mesh, which every model shares."""

from __future__ import annotations

import os

import pytest

from trainer.config import PPOConfig, config_notes, validate
from trainer.configlib import ConfigError, load_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                    "demo.yaml")
FOUR_RANKS = ["algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=4",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8"]


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, FOUR_RANKS + list(overrides))


@pytest.mark.parametrize("key", ["actor_rollout_ref.ref.fsdp_config.fsdp_size", "critic.model.fsdp_config.fsdp_size"])
@pytest.mark.parametrize("size", [4, 8])
def test_a_full_shard_size_beside_a_hybrid_shard_actor_is_refused_alike(key, size):
    """verl reads an fsdp_size of at least the world size as FULL_SHARD, whether it equals the world
    (4 of 4) or exceeds it (8); beside an actor sharding over groups of 2 (HYBRID_SHARD) meshppo cannot
    give the model that layout, and refuses both sizes alike, naming the key and the actor's groups.
    (8 was read as -1, the actor's groups of 2, with a start-up note saying it shards over all 4.)"""
    with pytest.raises(ConfigError) as e:
        validate(_cfg("actor_rollout_ref.actor.fsdp_config.fsdp_size=2", f"{key}={size}"), 4, 4)
    assert f"{key}={size}: every model shares the actor's training mesh, shard groups of 2 ranks" in str(e.value)
    assert "use -1 or 2" in str(e.value)


def test_a_size_above_the_world_beside_a_full_shard_actor_is_full_shard():
    """Beside a FULL_SHARD actor, the critic's 8 on 4 ranks is FULL_SHARD over the 4, and the note says so."""
    cfg = _cfg("critic.model.fsdp_config.fsdp_size=8")
    validate(cfg, 4, 4)
    assert cfg.critic.model.fsdp_config.fsdp_size == -1
    assert [n for n in config_notes(cfg) if "fsdp_size" in n] == [
        "critic.model.fsdp_config.fsdp_size=8 is more than the 4 ranks of this launch: the models shard over all 4 "
        "(FULL_SHARD), as verl does for an fsdp_size of at least the world size"]


def test_the_models_minus_one_beside_a_hybrid_shard_actor_is_said_at_start_up():
    """verl's -1 shards a model over every rank; meshppo's models share the actor's mesh, so beside an
    actor of groups of 2 on 4 ranks the reference's and critic's -1 shard over groups of 2 (twice the
    memory per GPU of verl's layout): one start-up line names the models that the run builds."""
    cfg = _cfg("actor_rollout_ref.actor.fsdp_config.fsdp_size=2")
    validate(cfg, 4, 4)
    assert [n for n in config_notes(cfg) if "fsdp_size" in n] == [
        "actor_rollout_ref.ref.fsdp_config.fsdp_size, critic.model.fsdp_config.fsdp_size=-1: every model shares the "
        "actor's training mesh, so they shard over its shard groups of 2 ranks (HYBRID_SHARD, "
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=2), where verl's -1 shards a model over all 4 ranks (FULL_SHARD)"]
    # the same groups set explicitly, a FULL_SHARD actor, or a critic the run does not build: nothing to say
    same = ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "actor_rollout_ref.ref.fsdp_config.fsdp_size=2",
            "critic.model.fsdp_config.fsdp_size=2"]
    for overrides in (same, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=4"]):
        cfg = _cfg(*overrides)
        validate(cfg, 4, 4)
        assert not [n for n in config_notes(cfg) if "fsdp_size" in n], overrides
    cfg = _cfg("actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "algorithm.adv_estimator=grpo")
    validate(cfg, 4, 4)
    assert [n for n in config_notes(cfg) if "fsdp_size" in n] == [
        "actor_rollout_ref.ref.fsdp_config.fsdp_size=-1: every model shares the actor's training mesh, so it shards "
        "over its shard groups of 2 ranks (HYBRID_SHARD, actor_rollout_ref.actor.fsdp_config.fsdp_size=2), where "
        "verl's -1 shards a model over all 4 ranks (FULL_SHARD)"]


def test_mixed_precision_null_is_verls_default():
    """verl's FSDPEngineConfig.mixed_precision defaults to None, which its engine reads as bf16 compute and
    fp32 reduction and buffers: null is the section's defaults here (it was refused as not a mapping);
    `dtype` still sets the compute dtype where mixed_precision gives none."""
    from sharding import FSDPConfig

    key = "actor_rollout_ref.actor.fsdp_config"
    fc = _cfg(f"{key}.mixed_precision=null", "actor_rollout_ref.ref.fsdp_config.mixed_precision=null",
              "actor_rollout_ref.ref.fsdp_config.dtype=float32").actor_rollout_ref
    mp = fc.actor.fsdp_config.mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == ("bf16", "fp32", "fp32")
    assert fc.ref.fsdp_config.mixed_precision.param_dtype == "float32"
    assert FSDPConfig(mixed_precision=None).mixed_precision == FSDPConfig().mixed_precision


def test_verls_numeric_dtype_spellings():
    """verl's PrecisionType reads 32 / "32" as float32 and 16 as float16: the same here (32 was refused as a dtype
    meshppo does not know), fp16 refused as its other spellings are, and a resume compares 32 and fp32 as one."""
    import dataclasses

    import torch

    from trainer.checkpointing import run_differences

    key = "actor_rollout_ref.actor.fsdp_config"
    cfg = _cfg(f"{key}.model_dtype=32", f"{key}.mixed_precision.param_dtype='32'")
    fc = cfg.actor_rollout_ref.actor.fsdp_config
    assert (fc.model_torch_dtype, fc.param_torch_dtype) == (torch.float32, torch.float32)
    with pytest.raises(ConfigError, match="fp16 needs loss scaling"):
        _cfg(f"{key}.mixed_precision.param_dtype=16")
    assert run_differences(dataclasses.asdict(_cfg(f"{key}.model_dtype=fp32")), dataclasses.asdict(cfg)) == []


@pytest.mark.parametrize("value", ["true", "1.5", "-1", "'100'"])
def test_min_num_params_must_be_a_count(value):
    """wrap_policy is a free mapping, so its count is checked by the section: a flag or a fraction is
    refused naming the key (true was taken as the count 1)."""
    with pytest.raises(ConfigError, match=r"fsdp_config.wrap_policy.min_num_params must be a non-negative integer"):
        _cfg(f"actor_rollout_ref.actor.fsdp_config.wrap_policy={{min_num_params: {value}}}")


def test_the_frozen_models_run_forwards_only():
    """The reference and the reward model are frozen forwards: forward_only=true is what they do (the
    reward model's was refused, its help saying that the actor and the critic train); false is refused
    for both, and true for the trained actor and critic."""
    rm = ["reward_model.enable=true", "reward_model.model.path=/x"]
    cfg = _cfg(*rm, "reward_model.model.fsdp_config.forward_only=true")
    assert cfg.reward_model.model.fsdp_config.forward_only
    for key, overrides in (("reward_model.model", rm), ("actor_rollout_ref.ref", [])):
        with pytest.raises(ConfigError, match=f"{key}.fsdp_config.forward_only=false is not supported"):
            _cfg(*overrides, f"{key}.fsdp_config.forward_only=false")
    for key in ("actor_rollout_ref.actor", "critic.model"):
        with pytest.raises(ConfigError, match=f"{key}.fsdp_config.forward_only=true is not supported"):
            _cfg(f"{key}.fsdp_config.forward_only=true")
