"""Command-line and YAML parsing edges: duplicate YAML keys, mapping overrides, string options
given YAML-looking text, options after overrides, Hydra's `+`/`++` and `--config-path`/`--config-name`,
`--nproc-per-node 0`, launchers per SLURM step."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainer.config import PPOConfig
from trainer.configlib import ConfigError, load_config, parse_override

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


def _cfg(*overrides, path=DEMO):
    return load_config(PPOConfig, path, list(overrides))


# 1. a key written twice in a YAML file is an error naming the file, the key and both lines
def test_duplicate_yaml_keys_are_errors(tmp_path):
    top = tmp_path / "top.yaml"
    top.write_text("data:\n  seed: 3\ntrainer:\n  seed: 4\ndata:\n  shuffle: false\n")
    with pytest.raises(ConfigError) as e:
        _cfg(path=top)
    assert str(e.value) == f"config file {str(top)!r}: key 'data' appears twice (lines 1 and 5)"

    nested = tmp_path / "nested.yaml"
    nested.write_text("trainer:\n  seed: 4\n  total_epochs: 1\n  seed: 5\n")
    with pytest.raises(ConfigError) as e:
        _cfg(path=nested)
    assert str(e.value) == f"config file {str(nested)!r}: key 'trainer.seed' appears twice (lines 2 and 4)"

    # Not a duplicate: the same key in two sections, and a YAML merge key overridden explicitly.
    ok = tmp_path / "ok.yaml"
    ok.write_text("data: {seed: 3}\ntrainer: {seed: 4}\n"
                  "x: &opt {lr: 1.0e-5, weight_decay: 0.1}\nactor_rollout_ref:\n  actor:\n    optim:\n"
                  "      <<: *opt\n      lr: 2.0e-5\n")
    with pytest.raises(ConfigError, match="unknown config key 'x'"):
        _cfg(path=ok)


# 2. a mapping value merges into the section; any other value replaces
def test_mapping_override_merges_into_section():
    assert _cfg().actor_rollout_ref.actor.optim.weight_decay == 0.0  # demo.yaml's, not the default 0.01
    optim = _cfg("actor_rollout_ref.actor.optim={lr: 1e-5}").actor_rollout_ref.actor.optim
    assert optim.lr == 1e-5 and optim.weight_decay == 0.0
    actor = _cfg("actor_rollout_ref.actor={optim: {lr: 2e-5}}").actor_rollout_ref.actor
    assert actor.optim.lr == 2e-5 and actor.optim.weight_decay == 0.0
    assert _cfg("actor_rollout_ref.actor.optim.betas=[0.8, 0.9]").actor_rollout_ref.actor.optim.betas == [0.8, 0.9]
    assert _cfg("trainer.logger=[console]").trainer.logger == ["console"]  # a list still replaces


# 3. string options take the override's text as written
@pytest.mark.parametrize("text", ["20250101", "2025-01-01", "1.0", "on", "yes", "0x1F", "12:30"])
def test_string_options_keep_override_text(text):
    cfg = _cfg(f"trainer.experiment_name={text}", f"trainer.project_name={text}", f"data.tokenizer={text}",
               f"trainer.logger=[console, {text}]")
    assert cfg.trainer.experiment_name == text and cfg.trainer.project_name == text
    assert cfg.data.tokenizer == text  # str | None
    assert cfg.trainer.logger == ["console", text]  # list[str] items


@pytest.mark.parametrize("text", ["20250101", "2025-01-01", "1.0", "on", "0x1F", "12:30"])
def test_string_options_keep_a_config_files_text(tmp_path, text):
    """The same in a config file (as OmegaConf reads verl's files): a string option is its text; a
    quoted one, null and the other types are what YAML reads; a key twice is still an error."""
    path = tmp_path / "c.yaml"
    path.write_text(open(DEMO).read() + f"  experiment_name: {text}\n  project_name: '{text}'\n"
                    f"  validation_data_dir: null\n  rollout_data_dir: {text}\n")
    cfg = _cfg(path=str(path))
    assert cfg.trainer.experiment_name == cfg.trainer.project_name == cfg.trainer.rollout_data_dir == text
    assert cfg.trainer.validation_data_dir is None and cfg.trainer.seed == 0 and cfg.actor_rollout_ref.rollout.n == 8
    path.write_text(open(DEMO).read() + "  seed: 1\n")
    with pytest.raises(ConfigError, match=r"key 'trainer\.seed' appears twice"):
        _cfg(path=str(path))


def test_string_override_quotes_and_null():
    assert _cfg("trainer.experiment_name='1.0'").trainer.experiment_name == "1.0"
    assert _cfg('trainer.experiment_name="a b"').trainer.experiment_name == "a b"
    assert _cfg("trainer.validation_data_dir=2025").trainer.validation_data_dir == "2025"  # str | None
    assert _cfg("trainer.validation_data_dir=null").trainer.validation_data_dir is None
    assert _cfg("trainer.validation_data_dir=2025", "trainer.validation_data_dir=~").trainer.validation_data_dir is None
    assert parse_override("data.tokenizer=null", PPOConfig) == (["data", "tokenizer"], None)
    assert _cfg("trainer.logger=2025").trainer.logger == ["2025"]
    # a section given as a mapping: its string options too
    assert _cfg("trainer={experiment_name: 2025, seed: 7}").trainer.experiment_name == "2025"
    # only on the command line: what YAML reads is kept for other types
    assert parse_override("trainer.experiment_name=2025") == (["trainer", "experiment_name"], 2025)
    assert parse_override("trainer.seed=2025", PPOConfig) == (["trainer", "seed"], 2025)


# (options that are not strings still reject text: tests/unit/test_config.py, test_bad_overrides_name_the_problem)


# 5. options after overrides
def test_options_after_overrides(capsys):
    from trainer import cli, launch

    args = cli.parse_args(["--config", DEMO, "trainer.seed=1", "--print-config", "trainer.test_freq=5"])
    assert args.print_config and args.config == DEMO and args.overrides == ["trainer.seed=1", "trainer.test_freq=5"]
    code = launch.main(["--config", DEMO, "trainer.seed=1", "--nproc-per-node=2", "trainer.test_freq=5",
                        "--print-config"])
    out = capsys.readouterr().out
    assert code == 0
    assert "  seed: 1  #" in out and "  test_freq: 5  #" in out


# 6. Hydra's + and ++ prefixes
def test_hydra_plus_prefixes():
    assert parse_override("+trainer.seed=3") == (["trainer", "seed"], 3)
    assert parse_override("++trainer.seed=3") == (["trainer", "seed"], 3)
    assert _cfg("+trainer.seed=3", "++data.seed=4").trainer.seed == 3
    assert _cfg("++data.seed=4").data.seed == 4
    with pytest.raises(ConfigError, match="unknown config key 'trainer.sed'; did you mean 'trainer.seed'"):
        _cfg("+trainer.sed=3")
    with pytest.raises(ConfigError, match="empty key part"):
        parse_override("++=3")


# 8. --nproc-per-node below 1: one line, exit code 2
@pytest.mark.parametrize("value", ["0", "-1"])
def test_nproc_per_node_below_one(value):
    r = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", DEMO, "--nproc-per-node", value],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"meshppo: config error: --nproc-per-node must be at least 1, got {value}"]


# 7. `make demo NPROC=1` (and `make train NPROC=1`) describe the launch they start
@pytest.mark.parametrize("target", ["demo", "train"])
def test_make_nproc_sets_n_gpus_per_node(target):
    import shlex

    from trainer.config import validate

    r = subprocess.run(["make", "-n", "-B", target, "NPROC=1", "DEMO_DIR=assets"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.replace("\\\n", " ").splitlines()
    words = shlex.split(next(line for line in lines if "train_ppo.py" in line or "run_single_node.sh" in line))
    start = next(i for i, w in enumerate(words) if w.endswith(("train_ppo.py", "run_single_node.sh")))
    args = words[start + 1:]
    assert args[0] == "--config"
    cfg = load_config(PPOConfig, os.path.join(ROOT, args[1]), args[2:])
    assert cfg.trainer.n_gpus_per_node == 1
    validate(cfg, 1, 1)


def test_make_demo_refuses_a_run_directory_in_args(tmp_path):
    # the plots read DEMO_RUN: a run moved by ARGS would be trained in one place and plotted from another
    r = subprocess.run(["make", "demo", f"DEMO_DIR={tmp_path}/assets",
                        f"ARGS=trainer.default_local_dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "move the run with DEMO_RUN=DIR" in r.stderr, r.stderr
    assert not (tmp_path / "assets").exists() and not (tmp_path / "run").exists()


def test_make_demo_says_a_config_error_in_one_line(tmp_path, tiny_assets):
    """`make demo` trains through the launcher: a misspelt option in ARGS, or an NPROC the batch does not
    split over, is the one line naming it before any rank starts (under plain torchrun every rank
    started, and torchrun's report of the failed ranks followed with its traceback)."""
    import json
    import shutil

    from tools.prepare_demo import DEFAULTS, STAMP

    assets = tmp_path / "assets"
    shutil.copytree(tiny_assets, assets)
    (assets / STAMP).write_text(json.dumps(dict(DEFAULTS, seed=0)))  # up to date for make demo: no build
    for extra, line in [
            (["ARGS=actor_rollout_ref.actor.optim.lrr=1e-3"],
             "meshppo: config error: unknown config key 'actor_rollout_ref.actor.optim.lrr'; "
             "did you mean 'actor_rollout_ref.actor.optim.lr'?"),
            (["NPROC=3"], "meshppo: config error: ppo_mini_batch_size x rollout.n = 128 sequences must split evenly "
                          "over 3 ranks: change actor_rollout_ref.actor.ppo_mini_batch_size")]:
        # -o install: the interpreter's dependencies are there (make test installed them)
        r = subprocess.run(["make", "-o", "install", "demo", f"PYTHON={sys.executable}", f"DEMO_DIR={assets}",
                            f"DEMO_RUN={tmp_path}/run", *extra], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode != 0
        # (make's own line, `make[1]: ***` where this runs under make test)
        errors = [x for x in r.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", x)]
        assert errors == [line], r.stderr
        assert not (tmp_path / "run").exists()


# 9. under srun: one launcher per node, on no more nodes than --nnodes (else each runs its own copy
# of the training into the same run directory)
SLURM_VARS = ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES", "SLURM_NTASKS")


@pytest.mark.parametrize("env,message", [
    # single_node.sbatch submitted with --nodes=2
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2"},
     "this SLURM step runs on 2 nodes but --nnodes=1: each node would run its own copy of the training"),
    ({"SLURM_STEP_ID": "0", "SLURM_NNODES": "2"}, "this SLURM step runs on 2 nodes but --nnodes=1"),
    # --ntasks-per-node=2: two launchers on the node
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "1"},
     "this SLURM step runs 2 tasks on 1 node: the launcher starts all of a node's ranks itself"),
])
def test_a_slurm_step_with_more_launchers_than_nodes_is_refused(monkeypatch, capsys, env, message):
    from trainer import launch

    for key in SLURM_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.main(["--config", DEMO, "--print-config"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshppo: config error: {message}"), err


def test_multi_node_sbatch_and_single_node_steps_pass(monkeypatch, capsys):
    from trainer import launch

    for key in SLURM_VARS:
        monkeypatch.delenv(key, raising=False)
    # multi_node.sbatch on 2 nodes: one launcher task per node, --nnodes=$SLURM_NNODES
    for key, value in {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                       "SLURM_NNODES": "2", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    assert launch.main(["--nnodes=2", "--rdzv-endpoint=node0:29500", "--rdzv-id=4242", "--config", DEMO,
                        "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "--print-config"]) == 0, capsys.readouterr().err
    # single_node.sbatch as submitted: one node, one task
    for key, value in {"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NNODES": "1",
                       "SLURM_NTASKS": "1"}.items():
        monkeypatch.setenv(key, value)
    assert launch.main(["--config", DEMO, "--print-config"]) == 0, capsys.readouterr().err
    # the batch script itself, not a step: a 2-node allocation runs one launcher there
    monkeypatch.delenv("SLURM_STEP_ID")
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert launch.main(["--config", DEMO, "--print-config"]) == 0, capsys.readouterr().err


def test_without_a_config_file_the_overrides_go_over_verls_defaults(capsys, tmp_path):
    """A verl script keeps its overrides and swaps the launcher (docs/VERL.md). Without --config the
    demo's file was the base: its total_training_steps=40 overrode the script's total_epochs, with its
    seeds, run directory and model path. Now the base is verl's defaults, as on verl's command line."""
    from trainer import cli, launch

    base = ["actor_rollout_ref.model.path=/m", "data.train_files=[t.jsonl]", "trainer.total_epochs=15",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=1"]
    assert cli.parse_args(base).config is None
    assert cli.main([*base, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "  total_training_steps: null  #" in out and "  total_epochs: 15  #" in out
    assert "  default_local_dir: runs/meshppo/run  #" in out and "demo" not in out
    # the launcher's torchrun command passes no --config either (it passed None's text)
    args = SimpleNamespace(config=None, overrides=base, rdzv_endpoint="127.0.0.1:1", rdzv_id="x", nnodes=1,
                           max_restarts=0, log_dir=str(tmp_path))
    command = launch._Launch(load_config(PPOConfig, None, base), args, 1).command()
    assert "--config" not in command and command[-len(base):] == base
    args.config = DEMO
    assert launch._Launch(load_config(PPOConfig, DEMO), args, 1).command()[-len(base) - 2:-len(base)] == ["--config",
                                                                                                          DEMO]


# Hydra's --config-path / --config-name (-cp / -cn), as verl's scripts pass them
VERL_BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=[t.jsonl]", "trainer.total_epochs=15",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=1"]
# a config of verl's examples/sglang_multiturn/config: Hydra's header, then the file over verl's defaults
VERL_CONFIG = ("hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
               "defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_batch_size: 64\n  max_response_length: 48\n"
               "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n")


@pytest.mark.parametrize("spelling", [
    ["--config-path=conf", "--config-name=gsm8k_multiturn_grpo"],
    ["--config-path", "conf", "--config-name", "gsm8k_multiturn_grpo.yaml"],
    ["-cp=conf", "-cn=gsm8k_multiturn_grpo"],
    ["-cp", "conf", "-cn", "gsm8k_multiturn_grpo.yaml"],
])
def test_hydras_config_path_and_name_load_that_file(spelling, capsys, tmp_path, monkeypatch):
    """`--config-name NAME` in `--config-path DIR` (relative to the working directory) is DIR/NAME.yaml,
    with or without the suffix, in either spelling, long or short, before or after the overrides."""
    from trainer import cli, launch

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gsm8k_multiturn_grpo.yaml").write_text(VERL_CONFIG)
    monkeypatch.chdir(tmp_path)
    assert launch.config_file(cli.parse_args([*VERL_BASE[:2], *spelling, *VERL_BASE[2:]])) == os.path.join(
        "conf", "gsm8k_multiturn_grpo.yaml")
    assert cli.main([*spelling, *VERL_BASE, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "  train_batch_size: 64  #" in out and "  max_response_length: 48  #" in out
    assert "  total_epochs: 15  #" in out
    assert launch.main([*VERL_BASE, *spelling, "--print-config"]) == 0
    assert "  train_batch_size: 64  #" in capsys.readouterr().out
    # the launcher hands the ranks the file as --config
    started = []
    monkeypatch.setattr(launch._Launch, "run", lambda self: started.append(self.command()) or 0)
    assert launch.main([*VERL_BASE, *spelling]) == 0
    config_at = started[0].index("--config")
    assert started[0][config_at + 1] == os.path.join("conf", "gsm8k_multiturn_grpo.yaml")
    assert started[0][config_at + 2:] == VERL_BASE


def test_hydras_config_name_of_verls_own_configs(capsys, tmp_path):
    """verl's default name, ppo_trainer, is its defaults, which meshppo's options are: no file (verl's
    scripts give it with `--config-path=config`, verl's own directory). ppo_megatron_trainer is Megatron's."""
    from trainer import cli, launch

    for spelling in (["--config-name=ppo_trainer"], ["--config-path=config", "--config-name=ppo_trainer.yaml"]):
        assert launch.config_file(cli.parse_args([*spelling, *VERL_BASE])) is None
        assert cli.main([*spelling, *VERL_BASE, "--print-config"]) == 0
        out = capsys.readouterr().out
        assert "  total_training_steps: null  #" in out and "  total_epochs: 15  #" in out
    for name in ("ppo_megatron_trainer", "ppo_megatron_trainer.yaml"):
        assert launch.main(["--config-path=config", f"--config-name={name}", *VERL_BASE, "--print-config"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"meshppo: config error: --config-name={name} is not supported: meshppo has no Megatron engine (it trains "
            "with FSDP2: strategy fsdp or fsdp2)"]
    missing = tmp_path / "nothing"
    assert launch.main([f"-cp={missing}", "-cn=gsm8k", *VERL_BASE, "--print-config"]) == 2
    assert f"config file {str(missing / 'gsm8k.yaml')!r} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("spelling, message", [
    (["--config", DEMO, "--config-name=gsm8k_multiturn_grpo"],
     f"--config {DEMO} and --config-name gsm8k_multiturn_grpo both name the config file: give one"),
    (["--config", DEMO, "-cp=conf"], f"--config {DEMO} and --config-path conf both name the config file: give one"),
    (["--config-path=conf"], "--config-path conf needs --config-name: the config file in it"),
])
def test_hydras_config_arguments_that_conflict(spelling, message, capsys):
    from trainer import cli, launch

    assert launch.main([*spelling, *VERL_BASE, "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"meshppo: config error: {message}"]
    assert cli.main([*spelling, *VERL_BASE, "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"meshppo: config error: {message}"]


# 10. an empty run directory (an unset shell variable: trainer.default_local_dir=$RUN) is one config
# error before any rank starts, from the launcher and from plain torchrun's ranks (it was a
# FileNotFoundError traceback from the run-directory lock)
@pytest.mark.parametrize("value", ["", "' '"])
def test_an_empty_run_directory_is_a_config_error(tmp_path, value):
    from trainer.setup import preflight

    with pytest.raises(ConfigError, match=r"^trainer.default_local_dir='\s*' is empty: give the run directory, or "
                                          r"null for runs/"):
        preflight(_cfg(f"trainer.default_local_dir={value}"))
    r = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", DEMO, f"trainer.default_local_dir={value}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "trainer.default_local_dir=" in r.stderr and "is empty" in r.stderr
    assert os.listdir(tmp_path) == []


# --print-config: train_ppo.py's (the launch the config describes) and the launcher's (this launch) check
# what a launch's pre-flight checks, except this machine's devices, and print the same notes
@pytest.fixture
def short_context_model(tmp_path):
    """A model trained for 16 positions: the demo's engine context (16 + 6) is beyond it, a model note."""
    from models import ModelArgs, Transformer

    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=16, eos_token_id=2)
    Transformer.build(args, seed=0).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def _print_config(entry, argv, capsys):
    from trainer import cli, launch

    code = (cli if entry == "train_ppo.py" else launch).main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("entry", ["train_ppo.py", "launcher"])
def test_print_config_says_the_config_and_model_notes(entry, short_context_model, capsys, tmp_path):
    """The launcher's --print-config printed config_notes only: the model note (an engine context beyond the
    model's positions) came from train_ppo.py's alone."""
    code, out, err = _print_config(entry, ["--config", DEMO, f"actor_rollout_ref.model.path={short_context_model}",
                                           f"trainer.default_local_dir={tmp_path / 'run'}",
                                           "actor_rollout_ref.rollout.enable_prefix_caching=false"], capsys)
    assert code == 0, err
    assert f"path: {short_context_model}  #" in out and "adv_estimator: grpo" in out
    notes = err.splitlines()
    assert any(n.startswith("meshppo: actor_rollout_ref.rollout.max_model_len=22 ") and "(16, " in n for n in notes)
    assert any(n.startswith("meshppo: actor_rollout_ref.rollout.enable_prefix_caching") for n in notes), notes
    assert all(n.startswith("meshppo: ") for n in notes) and "Traceback" not in err


@pytest.mark.parametrize("entry", ["train_ppo.py", "launcher"])
def test_print_config_refuses_what_a_launch_would(entry, capsys, tmp_path):
    """train_ppo.py --print-config ran `validate` only: a samples directory under a file, which every launch
    refuses at its pre-flight, printed the config and exited 0."""
    afile = tmp_path / "afile"
    afile.write_text("")
    code, out, err = _print_config(entry, ["--config", DEMO, f"trainer.default_local_dir={tmp_path / 'run'}",
                                           f"trainer.rollout_data_dir={afile / 'samples'}"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"meshppo: config error: trainer.rollout_data_dir={afile / 'samples'} is under "
                                f"{afile}, a file: the run writes a directory there"]


GPU_CONFIG = os.path.join(ROOT, "configs", "gsm8k_qwen2.5_7b_fsdp.yaml")  # one node of 8 GPUs


@pytest.mark.parametrize("gpus", [0, 2])
def test_print_config_checks_a_gpu_config_on_a_machine_with_fewer_gpus(gpus, monkeypatch, capsys, tmp_path):
    """A login node (no GPUs) or a workstation (2) checks an 8-GPU config: this machine's devices are checked
    by a launch only, which still refuses to start there."""
    import torch

    from trainer import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "16")  # (an allocation with more GPUs than the config's node uses)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    args = ["--config", GPU_CONFIG, "trainer.device=cuda", f"trainer.default_local_dir={tmp_path / 'run'}"]
    for entry in ("train_ppo.py", "launcher"):
        code, out, err = _print_config(entry, args, capsys)
        assert code == 0 and "n_gpus_per_node: 8  #" in out, (entry, err)
    # launching there: refused before any rank starts, naming what this machine lacks
    monkeypatch.setattr(launch, "_Launch", None)  # (never reached)
    assert launch.main(args) == 2
    message = ("trainer.device=cuda but CUDA is not available on this machine" if gpus == 0 else
               "trainer.n_gpus_per_node=8 but this node has 2 visible GPUs (CUDA_VISIBLE_DEVICES)")
    assert capsys.readouterr().err.splitlines() == [f"meshppo: config error: {message}"]
