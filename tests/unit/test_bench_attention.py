"""bench/attention.py's `--smoke` run on CPU (the Triton kernels under the interpreter): one record a path with the
figures the GPU run writes, the Triton path's output the explicit path's, and the refusals of options it would
misreport."""

import json
import os
import subprocess
import sys

import pytest

from tests.unit.bench_cli import smoke_refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "attention.py")


def _run(*args):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300, env=env)


def test_smoke_run_writes_a_record_per_path():
    pytest.importorskip("triton")
    r = _run("--smoke", "--repeats", "1", "--window", "9")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["path"] for x in records] == ["explicit", "triton", "flash"]
    for x in records:
        assert x["benchmark"] == "attention" and x["workload"]["tokens"] == 64 and x["workload"]["window"] == 9
        assert x["seconds"] > 0 and x["oom"] is False and x["peak_memory_gib"] is None  # no CUDA: no peak
        # 4 sequences of 16: [4, heads 4, 16, 16] float32 scores and probabilities
        assert x["explicit_score_gib"] * 2 ** 30 == 2 * 4 * 4 * 4 * 16 * 16
    assert 0 < records[1]["max_abs_diff_vs_explicit"] < 1e-4  # float32 rounding apart, the same attention


@pytest.mark.parametrize("args, message", [(["--smoke", "--repeats", "2"], "odd count"),
                                           (["--smoke", "--paths", "triton,sdpa"], "--paths triton,sdpa"),
                                           (["--smoke", "--tokens", "2k"], "--tokens 2k"),
                                           (["--smoke", "--tokens", "66"], "multiple of --sequences 4")])
def test_bad_options_are_refused(monkeypatch, capsys, args, message):
    from bench.attention import main

    assert message in smoke_refusal(monkeypatch, capsys, main, args)


def test_smoke_needs_the_interpreter(monkeypatch, capsys):
    from bench.attention import main

    assert "TRITON_INTERPRET=1" in smoke_refusal(monkeypatch, capsys, main, ["--smoke"], interpreter=False)
