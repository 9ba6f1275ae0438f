"""Metric sinks: console progress bar, `metrics.jsonl`, verl's file logger, TensorBoard, Weights &
Biases; the run directory's record of the run (`config.yaml`, `run_info.json`, the start-up banner)
and the per-step sample dumps (verl's `trainer.rollout_data_dir` / `validation_data_dir`).

A resumed run logs to the wandb run of its first start (its id in the run directory's `wandb_run_id`).

Only rank 0 logs. `metrics.jsonl` gets one JSON object per step (verl's metric names), and a
validated step a second one at the same step with its validation's metrics; it is appended to, so
a resumed run continues the same file; when a run (re)starts at step S, lines of later steps
(logged by an attempt that ended before its next checkpoint) are dropped, so that the file holds
each step's rows once. A saving step's row is written (synced to the disk) before its checkpoint
is put in place, so every step up to the one a run resumes from has its row. verl's file logger
(`file_logger_path`: `{"step": s, "data": {metrics}}` lines) is kept the same way.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.errors import UserError


class Timer:
    """Wall-clock phase timer: `with timer("gen"): ...` -> `timing_s/gen`.

    On CUDA the device is synchronised at both ends so the time covers the queued work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}
        # what else each phase runs in: the step profiler's capture (`trainer.profiling.StepProfiler.phase`)
        self.around: Callable[[str], AbstractContextManager] = lambda name: nullcontext()

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            # A profiler range per phase: bench/ppo_step.py --profile attributes kernels to phases.
            with self.around(name), torch.profiler.record_function(f"phase:{name}"):
                yield
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except BaseException as e:
            # The innermost phase an error left (a timed-out collective is reported with it).
            if not hasattr(e, "meshppo_phase"):
                e.meshppo_phase = name
            raise
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere (the engine's graph capture) as `timing_s/<name>`."""
        self.times[name] = self.times.get(name, 0.0) + seconds

    def set(self, name: str, seconds: float) -> None:
        """`timing_s/<name>` is `seconds`, a figure of the step's last generation (verl's `agent_loop/*`)."""
        self.times[name] = seconds

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out


class PeakMemory:
    """The CUDA peak-memory counters, split at the end of each generation.

    `since_split_gb()` is the peak since the last generation (the update phase: log-probs,
    values, updates); `step_gb()` is the peak over everything since the previous `step_gb()`
    (generation included: the peaks seen at each split are kept), and starts the next step's
    count. CPU has no resettable counter: `split` does nothing there.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.earlier = (0, 0)  # allocated, reserved bytes: peaks before the last split of this step

    def split(self) -> None:
        if self.device.type == "cuda":
            self.earlier = tuple(max(a, b) for a, b in zip(self.earlier, self._peaks()))
            torch.cuda.reset_peak_memory_stats(self.device)

    def since_split_gb(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def step_gb(self) -> tuple[float, float]:
        """(allocated, reserved) peaks of the step in GiB; resets the counters."""
        allocated, reserved = (max(a, b) for a, b in zip(self.earlier, self._peaks()))
        self.earlier = (0, 0)
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated / 2**30, reserved / 2**30

    def _peaks(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def _git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=9", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_info(device: torch.device, world_size: int, local_world_size: int, dims, run_dir: str, step: int,
             ulysses: dict[str, int] | None = None) -> dict:
    """What a bug report needs about a run: versions, the world layout and the run directory.

    `dims` is the run's `sharding.mesh.ParallelDims`; `step` the step the run starts from;
    `ulysses` the roles' Ulysses group sizes above 1."""
    cuda = torch.version.cuda if device.type == "cuda" else None
    nccl = None
    if device.type == "cuda":
        try:
            v = torch.cuda.nccl.version()  # a tuple; an int in older torch
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError):
            nccl = "unavailable"
    return {
        "meshppo": _git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "cuda": cuda, "nccl": nccl,
        "device": device.type, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "world_size": world_size, "nodes": world_size // local_world_size, "ranks_per_node": local_world_size,
        "fsdp": "HYBRID_SHARD" if dims.hsdp else "FULL_SHARD", "dp_shard": dims.dp_shard,
        "dp_replicate": dims.dp_replicate, "tp": dims.tp, "rollout_dp": dims.rollout_dp,
        "ulysses": dict(ulysses or {}), "run_dir": os.path.abspath(run_dir), "start_step": step,
    }


