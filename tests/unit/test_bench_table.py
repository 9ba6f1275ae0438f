"""`bench/table.py`, the short table of benchmark JSON lines: its command line and its rows."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "bench", "table.py")


def _table(*args, stdin=""):
    return subprocess.run([sys.executable, TABLE, *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_help_files_stdin_and_a_missing_file(tmp_path):
    r = _table("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: table.py") and "benchmark JSON lines" in r.stdout
    record = {"benchmark": "reshard", "workload": {"model": "tiny"}, "ms_per_gb": 0.88, "note": "x"}
    out = tmp_path / "out.jsonl"
    out.write_text("a banner line\n" + json.dumps(record) + "\n")
    expected = 'reshard  {"model": "tiny"} ms_per_gb=0.88\n'
    assert _table(str(out)).stdout == expected
    assert _table(stdin=json.dumps(record) + "\n").stdout == expected
    r = _table(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 1 and r.stderr.startswith("bench/table.py: [Errno 2] No such file or directory")
    # a record of the wrong shape (a train record whose figure is text), or a line that is not JSON
    for text, error in (('{"benchmark": "train", "workload": {"model": "m", "variant": "v", "phase": "p"}, '
                         '"tokens_per_s": "x", "peak_memory_gb": 1}', "ValueError"), ("{oops", "JSONDecodeError")):
        out.write_text(json.dumps(record) + "\n" + text + "\n")
        r = _table(str(out))
        assert r.returncode == 1 and r.stdout == expected, r
        assert r.stderr.startswith(f"bench/table.py: {out}:2: not a benchmark record ({error}") and "Traceback" not in r.stderr
