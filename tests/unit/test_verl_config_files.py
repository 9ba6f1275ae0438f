"""verl's config files as they are written: Hydra's header (`hydra.searchpath`, `defaults:
[ppo_trainer, _self_]`) and OmegaConf's interpolations, resolved on the final values."""

import pytest

from trainer.config import PPOConfig
from trainer.configlib import ConfigError, load_config


def _load(tmp_path, text, *overrides):
    path = tmp_path / "verl.yaml"
    path.write_text(text)
    return load_config(PPOConfig, path, ["actor_rollout_ref.model.path=/models/actor", *overrides])


HEADER = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_
"""


def test_a_verl_config_file_with_hydras_header_loads_over_the_defaults(tmp_path):
    cfg = _load(tmp_path, HEADER + "data:\n  train_batch_size: 64\n  max_response_length: 48\n")
    assert cfg.data.train_batch_size == 64 and cfg.data.max_response_length == 48
    assert cfg.actor_rollout_ref.rollout.n == PPOConfig().actor_rollout_ref.rollout.n
    assert _load(tmp_path, "defaults:\n  - ppo_trainer\ndata:\n  train_batch_size: 8\n").data.train_batch_size == 8
    with pytest.raises(ConfigError, match=r"defaults \['_self_', 'ppo_trainer'\] is not supported"):
        _load(tmp_path, "defaults:\n  - _self_\n  - ppo_trainer\n")
    with pytest.raises(ConfigError, match=r"defaults \['ppo_megatron_trainer', '_self_'\] is not supported"):
        _load(tmp_path, "defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"hydra.run is not supported \(only hydra.searchpath"):
        _load(tmp_path, "hydra:\n  run:\n    dir: x\n")


def test_interpolations_resolve_on_the_final_values(tmp_path):
    """An interpolation reads the option's final value: the file's, an override's (which wins over
    the file), or meshppo's default where neither sets it; a whole-value interpolation keeps the
    type, one inside a string gives text; relative ones read the option's own section; oc.select
    falls back to its default only where the key is no option."""
    text = HEADER + """
data:
  max_response_length: 48
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 16
    ppo_epochs: ${oc.select:actor_rollout_ref.rollout.n,1}
  rollout:
    response_length: ${data.max_response_length}
    n: 4
critic:
  ppo_mini_batch_size: ${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}
  ppo_micro_batch_size_per_gpu: 2
  forward_micro_batch_size_per_gpu: ${oc.select:.ppo_micro_batch_size_per_gpu,null}
  ppo_max_token_len_per_gpu: ${oc.select:not_an_option.x,1234}
trainer:
  experiment_name: run_${actor_rollout_ref.rollout.n}x${data.max_response_length}
  project_name: proj_${oc.select:data.train_batch_size,x}
"""
    cfg = _load(tmp_path, text)
    assert cfg.actor_rollout_ref.rollout.response_length == 48
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 4
    assert cfg.critic.ppo_mini_batch_size == 16 and cfg.critic.forward_micro_batch_size_per_gpu == 2
    assert cfg.critic.ppo_max_token_len_per_gpu == 1234
    assert cfg.trainer.experiment_name == "run_4x48"
    assert cfg.trainer.project_name == f"proj_{PPOConfig().data.train_batch_size}"  # a default the file leaves
    over = _load(tmp_path, text, "data.max_response_length=32", "actor_rollout_ref.rollout.n=2")
    assert over.actor_rollout_ref.rollout.response_length == 32 and over.trainer.experiment_name == "run_2x32"
    assert over.actor_rollout_ref.actor.ppo_epochs == 2


DAPO = HEADER + """
data:
  max_prompt_length: 16
  max_response_length: 6
reward_model:
  reward_manager: dapo
  reward_kwargs:
    max_resp_len: ${actor_rollout_ref.rollout.response_length}
    overlong_buffer_cfg: {enable: true, len: 2, penalty_factor: 1.0, log: false}
trainer:
  project_name: myproj
  experiment_name: exp1
  validation_data_dir: ${trainer.default_local_dir}/val_dumps
"""


def test_an_interpolation_of_an_option_the_file_leaves_reads_the_value_it_takes_from_the_file(tmp_path):
    """As in verl, whose defaults are interpolations themselves (rollout.response_length is
    data.max_response_length, trainer.default_local_dir is built of the project and experiment
    names): an option the file does not set is read as the config built from the file's values has
    it, not as the empty config's default (512 tokens, runs/meshppo/run)."""
    cfg = _load(tmp_path, DAPO)
    assert cfg.reward_model.reward_kwargs["max_resp_len"] == 6
    assert cfg.trainer.validation_data_dir == "runs/myproj/exp1/val_dumps"
    over = _load(tmp_path, DAPO, "data.max_response_length=7", "trainer.project_name=other",
                 "trainer.test_freq=${trainer.save_freq}", "trainer.save_freq=3")
    assert over.reward_model.reward_kwargs["max_resp_len"] == 7
    assert over.trainer.validation_data_dir == "runs/other/exp1/val_dumps"
    assert over.trainer.test_freq == 3
    by_override = _load(tmp_path, HEADER + "data:\n  max_response_length: 9\n",
                        "trainer.validation_data_dir=${trainer.default_local_dir}/v", "trainer.project_name=p",
                        "trainer.experiment_name=e", "critic.ppo_max_token_len_per_gpu=${actor_rollout_ref.rollout.max_model_len}")
    assert by_override.trainer.validation_data_dir == "runs/p/e/v"
    assert by_override.critic.ppo_max_token_len_per_gpu == by_override.data.max_prompt_length + 9


