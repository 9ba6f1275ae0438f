"""`bench/table.py`, the short table of benchmark JSON lines: its command line and its rows."""

import json
import os
import re
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


def _train_record(**figures):
    return {"benchmark": "train", "workload": {"model": "m", "variant": "base", "phase": "actor_update"},
            "tokens_per_s": 1000.0, "mfu": 0.5, **figures}


def _ppo_step_record(**figures):
    return {"benchmark": "ppo_step", "workload": {"model": "m", "workload": "grpo", "world_size": 1},
            "throughput_tok_s_per_gpu": 1000.0, "timing_s": {"timing_s/step": 1.0}, "reshard_share": 0.0,
            "mfu_actor": 0.25, **figures}


def test_peak_memory_is_labelled_in_the_unit_the_record_holds(tmp_path):
    """bench/train.py and bench/ppo_step.py measure GiB (bytes / 2**30, the trainer's verl-named
    `actor/perf/max_memory_allocated_gb` included): the table said GB. Records before the rename carry
    the same GiB under `peak_memory_gb`."""
    out = tmp_path / "out.jsonl"
    records = [_train_record(peak_memory_gib=50.3666), _train_record(peak_memory_gb=57.2025),
               _ppo_step_record(peak_memory_gib=31.74), _ppo_step_record(peak_memory_gb=25.25)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = _table(str(out)).stdout.splitlines()
    assert [re.findall(r"[\d.]+Gi?B", line) for line in lines] == [["50.4GiB"], ["57.2GiB"], ["31.7GiB"],
                                                                     ["25.2GiB"]], lines


def test_memory_fields_are_named_for_their_unit():
    """Every figure the benches record: a `*_gb` field is bytes / 1e9, a `*_gib` field bytes / 2**30
    (the trainer's `actor/perf/*_gb` peaks are GiB, verl's names)."""
    import ast
    import glob

    for path in glob.glob(os.path.join(ROOT, "bench", "*.py")):
        source = open(path).read()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.keyword) or node.arg is None:
                continue
            value = ast.get_source_segment(source, node.value).replace(" ", "")
            gib = "2**30" in value or "perf/max_memory" in value
            if node.arg.endswith("_gb"):
                assert not gib, (path, node.arg, value)
            if node.arg.endswith("_gib"):
                assert gib and "1e9" not in value, (path, node.arg, value)


def test_an_absent_figure_is_a_dash_not_zero():
    """A train record without MFU or TFLOP/s (the full-logits variant) printed 0TF, and a ppo_step
    record without an MFU (CPU, or a GPU without a listed peak) 0.0%."""
    full_logits = {**_train_record(peak_memory_gib=3.0), "workload": {"model": "m", "variant": "full_logits",
                                                                      "phase": "forward_logprob"}}
    del full_logits["mfu"]
    cpu_step = _ppo_step_record(peak_memory_gib=1.0, mfu_actor=None)
    r = _table(stdin="".join(json.dumps(rec) + "\n" for rec in (full_logits, cpu_step)))
    assert r.returncode == 0, r.stderr
    train, step = r.stdout.splitlines()
    assert train.split()[-2:] == ["-", "3.0GiB"] and "TF" not in train, train
    after_throughput = step.split("tok/s")[1].split()
    assert after_throughput[:3] == ["-", "1.0GiB", "reshard"], step


def test_lines_that_are_no_benchmark_record_are_skipped_with_a_note(tmp_path):
    """Committed result files mix records with hand-written lines (a note, a test's figures, a
    summary, a record wrapped with its variant): the table refused the whole file at the first."""
    out = tmp_path / "out.jsonl"
    lines = [json.dumps({"note": "tree abc"}), json.dumps(_train_record(peak_memory_gib=1.0)),
             json.dumps({"variant": "old", "record": _train_record(peak_memory_gib=2.0)}),
             json.dumps({"benchmark": "rollout_eos", "generated_tok_per_s": 91572.6}), json.dumps([1, 2])]
    out.write_text("\n".join(lines) + "\n")
    r = _table(str(out))
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "1.0GiB" in r.stdout, r
    assert r.stderr.splitlines() == [f"bench/table.py: {out}:{n}: skipped, not a benchmark record (no "
                                     f"'benchmark' and 'workload')" for n in (1, 3, 4, 5)], r.stderr


def test_every_committed_result_file_is_read():
    import glob

    r = _table(*sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.jsonl"))))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stdout.splitlines()) > 100
