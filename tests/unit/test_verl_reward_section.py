"""verl 0.9.1's `reward` section: the newer names of the reward function, manager, model switch and path
reach meshppo's reward settings exactly as the older names do (one setting each: different values are
an error naming both); its reward-model server's options, sandbox and worker count are said to change
nothing, refused, or (full_determinism) act; the older places' nulls, as 0.9.1 writes them, load."""

import dataclasses
import os

import pytest

from trainer.config import PPOConfig, config_notes, full_determinism_sections, validate
from trainer.configlib import ConfigError, build_dataclass, load_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                    "demo.yaml")
RR = "reward.reward_model.rollout"
RM_ON = ["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=8"]
SERVER = "has no effect: meshppo runs the reward model as an FSDP2 forward on the training ranks, with no inference " \
         "server"


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _round_trips(cfg):
    return dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


# (older name, verl 0.9.1's name, a value other than the default)
PAIRS = [
    ("custom_reward_function.path", "reward.custom_reward_function.path", "rewards/arith.py"),
    ("custom_reward_function.name", "reward.custom_reward_function.name", "my_score"),
    ("custom_reward_function.reward_kwargs", "reward.custom_reward_function.reward_kwargs", "{scale: 2}"),
    ("reward_model.reward_manager", "reward.reward_manager.name", "prime"),
    ("reward_model.enable", "reward.reward_model.enable", "true"),
    ("reward_model.model.path", "reward.reward_model.model_path", "/rm"),
    ("reward_model.reward_kwargs", "reward.reward_kwargs", "{max_resp_len: 6}"),
]


def test_the_newer_names_give_the_same_resolved_settings_as_the_older():
    """A 0.9.1 config with only the reward section's names resolves to the config of the older names: the
    whole resolved tree is the same (the newer names end null, the values at the older names, which the
    trainer reads), it validates the same and says the same at start-up."""
    old = [f"{o}={v}" for o, _, v in PAIRS] + ["reward_model.reward_manager=dapo", "reward_model.micro_batch_size_per_gpu=8"]
    new = [f"{n}={v}" for _, n, v in PAIRS] + ["reward.reward_manager.name=dapo", "reward_model.micro_batch_size_per_gpu=8"]
    old, new = old[:3] + old[4:], new[:3] + new[4:]  # dapo, which takes reward_kwargs, not prime
    a, b = _cfg(*old), _cfg(*new)
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    fn, rm = b.custom_reward_function, b.reward_model
    assert (fn.path, fn.name, fn.reward_kwargs) == ("rewards/arith.py", "my_score", {"scale": 2})
    assert (rm.reward_manager, rm.enable, rm.model.path, rm.reward_kwargs) == ("dapo", True, "/rm", {"max_resp_len": 6})
    assert rm.manager_kwargs() == {"max_resp_len": 6, "overlong_buffer_cfg": None}
    reward = b.reward
    assert (reward.custom_reward_function.path, reward.custom_reward_function.name, reward.reward_manager.name,
            reward.reward_model.enable, reward.reward_model.model_path, reward.reward_kwargs) == (None,) * 6
    assert _round_trips(b)
    validate(a), validate(b)
    # the same notes, each naming the option as the user set it
    named = "custom_reward_function.path=rewards/arith.py is not used"
    assert named in config_notes(a)[0] and f"reward.{named}" in config_notes(b)[0]
    assert [n.replace(f"reward.{named}", named) for n in config_notes(b)] == config_notes(a)
    # neither set: verl's defaults, as before
    plain = _cfg()
    assert (plain.custom_reward_function.name, plain.custom_reward_function.reward_kwargs, plain.reward_model.enable,
            plain.reward_model.reward_manager, plain.reward_model.reward_kwargs) == ("compute_score", {}, False, "naive", {})


@pytest.mark.parametrize("old, new, value", PAIRS)
def test_both_names_set_alike_load_and_differently_are_refused_naming_both(old, new, value):
    dapo = ["reward_model.reward_manager=dapo"] if old == "reward_model.reward_kwargs" else []  # (takes max_resp_len)
    assert dataclasses.asdict(_cfg(*dapo, f"{old}={value}", f"{new}={value}")) == \
        dataclasses.asdict(_cfg(*dapo, f"{old}={value}"))
    other = {"rewards/arith.py": "x.py", "my_score": "fn", "{scale: 2}": "{scale: 3}", "prime": "batch",
             "true": "false", "/rm": "/rm2", "{max_resp_len: 6}": "{max_resp_len: 7}"}[value]
    with pytest.raises(ConfigError, match=rf"^{old}=.* and {new}=.*: both name the same setting; set one of them, "
                                          "or both the same$"):
        _cfg(*dapo, f"{old}={value}", f"{new}={other}")


