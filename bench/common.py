"""Shared helpers of the benchmarks under `bench/`: model shapes, ceilings, one JSON line per measurement.

Every benchmark prints one JSON object per measurement: the benchmark
name, the workload, the hardware, the commit, and its figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import contextlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.args import ModelArgs  # noqa: E402

# Measured ceilings of one H200: device copy, and bf16 matmul on random data.
H200_HBM_BYTES_PER_S = 4.3e12
H200_BF16_FLOPS = 790e12

_QWEN25 = dict(model_type="qwen2", attention_bias=True, max_position_embeddings=32768, rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643,
              eos_token_id=151645)

# The benchmark workloads (random weights: speed does not depend on the values).
MODEL_SHAPES: dict[str, ModelArgs] = {
    "qwen2.5-0.5b": ModelArgs(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, **_QWEN25),
    "qwen2.5-1.5b": ModelArgs(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, **_QWEN25),
    "qwen2.5-7b": ModelArgs(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, **_QWEN25),
    "qwen3-0.6b": ModelArgs(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, tie_word_embeddings=True,
                            **_QWEN3),
    "qwen3-1.7b": ModelArgs(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, tie_word_embeddings=True,
                            **_QWEN3),
    # Qwen3-30B-A3B: 48 mixture-of-experts layers of 128 experts (768 wide), 8 a token; 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": ModelArgs(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, tie_word_embeddings=False,
                               **(_QWEN3 | dict(model_type="qwen3_moe", num_attention_heads=32, num_key_value_heads=4)),
                               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # Gemma-2-2b: 26 layers, every other one windowed (4,096), head dim 256, its scores capped at 50 and its logits
    # (a 256,000-token vocabulary) at 30; 2.6B parameters, 0.59B of them the tied embedding
    "gemma2-2b": ModelArgs.from_hf_config(dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
}


def model_args(name: str, **overrides) -> ModelArgs:
    """A fresh copy of a named shape of `MODEL_SHAPES`."""
    if name not in MODEL_SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
    return dataclasses.replace(MODEL_SHAPES[name], **overrides)


def git_commit() -> str:
    """HEAD's short hash (+ "-dirty"), or $MESHPPO_COMMIT where the tree is no git checkout."""
    if os.environ.get("MESHPPO_COMMIT"):
        return os.environ["MESHPPO_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        return head + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    return info


def emit(benchmark: str, workload: dict, **figures) -> dict:
    """Print one measurement as a JSON line (and return it)."""
    rec = {"benchmark": benchmark, "workload": workload, **figures, "hardware": hardware(), "commit": git_commit(),
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(json.dumps(rec), flush=True)
    return rec


SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit")


def parse_smi_line(line: str) -> tuple[float, ...] | None:
    """One line of `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits` as floats;
    None for anything else (a header, a warning, a field that reads "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(SMI_FIELDS):
        return None
    try:
        return tuple(float(p) for p in parts)
    except ValueError:
        return None


class GpuTelemetry:
    """The GPU's SM clock and board power, sampled in the background while a benchmark runs and
    summarised over the intervals it marks with `window()`.

    An H200 holds its power limit (700 W) by lowering the SM clock: a 1.5b decode at 256 rows
    draws the limit and runs below the maximum clock, so its step time depends on the power
    state, and a record should say which one it was measured in. Samples come from
    `nvidia-smi -lms` (each line is stamped when the host reads it, within a period of its
    measurement); `power.draw` is the driver's power reading, which recent drivers average
    over up to a second. Without CUDA or `nvidia-smi` (or with `command=None`) there are no
    samples, and `summary()` reports None for every figure.
    """

    def __init__(self, device_index: int = 0, period_ms: int = 50, command: list[str] | None | str = "auto"):
        # device_index: nvidia-smi's numbering (the same as CUDA's unless CUDA_VISIBLE_DEVICES reorders);
        # command: "auto" (nvidia-smi where there is CUDA and the tool), None (no samples), or a
        # command printing lines as nvidia-smi does
        if command == "auto":
            command = None
            if torch.cuda.is_available() and shutil.which("nvidia-smi"):
                command = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
                           f"--id={device_index}", f"--loop-ms={period_ms}"]
        self.command = command
        self.samples: list[tuple[float, tuple[float, ...]]] = []  # (perf_counter when read, SMI_FIELDS)
        self.windows: list[tuple[float, float]] = []
        self._proc = self._reader = None

    def __enter__(self) -> "GpuTelemetry":
        if self.command:
            try:
                self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True, bufsize=1)
            except OSError:
                self._proc = None
            else:
                self._reader = threading.Thread(target=self._read, daemon=True)
                self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            values = parse_smi_line(line)
            if values is not None:
                self.samples.append((time.perf_counter(), values))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=5)
            self._proc = None

    @contextlib.contextmanager
    def window(self):
        """Mark the enclosed code as measured: `summary()` reads the samples taken inside it."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.windows.append((t0, time.perf_counter()))

    def summary(self) -> dict:
        """Medians over the samples inside the windows: `gpu_clock_mhz` (SM clock), `gpu_max_clock_mhz`,
        `gpu_power_w`, `gpu_power_limit_w`, and `gpu_power_capped_share`, the share of those samples
        drawing at least 95 % of the limit; `gpu_samples` counts them."""
        inside = [v for t, v in self.samples if any(a <= t <= b for a, b in self.windows)]
        out = {"gpu_samples": len(inside)}
        names = ("gpu_clock_mhz", "gpu_max_clock_mhz", "gpu_power_w", "gpu_power_limit_w")
        for i, name in enumerate(names):
            out[name] = round(statistics.median(v[i] for v in inside), 1) if inside else None
        out["gpu_power_capped_share"] = (round(sum(v[2] >= 0.95 * v[3] for v in inside) / len(inside), 3)
                                         if inside else None)
        return out

    def take(self) -> dict:
        """`summary()` of the windows marked since the last `take()`, which starts a new set."""
        out = self.summary()
        self.windows.clear()
        return out


_ANNOTATION = re.compile(r"^[A-Za-z_][\w.:]*#")  # "Optimizer.step#AdamW.step"; kernels read "void ...{lambda()#3}"
_KERNEL_CLASSES = (  # (class, substrings of the kernel name), first match wins
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "index", "scatter", "gather")),
    ("reduce", ("reduce", "norm", "softmax", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_breakdown(prof, wall_s: float, top: int = 12) -> dict:
    """Device time of a `torch.profiler` run by kernel class (gemm, attention, elementwise, ...),
    the share of the wall time at least one kernel ran (union of kernel intervals), and the most
    expensive kernels. User annotations on the device timeline (`Optimizer.step#AdamW.step`,
    FSDP's ranges) span kernels counted on their own and are left out."""
    per_class: dict[str, float] = {}
    kernels: dict[str, float] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or getattr(ev, "is_user_annotation", False) or _ANNOTATION.match(ev.name):
            continue
        name = ev.name
        us = ev.time_range.end - ev.time_range.start
        spans.append((ev.time_range.start, ev.time_range.end))
        low = name.lower()
        cls = next((c for c, keys in _KERNEL_CLASSES if any(k in low for k in keys)), "other")
        per_class[cls] = per_class.get(cls, 0.0) + us / 1e3
        kernels[name] = kernels.get(name, 0.0) + us / 1e3
    busy = _length(_union(spans)) / 1e3
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    syncs = {e.key: [e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in prof.key_averages()
             if any(k in e.key for k in ("Synchronize", "local_scalar_dense", "cudaMemcpy"))}
    return {"wall_ms": wall_s * 1e3, "gpu_busy_ms": busy, "gpu_busy_share": busy / (wall_s * 1e3),
            "host_self_ms_top": {e.key[:60]: [e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in host[:top]},
            "host_syncs": syncs,
            "ms_by_class": dict(sorted(per_class.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": {k[:90]: round(v, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]}}


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def comm_exposure(prof, host_top: int = 12) -> dict:
    """Per trainer phase (the `phase:<name>` ranges of `trainer.tracking.Timer`): wall time, NCCL
    kernel time, and the *exposed* NCCL time — when an NCCL kernel runs and no other kernel
    does, i.e. communication that compute does not hide. Milliseconds, from one profiled step.
    A kernel belongs to the innermost phase whose host range contains its start (the timer
    synchronises the device at both ends of a phase, so its kernels cannot spill out)."""
    phases = [(ev.name.removeprefix("phase:"), ev.time_range.start, ev.time_range.end) for ev in prof.events()
              if ev.device_type.name == "CPU" and ev.name.startswith("phase:")]
    kernels: dict[str, tuple[list, list]] = {name: ([], []) for name, _, _ in phases}
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or getattr(ev, "is_user_annotation", False) or _ANNOTATION.match(ev.name):
            continue
        s, e = ev.time_range.start, ev.time_range.end
        inside = [(b - a, name) for name, a, b in phases if a <= s <= b]
        if not inside:
            continue
        name = min(inside)[1]
        kernels[name][0 if "nccl" in ev.name.lower() else 1].append((s, e))
    host: dict[str, dict[str, list]] = {name: {} for name, _, _ in phases}
    for ev in prof.events():
        if ev.device_type.name != "CPU" or ev.name.startswith("phase:"):
            continue
        s = ev.time_range.start
        inside = [(b - a, name) for name, a, b in phases if a <= s <= b]
        if inside:
            acc = host[min(inside)[1]].setdefault(ev.name, [0, 0.0])
            acc[0] += 1
            acc[1] += ev.self_cpu_time_total / 1e3
    out = {}
    for name, a, b in phases:
        comm_spans, compute_spans = (_union(k) for k in kernels[name])
        nccl = _length(comm_spans)
        hidden = _length(_intersect(comm_spans, compute_spans))
        out[name] = {"wall_ms": (b - a) / 1e3, "nccl_ms": nccl / 1e3, "exposed_nccl_ms": (nccl - hidden) / 1e3,
                     "compute_busy_ms": _length(compute_spans) / 1e3,
                     # where the host spends a phase that the GPU does not fill
                     "host_self_ms_top": {k[:60]: [n, round(ms, 2)] for k, (n, ms) in
                                          sorted(host[name].items(), key=lambda kv: -kv[1][1])[:host_top]}}
    return out
