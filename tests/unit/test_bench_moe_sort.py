"""bench/moe_sort.py's `--smoke` run on CPU (the kernel under Triton's interpreter): a record per path and size with
the fields the GPU run writes, the layer's output the same through either sort, and the refusals of bad options."""

import json
import os
import subprocess
import sys

import pytest

from tests.unit.bench_cli import smoke_refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "moe_sort.py")


def test_smoke_run_writes_a_record_per_path_and_size():
    pytest.importorskip("triton")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, BENCH, "--smoke", "--repeats", "1"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    sorts = [x for x in records if x["workload"]["kind"] == "sort"]
    layers = [x for x in records if x["workload"]["kind"] == "layer"]
    assert [(x["workload"]["pairs"], x["path"]) for x in sorts] == [(40, "torch"), (40, "triton"), (300, "torch"),
                                                                     (300, "triton")]
    assert all(x["benchmark"] == "moe_sort" and x["us_per_sort"] > 0 for x in sorts)
    assert [x["path"] for x in layers] == ["torch", "triton"] and all(x["us_per_layer"] > 0 for x in layers)
    assert layers[0]["same_output"] is None and layers[1]["same_output"] is True
    assert layers[0]["workload"]["experts"] == 8 and layers[0]["workload"]["tokens"] == 20


@pytest.mark.parametrize("args, message", [(["--smoke", "--repeats", "4"], "odd count"),
                                           (["--smoke", "--pairs", "2k"], "--pairs 2k"),
                                           (["--smoke", "--tokens", "0"], "must be positive")])
def test_bad_options_are_refused(monkeypatch, capsys, args, message):
    from bench.moe_sort import main

    assert message in smoke_refusal(monkeypatch, capsys, main, args)


def test_smoke_needs_the_interpreter(monkeypatch, capsys):
    from bench.moe_sort import main

    assert "TRITON_INTERPRET=1" in smoke_refusal(monkeypatch, capsys, main, ["--smoke"], interpreter=False)
