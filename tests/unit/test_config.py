"""The config system: strict keys, types, choices, unsupported verl options, cross checks, CLI."""

import os
import subprocess
import sys

import pytest

from ppo.config import PPOConfig, validate
from ppo.configlib import ConfigError, build_dataclass, iter_options, load_config, parse_override, to_commented_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def test_demo_config_loads_and_validates():
    cfg = _cfg()
    validate(cfg, 2)
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.uses_ref and not cfg.uses_critic


def test_dotted_override_types():
    cfg = _cfg("trainer.total_training_steps=7", "actor_rollout_ref.actor.optim.lr=3e-5",
               "trainer.logger=[console]", "actor_rollout_ref.rollout.top_k=5")
    assert cfg.trainer.total_training_steps == 7
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.trainer.logger == ["console"]
    assert cfg.actor_rollout_ref.rollout.top_k == 5


@pytest.mark.parametrize("override,message", [
    ("actor_rollout_ref.actor.ppo_mini_batchsize=4", "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'"),
    ("trainer.total_epoch=3", "did you mean 'trainer.total_epochs'"),
    ("algorithm.kl_ctrl.kl_coeff=0.1", "did you mean 'algorithm.kl_ctrl.kl_coef'"),
    ("trainer.total_training_steps=abc", "trainer.total_training_steps: expected an integer"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "expected true or false"),
    ("actor_rollout_ref.rollout.name=vllm", "'vllm' is not one of ['native', 'hf']"),
    ("algorithm.adv_estimator=ppo2", "is not one of"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "not supported"),
    ("actor_rollout_ref.model.lora_rank=8", "not supported"),
    ("actor_rollout_ref.actor.fsdp_config.wrap_policy={foo: 1}", "not supported"),
    ("noequals", "must look like dotted.key=value"),
])
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides,world,message", [
    (["data.train_batch_size=30"], 2, "must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], 2, "must divide the world size"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=48"], 2, "multiple of"),
    (["actor_rollout_ref.rollout.n=1"], 2, "needs groups"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], 2, "clip_ratio_c must be > 1"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=33",
      "actor_rollout_ref.rollout.n=2"], 4, "must split evenly over 4 ranks"),
    (["reward_model.enable=true"], 2, "needs reward_model.path"),
])
def test_impossible_combinations(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(*overrides), world)
    assert message in str(e.value)


def test_every_option_is_documented():
    missing = [key for key, _, _, help_ in iter_options(PPOConfig) if not help_]
    assert not missing, f"options without a help line: {missing}"


def test_commented_yaml_round_trips():
    import yaml

    cfg = _cfg("trainer.total_training_steps=3")
    text = to_commented_yaml(cfg)
    again = build_dataclass(PPOConfig, yaml.safe_load(text))
    assert again == cfg


def test_parse_override_yaml_values():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_print_config_exits_zero():
    r = _cli("--config", DEMO, "--print-config")
    assert r.returncode == 0, r.stderr
    assert "adv_estimator: grpo" in r.stdout
    assert "# advantage estimator" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["trainer.total_epoch=2"], "did you mean 'trainer.total_epochs'"),
    (["data.train_batch_size=30"], "must be a multiple of"),
])
def test_cli_user_errors_have_no_traceback(args, message):
    r = _cli("--config", DEMO, "--print-config", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    r = _cli("--config", str(bad), "--print-config")
    assert r.returncode == 2 and "is not valid YAML" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--config", str(tmp_path / "missing.yaml"), "--print-config")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_config_reference_is_current():
    from tools.config_doc import PATH, render

    with open(PATH) as f:
        assert f.read() == render(), "docs/CONFIG.md is stale: run python -m tools.config_doc"