def test_three_names_of_the_reward_manager():
    """verl's older top-level reward_manager.name is a third name of the manager."""
    assert _cfg("reward_manager.name=batch", "reward.reward_manager.name=batch").reward_model.reward_manager == "batch"
    with pytest.raises(ConfigError, match=r"^reward_model.reward_manager=dapo and reward_manager.name=batch and "
                                          r"reward.reward_manager.name=prime: each names the same setting; set one of "
                                          "them, or all the same$"):
        _cfg("reward_model.reward_manager=dapo", "reward_manager.name=batch", "reward.reward_manager.name=prime")


def test_verl_091s_nulls_at_the_older_places_load_as_its_defaults():
    """0.9.1 keeps the older names null (its legacy_reward_impl): they load, and mean verl's defaults."""
    nulls = ["custom_reward_function.path=null", "custom_reward_function.name=null",
             *(f"reward_model.{k}=null" for k in ("num_workers", "reward_manager", "enable", "enable_resource_pool",
                                                  "n_gpus_per_node", "nnodes", "reward_loop_source",
                                                  "reward_loop_module_path", "reward_loop_class_name")),
             "reward_model.model.path=null", "reward_model.model.external_lib=null",
             "reward_model.model.trust_remote_code=null", "reward_model.rollout={name: null, dtype: null}",
             "sandbox_fusion={url: null, max_concurrent: null, memory_limit_mb: null}"]
    cfg = _cfg(*nulls)
    assert dataclasses.asdict(cfg) == dataclasses.asdict(_cfg()) and config_notes(cfg) == []


@pytest.mark.parametrize("override, why", [
    ("reward.reward_model.enable_resource_pool=true", None),
    ("reward.reward_manager.source=importlib", None),
    ("reward.sandbox_fusion.url=http://sandbox", None),
    ("sandbox_fusion.url=http://sandbox", None),
    (f"{RR}.dtype=float16", None),
    (f"{RR}.load_format=dummy", None),
    (f"{RR}.skip_tokenizer_init=true", None),
    (f"{RR}.quantization=fp8", None),
    (f"{RR}.quantization_config_file=q.json", None),
    (f"{RR}.disaggregation.enabled=true", None),
    (f"{RR}.mtp.enable=true", None),
    # the older server keys are checked by their own names as they move
    ("+reward_model.rollout.quantization=fp8", "reward_model.rollout.quantization"),
])
def test_what_would_change_the_scores_is_refused_naming_the_key(override, why):
    key = why or override.lstrip("+").split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"^{key}=.* is not supported by meshppo(:| \(|$)"):
        _cfg(override)


@pytest.mark.parametrize("override, note", [
    ("reward.num_workers=4", "reward.num_workers=4 has no effect: meshppo scores on every training rank, without "
                             "reward-loop workers"),
    ("reward.reward_model.n_gpus_per_node=4", "reward.reward_model.n_gpus_per_node=4 has no effect: read only with "
                                              "enable_resource_pool, which meshppo does not support"),
    ("reward.reward_model.nnodes=1", "reward.reward_model.nnodes=1 has no effect: read only with enable_resource_pool, "
                                     "which meshppo does not support"),
    ("reward.sandbox_fusion.max_concurrent=8", "reward.sandbox_fusion.max_concurrent=8 has no effect: read only with "
                                               "url"),
    ("sandbox_fusion.memory_limit_mb=512", "sandbox_fusion.memory_limit_mb=512 has no effect: read only with url"),
    ("reward.reward_manager.module.path=m.py", "reward.reward_manager.module.path=m.py has no effect: read only with "
                                               "source importlib"),
    *((f"{RR}.{k}={v}", f"{RR}.{k}={v} {SERVER}") for k, v in (
        ("name", "vllm"), ("gpu_memory_utilization", "0.8"), ("enforce_eager", "false"), ("free_cache_engine", "false"),
        ("tensor_model_parallel_size", "1"), ("data_parallel_size", "2"), ("max_num_seqs", "64"),
        ("load_format", "safetensors"), ("scheduling_policy", "priority"), ("enable_prefix_caching", "false"))),
    (f"{RR}.max_num_batched_tokens=4096", f"{RR}.max_num_batched_tokens=4096 {SERVER}; "
                                          "reward_model.micro_batch_size_per_gpu or use_dynamic_bsz batch its forwards"),
    (f"{RR}.prompt_length=4096", f"{RR}.prompt_length=4096 {SERVER}; the reward model reads each rendered chat whole, "
                                 "or cut at reward_model.max_length"),
    (f"{RR}.temperature=0.7", f"{RR}.temperature=0.7 has no effect: verl samples with it where a custom reward "
                              "function asks the reward model's server to generate (a generative reward model); "
                              "meshppo runs no such server"),
    (f"{RR}.seed=1", f"{RR}.seed=1 has no effect: the reward model's forward draws nothing"),
    (f"{RR}.disaggregation.prefill_replicas=2", f"{RR}.disaggregation.prefill_replicas=2 has no effect: read only "
                                                "with disaggregation.enabled, which meshppo does not support"),
])
def test_what_changes_nothing_is_said_at_start_up(override, note):
    cfg = _cfg(*RM_ON, override)
    validate(cfg)
    assert note in config_notes(cfg), config_notes(cfg)
    assert _round_trips(cfg)


