"""Print a short table of benchmark JSON lines (files or stdin): `python bench/table.py OUT/*.jsonl`."""

from __future__ import annotations

import argparse
import json
import sys


def rows(paths):
    """`(where, text)` of each JSON line of the files (other lines are skipped)."""
    for path in paths:
        with open(path) as f:
            for number, text in enumerate(f, start=1):
                if text.startswith(("{", "[")):
                    yield f"{path}:{number}", text


def is_record(value) -> bool:
    """A benchmark's record (`bench.common.emit`'s), not a hand-written line of a results file (a
    note, a test's figures, a summary, a record wrapped with its variant)."""
    return isinstance(value, dict) and "benchmark" in value and "workload" in value


def peak_gib(r: dict) -> str:
    """A train or ppo_step record's peak memory, GiB: `peak_memory_gib`, or, in records written
    before that name, `peak_memory_gb` (the same bytes / 2**30; bench/rollout.py's `*_gb` are GB)."""
    return f"{r.get('peak_memory_gib', r.get('peak_memory_gb')):6.1f}GiB"


def line(r: dict) -> str:
    w = r["workload"]
    if r["benchmark"] == "train":
        fig = f"{r['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in r else f"{r['seconds'] * 1e3:.1f} ms"
        extra = (f"{r['mfu'] * 100:5.1f}%" if "mfu" in r else f"{r['tflops']:4.0f}TF" if "tflops" in r
                 else "-")  # full_logits: no FLOP count
        out = f"train    {w['model']:13} {w['variant'] + '/' + w['phase']:30} {fig:>15} {extra:>6} " + peak_gib(r)
    elif r["benchmark"] == "ppo_step":
        t = r["timing_s"]
        name = f"{w['workload']} x{w.get('world_size', 1)} {r.get('scaling_mode', '')}"
        # no MFU on CPU or on a GPU without a known peak
        mfu = f"{r['mfu_actor'] * 100:5.1f}%" if r.get("mfu_actor") is not None else "-"
        out = f"ppo_step {w['model']:13} {name:30} {r['throughput_tok_s_per_gpu']:>11,.0f} tok/s " \
              f"{mfu:>6} {peak_gib(r)} reshard " \
              f"{r['reshard_share'] * 100:.2f}% " + " ".join(f"{k.split('/')[1]}={v:.2f}" for k, v in t.items())
        sc = r.get("scaling")
        if sc and "efficiency" in sc:
            out += f"\n         weak scaling: {sc['efficiency'] * 100:.0f}% per-GPU throughput of one GPU"
        elif sc:
            out += f"\n         strong scaling: step {sc['step_speedup']:.2f}x faster; time vs one GPU: " + \
                   " ".join(f"{k}={v:.2f}" for k, v in sc["phase_time_ratio"].items())
        for phase, c in (r.get("comm_exposure") or {}).items():
            if c["nccl_ms"] > 0:
                out += f"\n         {phase:14} wall {c['wall_ms']:7.1f} ms  nccl {c['nccl_ms']:6.1f}  " \
                       f"exposed {c['exposed_nccl_ms']:6.1f} ({c['exposed_nccl_ms'] / c['wall_ms'] * 100:4.1f}%)"
    else:
        out = f"{r['benchmark']:8} {json.dumps(w)[:60]} " + " ".join(
            f"{k}={v}" for k, v in r.items() if isinstance(v, (int, float)))[:120]
    prof = r.get("profile")
    if prof:
        out += f"\n         busy {prof['gpu_busy_share'] * 100:.0f}% of {prof['wall_ms']:.0f} ms: " + \
               ", ".join(f"{k} {v:.0f}" for k, v in prof["ms_by_class"].items())
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("paths", nargs="*", default=["/dev/stdin"],
                        help="files of benchmark JSON lines (other lines, and JSON lines that are no benchmark "
                             "record, are skipped); none: stdin")
    args = parser.parse_args()
    where = "?"
    try:
        for where, text in rows(args.paths):
            value = json.loads(text)
            if is_record(value):
                print(line(value))
            else:
                print(f"bench/table.py: {where}: skipped, not a benchmark record (no 'benchmark' and 'workload')",
                      file=sys.stderr)
    except OSError as e:
        sys.exit(f"bench/table.py: {e}")
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"bench/table.py: {where}: not a benchmark record ({type(e).__name__}: {e})")
