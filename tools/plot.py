"""Plot a run's learning curves from its `metrics.jsonl`.

    python -m tools.plot RUN_DIR [--out DIR]

Writes `reward.png` (train score and every `val/<data_source>/score`), `kl.png`
(`actor/ref_kl`, the KL to the reference that the progress bar shows, and `actor/ppo_kl`,
`actor/kl_loss`, `actor/reward_kl_penalty`), `response_length.png` and `throughput.png`
into `--out` (default: RUN_DIR). A plot whose metrics never appear is skipped. The x axis is
`step` when the lines have one, else the line number. Throughput is per GPU on a GPU run and
per rank on a CPU run (`run_info.json`, written by the trainer, says which).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data.dataset import parse_json_lines


class MetricsError(RuntimeError):
    """The metrics file is missing or unreadable."""


class PlotOutputError(RuntimeError):
    """The output directory cannot be created or a PNG cannot be written there."""


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: its file name, title, y label, and which metric keys it draws."""

    filename: str
    title: str
    ylabel: str
    selects: Callable[[str], bool]


def _one_of(*keys: str) -> Callable[[str], bool]:
    return lambda key: key in keys


_VAL_SCORE = re.compile(r"^val/.+/score$")

PLOTS = (
    PlotSpec("reward.png", "Reward", "score",
             lambda key: key == "critic/score/mean" or bool(_VAL_SCORE.match(key))),
    PlotSpec("kl.png", "KL", "KL",
             _one_of("actor/ref_kl", "actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    PlotSpec("response_length.png", "Response length", "tokens",
             _one_of("response_length/mean", "response_length/max", "response_length/min")),
    PlotSpec("throughput.png", "Throughput", "tokens / s / {worker}", _one_of("perf/throughput")),
)


def _worker(run_dir: str) -> str:
    """What `perf/throughput` is counted per: "GPU" on CUDA runs, "CPU rank" on CPU runs, and
    "rank" when the run directory does not say (no readable `run_info.json`)."""
    try:
        with open(os.path.join(run_dir, "run_info.json")) as f:
            device = json.load(f).get("device")
    except (OSError, ValueError, AttributeError):
        return "rank"
    return {"cuda": "GPU", "cpu": "CPU rank"}.get(device, "rank")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects in a metrics file, one per line.

    A malformed last line is dropped, because a run killed mid-write leaves one; a
    malformed line elsewhere raises `MetricsError` naming the line.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MetricsError(f"metrics file not found: {path}")
    return [record for _, record in parse_json_lines(path, MetricsError, skip_blank=True, drop_truncated_tail=True)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for lineno, record in enumerate(records, start=1):
        value = record.get(key)
        # Booleans are JSON numbers to Python but never a curve; NaN/inf would break the axes.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        step = record.get("step", lineno)
        xs.append(step if isinstance(step, (int, float)) and not isinstance(step, bool) else lineno)
        ys.append(float(value))
    return xs, ys


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[str]:
    """Write the PNGs for `run_dir/metrics.jsonl` into `out_dir` (default `run_dir`).

    Returns the paths written, in `PLOTS` order. Raises `MetricsError` when the metrics cannot
    be read and `PlotOutputError` when the PNGs cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes; also keeps tests headless
    import matplotlib.pyplot as plt

    run_dir = os.fspath(run_dir)
    out_dir = os.fspath(out_dir) if out_dir is not None else run_dir
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    keys = sorted({key for record in records for key in record})
    try:
        os.makedirs(out_dir, exist_ok=True)
    except FileExistsError as err:  # exist_ok covers directories only
        raise PlotOutputError(f"cannot write plots to {out_dir}: it is a file, not a directory") from err
    except OSError as err:  # e.g. a parent that is a file, or no permission
        raise PlotOutputError(f"cannot write plots to {out_dir}: {err.strerror or err}") from err
    written = []
    for spec in PLOTS:
        series = {key: _series(records, key) for key in keys if spec.selects(key)}
        series = {key: xy for key, xy in series.items() if xy[0]}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for key, (xs, ys) in series.items():
            # Markers keep sparse series (validation every N steps, short runs) readable.
            ax.plot(xs, ys, label=key, marker="o" if len(xs) <= 30 else None, markersize=3)
        ax.set_title(f"{spec.title} — {os.path.basename(os.path.abspath(run_dir))}")
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel.format(worker=_worker(run_dir)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(out_dir, spec.filename)
        try:
            fig.savefig(path)
        except OSError as err:
            raise PlotOutputError(f"cannot write {path}: {err.strerror or err}") from err
        finally:
            plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1 when there is nothing to plot or it cannot be written)."""
    parser = argparse.ArgumentParser(prog="python -m tools.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory containing metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except (MetricsError, PlotOutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not written:
        print(f"error: no plottable metrics in {os.path.join(args.run_dir, 'metrics.jsonl')}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