def banner(info: dict) -> str:
    """The start-up banner: three lines from `run_info`."""
    gpu = f" ({info['gpu']})" if info["gpu"] else ""
    accel = (f"CUDA {info['cuda']}, NCCL {info['nccl']}" if info["device"] == "cuda" else "CPU (no CUDA)")
    start = f"resumed at step {info['start_step']}" if info["start_step"] else "fresh start"
    def count(n, what):
        return f"{n} {what}" + ("" if n == 1 else "s")

    if info["dp_shard"] == 1:  # nothing sharded: every rank holds the whole model (sharding.replicate)
        training = f"unsharded, {count(info['dp_replicate'], 'replica')}"
    else:
        replicate = f" x {info['dp_replicate']} replicas" if info["fsdp"] == "HYBRID_SHARD" else ""
        training = f"{info['fsdp']} over {count(info['dp_shard'], 'rank')}{replicate}"
    if info.get("ulysses"):
        training += ", Ulysses groups: " + ", ".join(f"{role} {n}" for role, n in info["ulysses"].items())

    return "\n".join([
        f"meshppo {info['meshppo']} | torch {info['torch']} | {accel} | python {info['python']}",
        f"world: {count(info['world_size'], 'rank')} = {count(info['nodes'], 'node')} x {info['ranks_per_node']}, "
        f"{info['device']}{gpu}, {info['backend']} | training: {training} | generation: TP {info['tp']} x "
        f"{count(info['rollout_dp'], 'engine replica')}",
        f"run directory: {info['run_dir']} ({start})",
    ])


def dump_value(v: Any) -> Any:
    """`v` as the sample dumps write it, as plain JSON data (a dump is for reading, so nothing in
    it stops a run): a tensor or NumPy value as its number or list, a NaN as null and an
    infinity as +-1e308, an object json does not know (inside a list or dict too) as its `str()`,
    and a value json cannot write at all (a dict with tuple keys, a NaN inside a list, a cycle)
    as its `str()`."""
    if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
        v = v.tolist()
    v = _jsonable(v)
    if v is None or isinstance(v, (str, int, float)):
        return v
    try:
        return json.loads(json.dumps(v, ensure_ascii=False, allow_nan=False, default=str))
    except (TypeError, ValueError):
        return str(v)


def dump_generations(dump_dir: str, step: int, rows: list[dict]) -> str:
    """Write one step's samples as `DUMP_DIR/{step}.jsonl` (verl's layout: one JSON object per
    sample with `input`, `output`, `gts`, `score`, `step` and more; each value as `dump_value`
    writes it); returns the path. Every line is made before the file is opened, and the file
    replaces any earlier one whole."""
    lines = [json.dumps({k: dump_value(v) for k, v in row.items()}, ensure_ascii=False) + "\n" for row in rows]
    path = os.path.join(dump_dir, f"{step}.jsonl")
    tmp = path + ".tmp"
    with _written(path):
        os.makedirs(dump_dir, exist_ok=True)
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    return path


def generations_text(samples: list[tuple[str, str, float]], step: int) -> str:
    """A validation's samples as the Markdown of TensorBoard's text tab: each sample's prompt, response
    and score."""
    parts = [f"**Validation generations, step {step}**"]
    for i, (prompt, response, score) in enumerate(samples, 1):
        parts.append(f"### Sample {i}\n\n**Input:** {prompt}\n\n**Output:** {response}\n\n**Score:** {score}")
    return "\n\n---\n\n".join(parts)


