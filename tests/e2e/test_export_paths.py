"""`python -m tools.export_hf` from another working directory than the run's: a run started with
relative model and tokenizer paths (`actor_rollout_ref.model.path=assets/sft_model`, as the shipped
configs and `make demo` give them) is exported from its model as the run read it. The export
resolved the stored relative paths against its own working directory instead, so it failed with
"tokenizer directory 'assets/sft_model' does not exist" (or read another directory of that name)."""

import os
import shutil

import pytest
from safetensors.torch import load_file

from tests.e2e.conftest import ROOT
from tests.e2e.test_resume import BASE
from trainer import cli

DEMO = os.path.join(ROOT, "configs", "demo.yaml")


@pytest.fixture(scope="module")
def relative_run(tiny_assets, tmp_path_factory):
    """One step of the demo recipe (world size 1, the untrained tiny model) started in its own directory
    with every path relative to it; returns that directory."""
    here = tmp_path_factory.mktemp("relative")
    shutil.copytree(tiny_assets, here / "assets")
    cwd = os.getcwd()
    os.chdir(here)
    try:
        code = cli.main(["--config", DEMO, "data.train_files=[assets/train.jsonl]", "data.val_files=[]",
                         "actor_rollout_ref.model.path=assets/sft_model", "trainer.default_local_dir=run",
                         "trainer.logger=[jsonl]", *BASE, "trainer.total_training_steps=1",
                         "trainer.export_hf_at_end=true"])
    finally:
        os.chdir(cwd)
    assert code == 0
    return here


def test_export_from_another_directory_reads_the_runs_model(relative_run, tmp_path, monkeypatch, capsys):
    from tools import export_hf

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out"
    assert export_hf.main([str(relative_run / "run" / "checkpoints"), str(out)]) == 0, capsys.readouterr().err
    # the trainer's own export of the same step, made in the run's directory
    ours, theirs = load_file(out / "model.safetensors"), load_file(relative_run / "run" / "hf_actor" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].equal(theirs[k]) for k in ours)
    assert (out / "tokenizer.json").read_bytes() == (relative_run / "assets" / "sft_model" / "tokenizer.json").read_bytes()
    # an OUTPUT named relatively is the working directory's, as any path on the command line
    assert export_hf.main([str(relative_run / "run" / "checkpoints"), "rel_out"]) == 0, capsys.readouterr().err
    assert (elsewhere / "rel_out" / "model.safetensors").is_file()
