"""`~` in the config's path options: the home directory, expanded once at load (`configlib.expand_home`),
so that the resolved config, --print-config, the run's recorded config and resume's same-run checks all
hold the expanded path; other text (URIs, `$VAR`, a `~` inside a path) stays as written."""

import dataclasses
import os
import pwd

import pytest

from trainer.config import PPOConfig
from trainer.configlib import ConfigError, build_dataclass, load_config, to_commented_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")

# each kind of path option, by the override that sets it and where the resolved config holds it
PATH_OPTIONS = [
    ("data.train_files=[~/d/train.jsonl, ~/d/more.parquet]", lambda c: c.data.train_files,
     ["{home}/d/train.jsonl", "{home}/d/more.parquet"]),
    ("data.train_files=~/d/one.jsonl", lambda c: c.data.train_files, ["{home}/d/one.jsonl"]),
    ("data.val_files=[~/d/val.jsonl]", lambda c: c.data.val_files, ["{home}/d/val.jsonl"]),
    ("data.tokenizer=~/tok", lambda c: c.data.tokenizer, "{home}/tok"),
    ("actor_rollout_ref.model.path=~/m", lambda c: c.actor_rollout_ref.model.path, "{home}/m"),
    ("actor_rollout_ref.model.lora_adapter_path=~/adapter", lambda c: c.actor_rollout_ref.model.lora_adapter_path,
     "{home}/adapter"),
    ("actor_rollout_ref.model.tokenizer_path=~/tok", lambda c: c.data.tokenizer, "{home}/tok"),
    ("critic.model.path=~/critic", lambda c: c.critic.model.path, "{home}/critic"),
    ("critic.model.tokenizer_path=~/tok", lambda c: c.critic.model.tokenizer_path, "{home}/tok"),
    ("reward_model.model.path=~/rm", lambda c: c.reward_model.model.path, "{home}/rm"),
    ("reward.reward_model.model_path=~/rm", lambda c: c.reward_model.model.path, "{home}/rm"),
    ("reward_model.model.input_tokenizer=~/rm_tok", lambda c: c.reward_model.model.input_tokenizer, "{home}/rm_tok"),
    ("custom_reward_function.path=~/r.py", lambda c: c.custom_reward_function.path, "{home}/r.py"),
    ("reward.custom_reward_function.path=~/r.py", lambda c: c.custom_reward_function.path, "{home}/r.py"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path=~/tools.yaml",
     lambda c: c.actor_rollout_ref.rollout.multi_turn.tool_config_path, "{home}/tools.yaml"),
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=~/interactions.yaml",
     lambda c: c.actor_rollout_ref.rollout.multi_turn.interaction_config_path, "{home}/interactions.yaml"),
    ("data.tool_config_path=~/tools.yaml", lambda c: c.data.tool_config_path, "{home}/tools.yaml"),
    ("trainer.default_local_dir=~/runs/a", lambda c: c.trainer.default_local_dir, "{home}/runs/a"),
    ("trainer.resume_from_path=~/runs/a/checkpoints/global_step_2", lambda c: c.trainer.resume_from_path,
     "{home}/runs/a/checkpoints/global_step_2"),
    ("trainer.rollout_data_dir=~/samples", lambda c: c.trainer.rollout_data_dir, "{home}/samples"),
    ("trainer.validation_data_dir=~/val_samples", lambda c: c.trainer.validation_data_dir, "{home}/val_samples"),
    ("global_profiler.save_path=~/prof", lambda c: c.global_profiler.save_path, "{home}/prof"),
    ("actor_rollout_ref.actor.profiler.save_path=~/prof_a", lambda c: c.actor_rollout_ref.actor.profiler.save_path,
     "{home}/prof_a"),
    ("actor_rollout_ref.ref.profiler.save_path=~/prof_r", lambda c: c.actor_rollout_ref.ref.profiler.save_path,
     "{home}/prof_r"),
    ("actor_rollout_ref.rollout.profiler.save_path=~/prof_g", lambda c: c.actor_rollout_ref.rollout.profiler.save_path,
     "{home}/prof_g"),
    ("critic.profiler.save_path=~/prof_c", lambda c: c.critic.profiler.save_path, "{home}/prof_c"),
    ("reward_model.profiler.save_path=~/prof_m", lambda c: c.reward_model.profiler.save_path, "{home}/prof_m"),
    ("trainer.default_local_dir='~'", lambda c: c.trainer.default_local_dir, "{home}"),  # (bare ~: YAML's null)
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return str(tmp_path)


