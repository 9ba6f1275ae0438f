"""Run Triton kernel checks on CPU under `TRITON_INTERPRET=1`, in a child process.

The variable must be set before triton is imported and changes every later `@triton.jit` in
the process, so a test file runs itself as a script in a child (`report(__file__)`), the
child runs its checks (`main(checks)`) and prints a JSON report, and the tests read it
(`tests(__file__, CHECKS)`: one test per check, one child run per file): nothing leaks into the
pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARKER = "TRITON_REPORT "


def report(test_file: str) -> dict:
    """Run `test_file` as a script under the interpreter; its report: {check: {"ok", "err" | "error", "s"}}."""
    import pytest

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, test_file], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARKER)]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(_MARKER):])


def tests(test_file: str, checks: list[str]):
    """The pytest side of a file's checks, to bind at module level:
    `interpreter_report, test_x = interpreter.tests(__file__, CHECKS)` (a module-scoped fixture
    running the child once, and one test per check that fails with the check's error)."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_report():
        return report(test_file)

    @pytest.mark.parametrize("check", checks)
    def test_check(interpreter_report, check):
        result = interpreter_report[check]
        assert result["ok"], result.get("error")

    return interpreter_report, test_check


def main(checks: dict) -> None:
    """In the child: run each named check (returns its max error) and print the report."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    out = {}
    for name, check in checks.items():
        t0 = time.perf_counter()
        try:
            out[name] = {"ok": True, "err": check(), "s": time.perf_counter() - t0}
        except Exception as e:  # reported to the parent test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    print(_MARKER + json.dumps(out), flush=True)
