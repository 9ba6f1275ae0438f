"""requirements.txt's floors are what a run checks at start-up (trainer/versions.py)."""

import pytest

from rollout import generate
from tools import export_hf
from trainer import cli, launch, versions


def test_the_run_time_packages_have_floors_and_this_environment_meets_them():
    need = versions.floors()
    assert set(versions.RUNTIME) <= set(need), "each package the check reads has a floor in requirements.txt"
    assert versions.version_errors() == []


def test_release_compares_numbers_not_strings():
    assert versions.release("2.10.0+cu128") == (2, 10) == versions.release("2.10.0a0+git1234")
    assert versions.release("2.10") > versions.release("2.9.1") > versions.release("2.9")
    assert versions.release("5.0.0") == (5,) and versions.release("0.4.3") == (0, 4, 3)


def test_a_package_below_its_floor_is_named_with_the_floor():
    need = versions.floors()
    at_floor = dict(need)
    at_floor["torch"] = need["torch"] + ".0+cu128"
    assert versions.version_errors(at_floor.get) == []
    older = dict(at_floor, torch="2.6.0+cu124", transformers="4.56.0", numpy=None)  # numpy: not installed
    errors = versions.version_errors(older.get)
    assert errors == [f"torch 2.6.0+cu124 is installed, meshppo needs torch>={need['torch']} (requirements.txt; "
                      "`pip install -r requirements.txt` upgrades it)",
                      f"transformers 4.56.0 is installed, meshppo needs transformers>={need['transformers']} "
                      "(requirements.txt; `pip install -r requirements.txt` upgrades it)"]


@pytest.mark.parametrize("main", [cli.main, launch.main])
def test_the_entry_points_refuse_an_older_torch_before_reading_the_config(main, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(versions, "_installed", lambda name: "2.6.0" if name == "torch" else None)
    assert main(["--config", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshppo: environment error: torch 2.6.0 is installed, meshppo needs torch>=")
    assert "absent.yaml" not in err


@pytest.mark.parametrize("main, argv", [
    (generate.main, ["--model", "absent_model", "--prompts", "absent.jsonl", "--out", "out.jsonl", "--max-new-tokens", "4"]),
    (export_hf.main, ["absent_checkpoint", "absent_output"]),
])
def test_the_other_commands_refuse_an_older_transformers_before_reading_their_files(main, argv, monkeypatch, capsys,
                                                                                     tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(versions, "_installed", lambda name: "4.56.0" if name == "transformers" else None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshppo: environment error: transformers 4.56.0 is installed, meshppo needs transformers>=")
    assert "absent" not in err and list(tmp_path.iterdir()) == []
