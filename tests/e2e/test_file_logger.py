"""verl's file logger (trainer.logger=file) in a real run: the trainer's rows, laid out as verl's, resumed."""

import json

from tests.e2e.conftest import read_metrics
from tests.e2e.test_resume import _main


def test_file_logger_holds_the_runs_rows_and_keeps_them_on_a_resume(tiny_assets, tmp_path, monkeypatch, capsys):
    """A 2-step run validated at the start and the end logs the rows of metrics.jsonl to the file logger's file
    as {"step": s, "data": {metrics}}; a run extended to 3 steps resumes at step 2 and keeps them (verl's
    file logger empties its file at every start)."""
    path = tmp_path / "verl_logs" / "m.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    run = tmp_path / "a" / "run"

    def file_rows():
        return [{"step": r["step"], **r["data"]} for r in map(json.loads, path.read_text().splitlines())]

    code, err = _main(tiny_assets, run, capsys, "trainer.logger=[jsonl,file]", "trainer.val_before_train=true",
                      "trainer.test_freq=2")
    assert code == 0, err
    assert f"file logger: {path} (VERL_FILE_LOGGER_PATH; a fresh start: emptied)" in err
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and file_rows() == rows
    code, err = _main(tiny_assets, run, capsys, "trainer.logger=[jsonl,file]", "trainer.total_training_steps=3")
    assert code == 0, err
    assert "resumed: the rows of steps up to 2 kept" in err
    resumed = read_metrics(run)
    assert resumed[:4] == rows and [r["step"] for r in resumed] == [0, 1, 2, 2, 3] and file_rows() == resumed
