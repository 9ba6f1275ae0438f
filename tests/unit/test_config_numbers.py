"""Numbers with an exponent (`1e-2`, `1E5`, `-3e+2`, `1.5e3`) read as floats, as OmegaConf (verl)
reads them, wherever meshppo reads YAML: config files, command-line overrides, the free-form
mapping options that reach user code, and the tool and interaction config files. YAML 1.1 (plain
PyYAML) reads them as text. Text that merely looks like a number stays text."""

import pytest

from agent.interactions import load_interactions
from agent.tools import BaseTool, load_tools
from trainer.config import PPOConfig
from trainer.configlib import load_config, load_yaml_text, parse_override


class KeepsConfig(BaseTool):
    """A tool that keeps the config its file gives it."""


def _load(tmp_path, text, *overrides):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(PPOConfig, path, ["actor_rollout_ref.model.path=/models/actor", *overrides])


@pytest.mark.parametrize("text, value", [("1e-2", 0.01), ("1E5", 100000.0), ("-3e+2", -300.0), ("1.5e3", 1500.0),
                                         ("+2e0", 2.0), ("1_000e3", 1e6)])
def test_a_number_with_an_exponent_is_a_float(text, value):
    assert load_yaml_text(f"x: {text}") == {"x": value} and isinstance(load_yaml_text(text), float)
    assert parse_override(f"custom_reward_function.reward_kwargs={{x: {text}}}", PPOConfig)[1] == {"x": value}


@pytest.mark.parametrize("text", ["1e2x", "1.2.3", "e5", "1e", "1_e3", ".5e3", "'1e-2'"])
def test_text_that_looks_like_such_a_number_stays_text(text):
    assert load_yaml_text(f"x: {text}") == {"x": text.strip("'")}


def test_free_form_options_get_floats_from_a_file_and_from_overrides(tmp_path):
    text = """
custom_reward_function:
  reward_kwargs: {x: 1e-2, tag: 1e2x, version: 1.2.3}
reward_model:
  reward_manager: batch
  reward_kwargs: {scale: 1E5}
data:
  apply_chat_template_kwargs: {temperature_hint: -3e+2}
actor_rollout_ref:
  actor:
    optim: {lr: 3e-5}
"""
    cfg = _load(tmp_path, text)
    assert cfg.custom_reward_function.reward_kwargs == {"x": 0.01, "tag": "1e2x", "version": "1.2.3"}
    assert cfg.reward_model.reward_kwargs == {"scale": 100000.0}
    assert cfg.data.apply_chat_template_kwargs == {"temperature_hint": -300.0}
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-5, rel=1e-12)
    over = _load(tmp_path, "{}", "custom_reward_function.reward_kwargs={x: 1e-2}", "+reward_model.reward_kwargs.y=2e-3",
                 "reward_model.reward_manager=batch")
    assert over.custom_reward_function.reward_kwargs == {"x": 0.01}
    assert over.reward_model.reward_kwargs == {"y": 0.002}


def test_string_options_keep_their_text_as_written(tmp_path):
    """The rule for string options holds: their text as written, a number-looking one or a date too."""
    cfg = _load(tmp_path, "trainer:\n  experiment_name: 1e-3\n  project_name: 2025-01-01\n")
    assert (cfg.trainer.experiment_name, cfg.trainer.project_name) == ("1e-3", "2025-01-01")
    assert _load(tmp_path, "{}", "trainer.experiment_name=1E5").trainer.experiment_name == "1E5"


def test_tool_and_interaction_files_read_floats(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {__name__}.KeepsConfig\n"
                     "    config: {type: native, penalty: 1e-3, name: 1e2x}\n"
                     "    tool_schema: {type: function, function: {name: keep, description: d,\n"
                     "                  parameters: {type: object, properties: {}}}}\n")
    (tool,) = load_tools(tools)
    assert tool.config == {"type": "native", "penalty": 0.001, "name": "1e2x"}
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text("interaction:\n  - name: g\n    class_name: verl.interactions.gsm8k_interaction."
                            "Gsm8kInteraction\n    config: {threshold: 5E-1}\n")
    assert load_interactions(interactions)["g"].config["threshold"] == 0.5


def test_text_for_a_float_option_is_read_as_a_number(tmp_path, monkeypatch):
    """Quoted, or from the environment (`${oc.env:...}` gives text): a float option reads the number, as
    OmegaConf's typed float options (verl's dataclass configs) convert it."""
    monkeypatch.setenv("MESHPPO_TEST_LR", "2e-4")
    cfg = _load(tmp_path, "actor_rollout_ref:\n  actor:\n    optim: {lr: '${oc.env:MESHPPO_TEST_LR}'}\n",
                "critic.optim.lr='1e-3'")
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(2e-4, rel=1e-12)
    assert cfg.critic.optim.lr == pytest.approx(1e-3, rel=1e-12)


def test_a_dumped_config_reads_back_as_it_was(tmp_path):
    """RUN_DIR/config.yaml (`to_commented_yaml`) must load back to the same config: text that the
    loader's number rule would read as a float ('1e-3' given as a reward function's keyword) is
    written quoted, so a run resumed from its config.yaml is not refused as changed."""
    import dataclasses

    from trainer.checkpointing import run_differences
    from trainer.configlib import to_commented_yaml

    texts = {"a": "1e-3", "b": "1E5", "c": "-3e+2", "d": "2.0", "n": 1e-3}
    cfg = load_config(PPOConfig, None, [f"+custom_reward_function.reward_kwargs={texts!r}".replace("'", '"'),
                                        "+data.apply_chat_template_kwargs={x: '1e-2'}"])
    assert cfg.custom_reward_function.reward_kwargs == texts
    path = tmp_path / "config.yaml"
    path.write_text(to_commented_yaml(cfg))
    back = load_config(PPOConfig, str(path), [])
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)
    assert run_differences(dataclasses.asdict(cfg), dataclasses.asdict(back)) == []
