"""Metric sinks: console progress bar, `metrics.jsonl`, TensorBoard, Weights & Biases.

Only rank 0 logs. `metrics.jsonl` gets one JSON object per step (verl's metric names) and
is appended to, so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class Timer:
    """Wall-clock phase timer: `with timer("gen"): ...` -> `timing_s/gen`.

    On CUDA the device is synchronised at both ends so the time covers the queued work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            # A profiler range per phase: bench/ppo_step.py --profile attributes kernels to phases.
            with torch.profiler.record_function(f"phase:{name}"):
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

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class Tracking:
    def __init__(self, loggers: list[str], run_dir: str, project: str, experiment: str, config: dict,
                 total_steps: int, enabled: bool):
        self.enabled = enabled
        self.loggers = list(loggers)
        self.run_dir = Path(run_dir)
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("trainer.logger includes tensorboard but the tensorboard package is not "
                                   "installed: pip install tensorboard, or remove it from trainer.logger") from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("trainer.logger includes wandb but wandb is not installed: pip install wandb, "
                                   "or remove it from trainer.logger") from e
            # Clusters without outbound network still get a run directory to `wandb sync` later.
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.run_dir))
        if "console" in loggers:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, desc="ppo", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self._bar = None

    def log(self, metrics: dict, step: int):
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        if "jsonl" in self.loggers:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
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