def _fill(expected, home):
    return [e.format(home=home) for e in expected] if isinstance(expected, list) else expected.format(home=home)


@pytest.mark.parametrize("override,get,expected", PATH_OPTIONS, ids=[o[0].split("=")[0] for o in PATH_OPTIONS])
def test_each_kind_of_path_option_reads_tilde_as_the_home_directory(home, override, get, expected):
    cfg = load_config(PPOConfig, DEMO, [override])
    assert get(cfg) == _fill(expected, home)
    # what --print-config prints and the run records (config.yaml) is the expanded path, and reads back as it is
    values = [line.split("  #")[0] for line in to_commented_yaml(cfg).splitlines()
              if not line.strip().startswith("dump_dir:")]  # (verl's dumps: no effect, never read)
    assert not [v for v in values if "~" in v] and any(home in v for v in values)
    assert build_dataclass(PPOConfig, dataclasses.asdict(cfg)) == cfg


def test_inherited_paths_follow_the_expanded_one(home):
    """The options that default to another path get it expanded (the critic's model and tokenizer, the
    actor's tokenizer, the reward model's input tokenizer, the roles' profiles)."""
    cfg = load_config(PPOConfig, DEMO, ["actor_rollout_ref.model.path=~/m", "algorithm.adv_estimator=gae",
                                        "global_profiler.save_path=~/prof"])
    m = os.path.join(home, "m")
    assert (cfg.data.tokenizer, cfg.critic.model.path, cfg.critic.model.tokenizer_path) == (m, m, m)
    assert cfg.reward_model.model.input_tokenizer == m
    assert cfg.actor_rollout_ref.actor.profiler.save_path == os.path.join(home, "prof")


def test_tilde_user_is_that_users_home():
    me = pwd.getpwuid(os.getuid())
    cfg = load_config(PPOConfig, DEMO, [f"trainer.default_local_dir=~{me.pw_name}/runs/x"])
    assert cfg.trainer.default_local_dir == os.path.join(me.pw_dir, "runs", "x")


def test_an_unknown_user_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"data\.val_files\[1\]='~no_such_user_xq/v\.jsonl': ~ is read as the home "
                                          "directory, but there is no user 'no_such_user_xq' on this machine"):
        load_config(PPOConfig, DEMO, ["data.val_files=[v.jsonl, ~no_such_user_xq/v.jsonl]"])


def test_uris_variables_and_inner_tildes_are_left_as_written(home):
    cfg = load_config(PPOConfig, DEMO, [
        "data.val_files=[hdfs://nn:8020/user/~x/val.parquet, s3://bucket/~/v.jsonl, d/~/v.jsonl, $HOME/v.jsonl]",
        "custom_reward_function.path=pkg://my_rewards.math", "actor_rollout_ref.model.path=file:///abs/~m"])
    assert cfg.data.val_files == ["hdfs://nn:8020/user/~x/val.parquet", "s3://bucket/~/v.jsonl", "d/~/v.jsonl",
                                  "$HOME/v.jsonl"]
    assert cfg.custom_reward_function.path == "pkg://my_rewards.math"
    assert cfg.actor_rollout_ref.model.path == "file:///abs/~m"


def test_environment_variables_come_from_the_interpolation(home, monkeypatch, tmp_path):
    monkeypatch.setenv("MESHPPO_TEST_DATA", "~/from_env")
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  train_files: ['${oc.env:HOME}/d/t.jsonl', '${oc.env:MESHPPO_TEST_DATA}/t.jsonl']\n"
                      "trainer:\n  default_local_dir: ${oc.env:MESHPPO_TEST_UNSET_DIR,~/runs/b}\n")
    cfg = load_config(PPOConfig, str(config), [])
    assert cfg.data.train_files == [f"{home}/d/t.jsonl", f"{home}/from_env/t.jsonl"]
    assert cfg.trainer.default_local_dir == f"{home}/runs/b"


def test_a_resume_sees_the_same_run_whether_the_path_was_written_with_tilde(home):
    """Same-run checks compare resolved configs: `~/m` and the home directory's `m` are one model path."""
    from trainer.checkpointing import run_differences

    tilde = load_config(PPOConfig, DEMO, ["actor_rollout_ref.model.path=~/m", "data.train_files=[~/t.jsonl]"])
    spelled = load_config(PPOConfig, DEMO, [f"actor_rollout_ref.model.path={home}/m",
                                            f"data.train_files=[{home}/t.jsonl]"])
    assert run_differences(dataclasses.asdict(spelled), dataclasses.asdict(tilde)) == []
    assert tilde == spelled


