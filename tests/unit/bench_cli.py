"""Shared by the tests of the benchmarks' `--smoke` command lines (bench/attention.py, bench/moe_sort.py)."""

import pytest


def smoke_refusal(monkeypatch, capsys, main, args, interpreter: bool = True) -> str:
    """The usage error `main(args)` exits with (argparse's code 2), Triton's interpreter on (TRITON_INTERPRET=1) or
    off: its stderr."""
    if interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    return capsys.readouterr().err