def test_verls_server_must_be_named_value_loads_as_unset():
    """0.9.1's default leaves the reward-model server's engine ??? (read only when it serves): meshppo
    never reads it, so it loads, as null; the actor's rollout name, which meshppo reads, stays required."""
    cfg = _cfg(f"{RR}.name=???")
    assert cfg.reward.reward_model.rollout.name is None and config_notes(cfg) == []
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name is \?\?\?"):
        _cfg("actor_rollout_ref.rollout.name=???")


def test_the_older_server_keys_are_checked_as_the_newer():
    """reward_model.rollout, the server's place before 0.9.1 (whose trainer reads reward.reward_model.rollout
    only): its keys are checked as the newer section's (refused above), and otherwise change nothing,
    full_determinism included (verl 0.9.1's trainer does not read it there either)."""
    cfg = _cfg(*RM_ON, "+reward_model.rollout.name=vllm", "+reward_model.rollout.full_determinism=true")
    assert cfg.reward_model.rollout == {"name": "vllm", "full_determinism": True} and _round_trips(cfg)
    assert not any(s.full_determinism for s in full_determinism_sections(cfg).values())
    assert "reward_model.rollout={name: vllm, full_determinism: true} has no effect: meshppo runs the reward " \
           "model as an FSDP2 forward on the training ranks" in config_notes(cfg)
    with pytest.raises(ConfigError, match=r"^unknown config key 'reward_model.rollout.nam'; did you mean "
                                          "'reward_model.rollout.name'"):
        _cfg("+reward_model.rollout.nam=vllm")


def test_the_servers_full_determinism_acts_with_a_reward_model():
    """verl turns on full determinism for its reward-model server's switch when the reward model is on:
    here the process's one switch (trainer.ppo_trainer reads full_determinism_sections), said to cover
    the roles; without a reward model it is not read."""
    on = _cfg(*RM_ON, f"{RR}.full_determinism=true")
    assert any(s.full_determinism for s in full_determinism_sections(on).values())
    assert f"{RR}.full_determinism=true makes every role deterministic: the roles share their processes (also " \
           "actor_rollout_ref.actor.fsdp_config, actor_rollout_ref.ref.fsdp_config, " \
           "reward_model.model.fsdp_config)" in config_notes(on)
    off = _cfg(f"{RR}.full_determinism=true")
    assert not any(s.full_determinism for s in full_determinism_sections(off).values())


def test_a_reward_function_the_reward_model_replaces_is_said_unused():
    """With a reward model and combine=replace, the function is not called (verl's legacy worker); verl
    0.9.1 would score with the function alone: the note says both, and combine=add."""
    cfg = _cfg(*RM_ON, "reward.custom_reward_function.path=rewards/arith.py")
    assert [n for n in config_notes(cfg) if "custom_reward_function" in n] == [
        "reward.custom_reward_function.path=rewards/arith.py is not used: the reward model replaces the rule reward "
        "(reward_model.combine=replace, as verl's legacy reward-model worker does); verl 0.9.1's reward loop scores "
        "with the function alone when both are set, letting it call the reward model's inference server, which "
        "meshppo does not run; reward_model.combine=add adds the model's score to the function's"]
    assert not [n for n in config_notes(_cfg(*RM_ON, "reward.custom_reward_function.path=rewards/arith.py",
                                             "reward_model.combine=add")) if "custom_reward_function" in n]


def test_a_reward_model_without_a_path_names_both_keys():
    with pytest.raises(ConfigError, match=r"reward_model.enable=true needs reward_model.model.path \(verl 0.9.1's "
                                          r"name: reward.reward_model.model_path\)"):
        validate(_cfg("reward.reward_model.enable=true"))


def test_verls_gdpo_recipe_line_loads():
    """verl's gdpo example sets reward.reward_manager.name=gdpo with adv_estimator=gdpo: it loads, validates
    and names the gdpo manager (refused before: 'gdpo' was not one of the managers)."""
    cfg = _cfg("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "reward.reward_manager.name=gdpo")
    validate(cfg)
    assert cfg.reward_model.reward_manager == "gdpo"


def test_the_reward_servers_full_determinism_without_a_reward_model_is_noted():
    """reward.reward_model.rollout.full_determinism acts only with a reward model (as verl reads it); set
    without one it was silently ignored (review)."""
    note = ("reward.reward_model.rollout.full_determinism=true has no effect: reward_model.enable is false (it makes "
            "the reward model's scores deterministic)")
    assert note in config_notes(_cfg(f"{RR}.full_determinism=true"))
    assert not any(n.startswith("reward.reward_model.rollout.full_determinism") for n in config_notes(_cfg()))