def test_served_model_name_interpolating_the_tilde_model_path_is_still_the_default(home):
    """verl's default `served_model_name: ${actor_rollout_ref.model.path}` resolves before the paths expand:
    it is still the model path (null, no start-up note)."""
    from trainer.config import config_notes

    cfg = load_config(PPOConfig, DEMO, ["actor_rollout_ref.model.path=~/m",
                                        "actor_rollout_ref.rollout.prometheus.served_model_name="
                                        "${actor_rollout_ref.model.path}"])
    assert cfg.actor_rollout_ref.rollout.prometheus.served_model_name is None
    assert not [n for n in config_notes(cfg) if "served_model_name" in n]


def _path_like_options(cls, prefix=""):
    """(dotted key, field metadata) of each text option whose name says it is a file or directory."""
    import typing

    hints = typing.get_type_hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key') or f.name}" if prefix else (f.metadata.get("key") or f.name)
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            yield from _path_like_options(type(value), key)
            continue
        for tp in typing.get_args(hints[f.name]) or (hints[f.name],):
            if dataclasses.is_dataclass(tp):
                yield from _path_like_options(tp, key)
        name = key.rsplit(".", 1)[-1]
        if "str" in str(hints[f.name]) and (name.endswith(("path", "_dir", "_files", "_file")) or "tokenizer" in name):
            yield key, f.metadata


def test_every_path_option_meshppo_reads_expands_tilde():
    """Guard: an option named like a path that meshppo reads (neither refused unless null nor without effect)
    is marked `opt(path=True)`, so a new one cannot miss the expansion."""
    unread, marked = [], []
    for key, meta in _path_like_options(PPOConfig):
        refused_unless_null = meta.get("unsupported") is not None and meta["unsupported"]("some/path")
        if meta.get("path"):
            marked.append(key)
        elif not (refused_unless_null or meta.get("no_effect")):
            unread.append(key)
    assert unread == []
    assert "trainer.default_local_dir" in marked and "data.train_files" in marked and len(marked) >= 20


def test_a_loader_reads_files_through_tilde(home):
    """The real readers get the expanded paths: the actor's tokenizer, the prompt files, the reward file."""
    from data import RLHFDataset, write_jsonl
    from data.demo import build_demo_tokenizer, make_demo_rows
    from rewards.registry import load_custom_reward_fn
    from models.tokenizer import load_tokenizer

    build_demo_tokenizer(os.path.join(home, "tok"))
    write_jsonl(make_demo_rows(6, seed=0), os.path.join(home, "data", "train.jsonl"))
    with open(os.path.join(home, "r.py"), "w") as f:
        f.write("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n")
    cfg = load_config(PPOConfig, DEMO, ["data.tokenizer=~/tok", "data.train_files=[~/data/train.jsonl]",
                                        "custom_reward_function.path=~/r.py", "data.max_prompt_length=64"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    ds = RLHFDataset(cfg.data.train_files, tokenizer, prompt_key=cfg.data.prompt_key,
                     max_prompt_length=cfg.data.max_prompt_length)
    assert len(ds) == 6
    fn = load_custom_reward_fn(cfg.custom_reward_function.path)
    assert fn(data_source="x", solution_str="1", ground_truth="1") == 0.25


def test_the_command_lines_file_arguments_read_tilde(home, capsys):
    """`--config=~/c.yaml`, `--config-path=~/cfgs` and the launcher's `--log-dir=~/logs`: the shell leaves a
    `~` after `=` as it is, which was read as a directory named ~ in the working directory."""
    import shutil

    from trainer import cli, launch

    shutil.copy(DEMO, os.path.join(home, "c.yaml"))
    os.makedirs(os.path.join(home, "cfgs"))
    shutil.copy(DEMO, os.path.join(home, "cfgs", "mine.yaml"))
    run = f"trainer.default_local_dir={home}/run"
    for argv in (["--config=~/c.yaml"], ["--config-path=~/cfgs", "--config-name=mine"]):
        assert cli.main([*argv, run, "--print-config", "trainer.seed=7"]) == 0, capsys.readouterr().err
        assert "  seed: 7  #" in capsys.readouterr().out
        assert launch.main([*argv, run, "--print-config"]) == 0, capsys.readouterr().err
        capsys.readouterr()
    open(os.path.join(home, "afile"), "w").close()  # a file where --log-dir wants a directory
    assert launch.main(["--config=~/c.yaml", "--log-dir=~/afile/logs", run, "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"meshppo: config error: --log-dir (LOG_DIR)={home}/afile/logs "
                                                    f"is under {home}/afile, a file: the run writes a directory there"]
