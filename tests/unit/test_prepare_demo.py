"""tools.prepare_demo: when an existing OUT is up to date, and which options are refused."""

import json
import os

import pytest

pytest.importorskip("transformers")

from tools.prepare_demo import DEFAULTS, STAMP, main, missing_assets, why_out_of_date  # noqa: E402

# A build of a few seconds: 8-wide, one layer, two warm-up steps on 12 of the 100 problems.
TINY = ["--n-train", "8", "--n-val", "4", "--max-value", "9", "--hidden", "8", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--sft-max-steps", "2", "--sft-batch", "4"]
ASSETS = ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "train.jsonl", "val.jsonl",
          "sft_model/config.json", "sft_model/tokenizer.json", "sft_model/tokenizer_config.json",
          "sft_model/model.safetensors"]


def _fake_out(out, settings=DEFAULTS):
    """An OUT with every asset (empty files) and a stamp of `settings`."""
    for name in ASSETS:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("")
    (out / STAMP).write_text(json.dumps(settings))
    return out


def test_complete_out_with_a_matching_stamp_is_up_to_date(tmp_path):
    out = str(_fake_out(tmp_path))
    assert missing_assets(out) == [] and why_out_of_date(out, dict(DEFAULTS)) is None
    assert why_out_of_date(out, dict(DEFAULTS, seed=1)) == "built with other settings"
    assert why_out_of_date(str(tmp_path / "nowhere"), dict(DEFAULTS)) == "not built yet"


@pytest.mark.parametrize("asset", ASSETS)
def test_a_missing_asset_makes_out_out_of_date(tmp_path, asset):
    out = _fake_out(tmp_path)
    os.remove(out / asset)
    reported = "sft_model/*.safetensors" if asset.endswith(".safetensors") else asset
    missing = os.path.join(str(out), *reported.split("/"))
    assert missing_assets(str(out)) == [missing]
    assert why_out_of_date(str(out), dict(DEFAULTS)) == f"incomplete (missing {missing})"


def test_a_deleted_model_or_prompt_file_is_out_of_date(tmp_path):
    import shutil

    out = _fake_out(tmp_path)
    shutil.rmtree(out / "sft_model")
    os.remove(out / "train.jsonl")
    assert why_out_of_date(str(out), dict(DEFAULTS)).startswith(
        f"incomplete (missing {out / 'train.jsonl'}, {out / 'sft_model' / 'config.json'}, ")


@pytest.mark.parametrize("stamp", ["", '{"seed": 0', "\xff\xfe"])
def test_an_empty_or_corrupt_stamp_is_out_of_date(tmp_path, stamp):
    out = _fake_out(tmp_path)
    (out / STAMP).write_bytes(stamp.encode("latin-1"))
    assert why_out_of_date(str(out), dict(DEFAULTS)).startswith(f"unreadable stamp {out / STAMP} (")


def test_deleted_asset_and_corrupt_stamp_are_rebuilt(tmp_path, capsys):
    out = tmp_path / "assets"
    assert main(["--out", str(out), *TINY]) == 0
    assert missing_assets(str(out)) == [] and not (out / (STAMP + ".tmp")).exists()
    stamp = json.loads((out / STAMP).read_text())
    assert stamp["hidden"] == 8 and stamp["n_train"] == 8
    assert main(["--out", str(out), *TINY]) == 0
    assert "are up to date" in capsys.readouterr().out

    os.remove(out / "sft_model" / "model.safetensors")
    assert main(["--out", str(out), *TINY]) == 0
    assert "incomplete (missing " in capsys.readouterr().out and (out / "sft_model" / "model.safetensors").is_file()

    (out / STAMP).write_text("")
    assert main(["--out", str(out), *TINY]) == 0
    assert "unreadable stamp" in capsys.readouterr().out and json.loads((out / STAMP).read_text()) == stamp


@pytest.mark.parametrize("args, message", [
    (["--n-train", "0"], "--n-train must be at least 1, got 0"),
    (["--n-val", "0"], "--n-val must be at least 1, got 0"),
    (["--hidden", "10"], "--hidden 10 must be a multiple of 2 x --heads 4 (an even head width)"),
    (["--hidden", "12"], "--hidden 12 must be a multiple of 2 x --heads 4 (an even head width)"),
    (["--heads", "4", "--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--sft-max-steps", "-1"], "--sft-max-steps must be at least 0, got -1"),
    (["--max-value", "9", "--n-train", "90", "--n-val", "20"],
     "--n-train + --n-val = 110 exceeds the 100 distinct problems with operands up to --max-value 9"),
])
def test_bad_options_exit_2_before_writing(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path / "assets"), *args])
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "assets").exists()


def test_out_that_is_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path / "afile")])
    assert err.value.code == 2 and f"--out={tmp_path / 'afile'} is a file" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