def file_logger_path(project: str, experiment: str) -> tuple[Path, str]:
    """Where verl's file logger (`trainer.logger=file`) writes, as an absolute path, and where that
    comes from (for messages): `$VERL_FILE_LOGGER_PATH` when set, else `$VERL_FILE_LOGGER_ROOT`
    (default ".") `/<project>/<experiment>.jsonl`, `~` expanded in either (verl expands it in the
    root only); a relative path is from the working directory, as in verl. An empty variable is an
    unset one."""
    path = os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return Path(os.path.abspath(os.path.expanduser(path))), "VERL_FILE_LOGGER_PATH"
    root = os.environ.get("VERL_FILE_LOGGER_ROOT")
    where = os.path.join(os.path.expanduser(root or "."), project, f"{experiment}.jsonl")
    source = ("VERL_FILE_LOGGER_ROOT/" if root else "") + "<project_name>/<experiment_name>.jsonl"
    return Path(os.path.abspath(where)), source


def _keep_rows_up_to(path: Path, step: int, what: str) -> None:
    """Rewrite the JSON-lines log `path` (each line an object with its `step`) with the lines of
    steps up to `step` only: a run resumed at `step` redoes the later ones, logged by an attempt
    that ended before its next checkpoint; a fresh start (`step` 0) keeps none. A torn last line
    (a killed attempt's) goes too. The file is replaced whole; a failure is a UserError naming `what`."""
    with _written(what):
        kept = []
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if step > 0 and isinstance(row, dict) and row.get("step", step + 1) <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


def _append_line(path: Path, line: str, what: str) -> None:
    """Append `line` to `path`, on the disk before this returns: the trainer logs a step's row before
    it puts the checkpoint of the step in place, so a run resumed from it (after a crash of the node,
    too) finds the row. A failure is a UserError naming `what`."""
    from trainer.checkpointing import flush_to_disk  # (DCP, FSDP: not for preflight's file_logger_path)

    with _written(what), open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        flush_to_disk(f)


# The run directory's file naming its wandb run: a resumed run logs to the same wandb run.
WANDB_RUN_ID = "wandb_run_id"


