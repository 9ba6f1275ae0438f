"""Output directories checked before any work: the trainer's (`check_output_dir`, also
`tools.prepare_demo --out`) and `rollout.generate --out`. A path under a file, or a folder that
cannot be written (permissions, a read-only mount: what `os.access` does not tell root) is one
error naming the option; nothing is left behind by the check."""

import errno
import os
import tempfile

import pytest

from trainer.configlib import ConfigError
from trainer.setup import check_output_dir


def _read_only(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)


def test_a_run_directory_under_a_file_or_unwritable_is_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir=.*/f is a file: the run writes a directory"):
        check_output_dir("trainer.default_local_dir", str(tmp_path / "f"))
    with pytest.raises(ConfigError, match=r"is under .*/f, a file"):
        check_output_dir("trainer.default_local_dir", str(tmp_path / "f" / "run"))
    check_output_dir("trainer.default_local_dir", str(tmp_path / "new" / "run"))  # made later, by the run
    assert sorted(os.listdir(tmp_path)) == ["f"]  # the check leaves nothing
    if os.path.isdir("/sys"):  # root too: sysfs takes no files
        with pytest.raises(ConfigError, match=r"trainer.rollout_data_dir=/sys/meshppo/run: cannot write there \(in "
                                              r"/sys, the nearest folder that exists\)"):
            check_output_dir("trainer.rollout_data_dir", "/sys/meshppo/run")
    _read_only(monkeypatch)
    with pytest.raises(ConfigError, match=rf"--out={tmp_path}: cannot write there: Read-only file system"):
        check_output_dir("--out", str(tmp_path))


def test_generate_refuses_an_unwritable_out_before_generating(tmp_path, monkeypatch):
    from pathlib import Path

    from rollout.generate import CLIError, _check_out

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1]}\n')
    assert _check_out(tmp_path / "o.jsonl", prompts) == tmp_path / "o.jsonl"
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]
    _read_only(monkeypatch)
    with pytest.raises(CLIError, match=r"--out's directory=.*: cannot write there: Read-only file system"):
        _check_out(Path(tmp_path / "o.jsonl"), prompts)


