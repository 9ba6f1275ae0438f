"""A row with media in the trainer's own dataset (built from data.image_key, video_key and audio_key, verl's
fields): the run fails at load naming the file, row and field (meshppo's models are text-only), through
the command line as tests/e2e/test_bad_input.py runs its cases (in-process, world size 1). The dataset's
own refusal is tested in tests/unit/test_data.py; this checks the trainer passes it every field."""

import pytest

from tests.e2e.conftest import demo_args
from tests.e2e.test_bad_input import BASE, _edited_rows, _run

CASES = {  # the field holding row 3's media, and the data section's keys naming it
    "images": [],
    "videos": [],
    "audios": [],
    "sounds": ["data.audio_key=sounds"],
}


@pytest.mark.parametrize("field", list(CASES))
def test_a_row_with_media_fails_the_run_at_load(field, tiny_assets, tmp_path, capsys):
    rows = _edited_rows(tiny_assets, tmp_path, **{field: [{"path": "a.wav"}]})
    args = demo_args(tiny_assets, tmp_path / "run", *BASE, f"data.train_files=[{rows}]", *CASES[field])
    code, err = _run(args, capsys)
    assert code == 1, err
    assert f"edited.jsonl:3: field '{field}' holds media: meshppo's models are text-only" in err, err