def _tensorboard_writer(run_dir: Path, step: int):
    """TensorBoard's writer of a run starting at `step`, in verl's TENSORBOARD_DIR, else the run
    directory's. As `metrics.jsonl`, the events of steps after `step` (a killed attempt's) go, and on
    a fresh start every earlier run's."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("trainer.logger includes tensorboard but the tensorboard package is not installed: pip "
                        "install tensorboard, or remove it from trainer.logger") from None
    log_dir = os.environ.get("TENSORBOARD_DIR") or str(run_dir / "tensorboard")
    with _written(log_dir):
        return SummaryWriter(log_dir=log_dir, purge_step=step + 1 if step else 0)


def _wandb_run(init: dict, proxy: str | None = None):
    """`wandb.init(**init)`, through the https proxy `proxy` (`trainer.wandb_proxy`: verl's
    `wandb.Settings(https_proxy=...)`) when given; what it raises (no login, a refused project, a
    network or disk error: wandb's own exception classes, which vary by version) is a UserError naming
    `trainer.logger`, and a proxy wandb refuses one naming `trainer.wandb_proxy`."""
    try:
        import wandb
    except ImportError:
        raise UserError("trainer.logger includes wandb but wandb is not installed: pip install wandb, or remove "
                        "it from trainer.logger") from None
    if proxy:
        try:
            init = {**init, "settings": wandb.Settings(https_proxy=proxy)}
        except Exception as e:  # wandb checks the URL (pydantic's ValidationError in recent versions)
            errors = getattr(e, "errors", None)
            why = errors()[0].get("msg", e) if callable(errors) else e
            raise UserError(f"trainer.wandb_proxy={proxy!r}: wandb does not take it as its https proxy ({why}); give "
                            "a URL such as http://proxy:3128") from None
    # Clusters without outbound network still get a run directory to `wandb sync` later.
    os.environ.setdefault("WANDB_MODE", "offline")
    try:
        return wandb.init(**init)
    except Exception as e:  # whatever stops the wandb run's start is this one error
        raise UserError(f"trainer.logger includes wandb but starting its run failed ({type(e).__name__}: {e}); "
                        "fix wandb's settings (WANDB_MODE, login, project) or remove wandb from "
                        "trainer.logger") from None


@contextmanager
def _written(path) -> Iterator[None]:
    """A write of `path` whose OSError (a full disk, a quota, permissions) is a UserError naming it:
    one line from `run`, not a traceback."""
    try:
        yield
    except OSError as e:
        raise UserError(f"writing {path} failed ({e.strerror or e})") from None


class Tracking:
    """The run's metric sinks (`trainer.logger`). Making one writes nothing: every write of the run's
    start (the run directory, TensorBoard's writer, the wandb run, `config.yaml`, `run_info.json`)
    is in `begin`, which the trainer agrees on every rank as it does each step's row."""

    def __init__(self, loggers: list[str], run_dir: str, project: str, experiment: str, config: dict,
                 total_steps: int, enabled: bool):
        self.enabled = enabled
        self.loggers = list(loggers)
        self.run_dir = Path(run_dir)
        self._wandb_init = dict(project=project, name=experiment, config=config)
        self._wandb_proxy = config.get("trainer", {}).get("wandb_proxy")
        self._val_only = bool(config.get("trainer", {}).get("val_only"))
        self._tb = self._wandb = self._bar = self._bar_total = self._file = None
        self._generations: list[tuple[str, str, float]] = []  # queued for the next row (`queue_generations`)
        self._generation_rows: list[list] = []  # the wandb table's rows, one a validation (verl's)
        if not enabled:
            return
        if "file" in loggers:  # read here, written from `begin` on
            self._file = file_logger_path(project, experiment)
        # The console's progress bar is drawn from `begin` on: an error found while the run starts
        # (its checkpoint, its data) is then a line of its own, not one glued to the bar.
        self._bar_total = total_steps if "console" in loggers else None

    def begin(self, step: int, resolved_config: str, info: dict) -> None:
        """The run starts at `step` (0, or the resumed step): keep `metrics.jsonl` lines up to
        it only (none on a fresh start), open TensorBoard's writer and the wandb run (a resumed
        run's earlier one, `_wandb_continued`; its id kept in `WANDB_RUN_ID`), save the
        resolved config (`config.yaml`, loadable with `--config`) and `run_info.json`, and print
        the banner. A failure is a UserError naming what failed."""
        if not self.enabled:
            return
        with _written(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = self.run_dir / "metrics.jsonl"
        if "jsonl" in self.loggers and metrics.is_file():
            _keep_rows_up_to(metrics, step, str(metrics))
        if self._file is not None:  # verl's file logger: its file is made (truncated, on a fresh start) here
            with _written(self._file_what):
                if not self._file[0].parent.exists():  # (a file there: the write says "Not a directory")
                    self._file[0].parent.mkdir(parents=True, exist_ok=True)
            _keep_rows_up_to(self._file[0], step, self._file_what)
        if "tensorboard" in self.loggers:
            self._tb = _tensorboard_writer(self.run_dir, step)
        for name, text in (("config.yaml", resolved_config), ("run_info.json", json.dumps(info, indent=1))):
            with _written(self.run_dir / name):
                (self.run_dir / name).write_text(text + "\n")
        if "wandb" in self.loggers:
            # wandb's files under the run directory, unless WANDB_DIR (wandb's own variable, which verl's run
            # honours) says where: wandb.init's dir would override it
            where = {} if os.environ.get("WANDB_DIR") else {"dir": str(self.run_dir)}
            self._wandb = _wandb_run({**self._wandb_init, **where, **self._wandb_continued(step)}, self._wandb_proxy)
            if not self._val_only:
                with _written(self.run_dir / WANDB_RUN_ID):
                    (self.run_dir / WANDB_RUN_ID).write_text(self._wandb.id + "\n")
        if self._bar_total is not None:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=self._bar_total, initial=step, desc="ppo", dynamic_ncols=True,
                                 file=sys.stderr)
            except ImportError:
                self._bar = None
        self.message(banner(info))
        if self._file is not None:  # (verl prints "Creating file logger at <path>")
            kept = f"resumed: the rows of steps up to {step} kept" if step else "a fresh start: emptied"
            self.message(f"file logger: {self._file[0]} ({self._file[1]}; {kept})")

    @property
    def _file_what(self) -> str:
        """The file logger's file as messages name it: its path and where that comes from."""
        return f"{self._file[0]} (trainer.logger=file, {self._file[1]})"

    def _wandb_continued(self, step: int) -> dict:
        """`wandb.init`'s arguments that continue this run's wandb run: a run resumed at `step` > 0 takes the
        id its earlier start stored in the run directory (`WANDB_RUN_ID`), with resume="allow"; a fresh start
        (or a run directory without the file) starts a new wandb run. So does a `trainer.val_only` run, leaving
        the file as it is: its row is at a step the training's wandb run holds already, which wandb drops
        (its steps only increase)."""
        path = self.run_dir / WANDB_RUN_ID
        run_id = path.read_text().strip() if step > 0 and path.is_file() and not self._val_only else ""
        return {"id": run_id, "resume": "allow"} if run_id else {}

    def log(self, metrics: dict, step: int):
        if not self.enabled:
            return
        values = {k: _jsonable(v) for k, v in metrics.items()}
        row = {"step": step, **values}
        if "jsonl" in self.loggers:
            path = self.run_dir / "metrics.jsonl"
            _append_line(path, json.dumps(row), str(path))
        if self._file is not None:  # verl's line: orjson's compact {"step":s,"data":{...}}, UTF-8 as it is
            _append_line(self._file[0], json.dumps({"step": step, "data": values}, separators=(",", ":"),
                                                   ensure_ascii=False), self._file_what)
        generations, self._generations = self._generations, []
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
            if generations:
                self._tb.add_text("val/generations", generations_text(generations, step), step)
            self._tb.flush()  # (the events in the file before the checkpoint is in place, as the row)
        if self._wandb is not None:
            logged = {k: v for k, v in row.items() if k != "step"}
            if generations:
                logged["val/generations"] = self._generations_table(generations, step)
            self._wandb.log(logged, step=step)
        if "console" in self.loggers:
            keys = ("critic/score/mean", "actor/ref_kl", "perf/throughput")
            short = {"critic/score/mean": "reward", "actor/ref_kl": "kl", "perf/throughput": "tok/s"}
            shown = {short[k]: f"{row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float))}
            val = {k.split("/")[-2] + "_val": f"{v:.3f}" for k, v in row.items() if k.startswith("val/")}
            if self._bar is not None:
                self._bar.n = step
                self._bar.set_postfix({**shown, **val}, refresh=True)
            else:
                print(f"step {step}: {shown} {val}", file=sys.stderr)

    def queue_generations(self, samples: list[tuple[str, str, float]]) -> None:
        """`trainer.log_val_generations`' samples of a validation, `(prompt, response, score)` each, to
        be written with the next row (the validation's, whose writes the trainer agrees over the ranks):
        to TensorBoard as a `val/generations` text, to wandb as verl's `val/generations` table (a
        `step` column, then `input_i`, `output_i`, `score_i` for each sample; one row a validation,
        the table of every validation so far logged each time)."""
        if self.enabled:
            self._generations = list(samples)

    def _generations_table(self, samples: list[tuple[str, str, float]], step: int):
        import wandb

        columns = ["step"] + [f"{name}_{i}" for i in range(1, len(samples) + 1) for name in ("input", "output", "score")]
        self._generation_rows.append([step] + [value for sample in samples for value in sample])
        # a new table each time, holding the earlier rows: wandb shows a logged table as it was logged
        return wandb.Table(columns=columns, data=[list(r) for r in self._generation_rows])

    def message(self, text: str):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self):
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