def test_an_interpolation_of_an_interpolation_reads_its_final_value(tmp_path):
    """Interpolations that read each other, directly or through a value that follows another
    (max_model_len: the prompt's and the response's lengths, the response's from
    data.max_response_length, itself an interpolation here)."""
    text = HEADER + """
data:
  max_prompt_length: 16
  max_response_length: ${data.max_prompt_length}
actor_rollout_ref:
  rollout:
    max_num_batched_tokens: ${actor_rollout_ref.rollout.max_model_len}
critic:
  ppo_max_token_len_per_gpu: ${actor_rollout_ref.rollout.max_num_batched_tokens}
reward_model:
  reward_manager: dapo
  reward_kwargs:
    max_resp_len: ${actor_rollout_ref.rollout.response_length}
    overlong_buffer_cfg: {enable: true, len: 2, penalty_factor: 1.0, log: false}
"""
    cfg = _load(tmp_path, text)
    assert cfg.data.max_response_length == 16 and cfg.actor_rollout_ref.rollout.max_model_len == 32
    assert cfg.actor_rollout_ref.rollout.max_num_batched_tokens == 32
    assert cfg.critic.ppo_max_token_len_per_gpu == 32
    assert cfg.reward_model.reward_kwargs["max_resp_len"] == 16


def test_interpolations_that_read_each_other_in_a_cycle_are_refused_naming_the_keys(tmp_path):
    # through a value that follows the interpolated one: default_local_dir is made of project_name
    with pytest.raises(ConfigError, match=r"trainer.project_name: its interpolation .* reads a value that changes "
                                          r"with its own"):
        _load(tmp_path, "trainer:\n  project_name: ${oc.select:trainer.default_local_dir,x}\n")
    with pytest.raises(ConfigError, match=r"the interpolations data.max_prompt_length -> data.max_response_length -> "
                                          "data.max_prompt_length form a cycle"):
        _load(tmp_path, "data:\n  max_prompt_length: 4\n", "data.max_prompt_length=${data.max_response_length}",
              "data.max_response_length=${data.max_prompt_length}")


def test_interpolation_errors_name_the_option(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPPO_TEST_PROJECT", "proj")
    assert _load(tmp_path, "trainer:\n  project_name: ${oc.env:MESHPPO_TEST_PROJECT}\n").trainer.project_name == "proj"
    assert _load(tmp_path, "trainer:\n  project_name: ${oc.env:MESHPPO_TEST_UNSET,dflt}\n").trainer.project_name == "dflt"
    with pytest.raises(ConfigError, match="trainer.project_name: .* reads the environment variable MESHPPO_TEST_UNSET"):
        _load(tmp_path, "trainer:\n  project_name: ${oc.env:MESHPPO_TEST_UNSET}\n")
    with pytest.raises(ConfigError, match=r"trainer.project_name: \$\{data.nope\} names 'data.nope', which is no "
                                          "config option"):
        _load(tmp_path, "trainer:\n  project_name: ${data.nope}\n")
    with pytest.raises(ConfigError, match=r"the interpolations trainer.project_name -> trainer.experiment_name -> "
                                          "trainer.project_name form a cycle"):
        _load(tmp_path, "trainer:\n  project_name: ${trainer.experiment_name}\n"
                        "  experiment_name: ${trainer.project_name}\n")
    with pytest.raises(ConfigError, match="the resolver oc.create is not supported"):
        _load(tmp_path, "trainer:\n  project_name: ${oc.create:x}\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name is \?\?\? \(verl's mark of a value that "
                                          r"must be given\): set it"):
        _load(tmp_path, "actor_rollout_ref:\n  rollout:\n    name: ???\n")
    assert _load(tmp_path, "actor_rollout_ref:\n  rollout:\n    name: ???\n",
                 "actor_rollout_ref.rollout.name=vllm").actor_rollout_ref.rollout.name == "vllm"
    # verl's generated default config leaves its reward-model server's name ??? (read only when a
    # discriminative reward model scores): meshppo does not read that section, so it loads
    cfg = _load(tmp_path, "reward_model:\n  rollout:\n    name: ???\n    dtype: bfloat16\n")
    assert cfg.reward_model.rollout == {"name": "???", "dtype": "bfloat16"}