def test_preflight_refuses_a_profile_directory_under_a_file(tmp_path):
    """The profiled step would run, then lose its trace at the export (NotADirectoryError)."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.setup import preflight

    (tmp_path / "f").write_text("x")
    actor = "actor_rollout_ref.actor.profiler"

    def cfg(*overrides):
        return load_config(PPOConfig, "configs/demo.yaml", [f"trainer.default_local_dir={tmp_path}/run",
                                                            "trainer.device=cpu", "global_profiler.steps=[2]",
                                                            "global_profiler.tool=torch", *overrides])

    with pytest.raises(ConfigError, match=r"^global_profiler.save_path=.*/f/prof is under .*/f, a file"):
        preflight(cfg(f"global_profiler.save_path={tmp_path}/f/prof", f"{actor}.enable=true"))
    with pytest.raises(ConfigError, match=rf"^{actor}.save_path=.*/f/prof is under .*/f, a file"):
        preflight(cfg(f"{actor}.save_path={tmp_path}/f/prof", f"{actor}.enable=true",
                      f"actor_rollout_ref.rollout.profiler.save_path={tmp_path}/f/prof"))
    preflight(cfg(f"global_profiler.save_path={tmp_path}/f/prof"))  # no role enabled: nothing is written
    preflight(cfg(f"global_profiler.save_path={tmp_path}/prof", f"{actor}.enable=true"))
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_preflight_refuses_a_tensorboard_dir_under_a_file(tmp_path, monkeypatch):
    """verl's TENSORBOARD_DIR moves the event files out of the run directory; under a file it failed on
    rank 0 alone once the models were built (NotADirectoryError), the other ranks then in a collective.
    Read only when tensorboard logs."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.setup import preflight

    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "f" / "tb"))

    def cfg(*overrides):
        return load_config(PPOConfig, "configs/demo.yaml", [f"trainer.default_local_dir={tmp_path}/run",
                                                            "trainer.device=cpu", *overrides])

    with pytest.raises(ConfigError, match=r"^TENSORBOARD_DIR \(environment, trainer.logger=tensorboard\)=.*/f/tb is "
                                          r"under .*/f, a file"):
        preflight(cfg("trainer.logger=[console,tensorboard]"))
    preflight(cfg("trainer.logger=[console]"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    preflight(cfg("trainer.logger=[console,tensorboard]"))
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_preflight_refuses_a_file_logger_path_under_a_file_or_at_a_directory(tmp_path, monkeypatch):
    """verl's file logger (trainer.logger=file) writes $VERL_FILE_LOGGER_PATH, else
    $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl: a path under a file, or a directory, is refused
    before any work (it failed at the tracking's start, on rank 0, once the models were built). Read only
    when the file logger logs."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.setup import preflight

    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()

    def cfg(*overrides):
        return load_config(PPOConfig, "configs/demo.yaml", [f"trainer.default_local_dir={tmp_path}/run",
                                                            "trainer.device=cpu", *overrides])

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "f" / "log.jsonl"))
    with pytest.raises(ConfigError, match=r"^the file logger's directory \(VERL_FILE_LOGGER_PATH, trainer.logger=file\)"
                                          r"=.*/f is a file"):
        preflight(cfg("trainer.logger=[console,file]"))
    preflight(cfg("trainer.logger=[console]"))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "d"))
    with pytest.raises(ConfigError, match=r"trainer.logger=file writes .*/d \(VERL_FILE_LOGGER_PATH\), which is a "
                                          r"directory"):
        preflight(cfg("trainer.logger=[console,file]"))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "f"))
    with pytest.raises(ConfigError, match=r"^the file logger's directory \(VERL_FILE_LOGGER_ROOT/<project_name>/"
                                          r"<experiment_name>.jsonl, trainer.logger=file\)=.*/f/meshppo is under"):
        preflight(cfg("trainer.logger=[console,file]", "trainer.project_name=meshppo"))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    preflight(cfg("trainer.logger=[console,file]"))
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]  # nothing written


def test_preflight_refuses_a_final_export_over_what_the_run_reads(tmp_path):
    """A second stage trained from the first's hf_actor/ in the same run directory (resume_mode=disable keeps
    it, this run reading it) wrote its own final export over it at the end: the first stage's model was gone,
    and the run's checkpoints no longer resumed (their base's model.safetensors differed). Now refused at
    start-up, naming the option; without the export, or reading from elsewhere, it runs."""
    from trainer.config import PPOConfig, check_final_exports
    from trainer.configlib import load_config
    from trainer.setup import preflight

    run = tmp_path / "run"

    def cfg(*overrides):
        return load_config(PPOConfig, "configs/demo.yaml", [f"trainer.default_local_dir={run}", "trainer.device=cpu",
                                                            *overrides])

    refused = (rf"^trainer.export_hf_at_end=true would replace {run}/(hf_actor|lora_adapter) at the end of the run, "
               rf"and this run reads '{run}/\1(/tokenizer)?' there")
    for read in (f"actor_rollout_ref.model.path={run}/hf_actor", f"data.tokenizer={run}/hf_actor/tokenizer"):
        with pytest.raises(ConfigError, match=refused):
            preflight(cfg(read))
        preflight(cfg(read, "trainer.export_hf_at_end=false"))
    preflight(cfg(f"actor_rollout_ref.model.path={tmp_path}/stage1/hf_actor"))
    # the adapters alone (a LoRA run's lora_adapter/; preflight would read the adapter, which is not there)
    adapter = f"actor_rollout_ref.model.lora_adapter_path={run}/lora_adapter"
    with pytest.raises(ConfigError, match=refused):
        check_final_exports(cfg(adapter))
    check_final_exports(cfg(adapter, "trainer.export_hf_at_end=false"))
