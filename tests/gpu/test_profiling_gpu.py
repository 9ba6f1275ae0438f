"""The CUDA profiler tools on a GPU (`trainer.profiling`): torch_memory's snapshot is the
allocator's (segments and the step's allocation trace), the torch trace holds the step's kernels,
and nsys's capture range and NVTX ranges run (without nsys attached they only mark)."""

import gzip
import json
import pickle

import pytest
import torch

from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.profiling import StepProfiler, profile_plan
from trainer.tracking import Timer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda", 0)


def _profiler(tmp_path, tool, *overrides):
    cfg = load_config(PPOConfig, "configs/demo.yaml", [
        f"global_profiler.tool={tool}", "global_profiler.steps=[2]", f"global_profiler.save_path={tmp_path}",
        "actor_rollout_ref.actor.profiler.enable=true", *overrides])
    return StepProfiler(profile_plan(cfg), 0, CUDA, 3)


def _steps(profiler):
    timer = Timer(CUDA)
    timer.around = profiler.phase
    kept = []
    for n in (1, 2, 3):
        with profiler.step(n), timer("step"), timer("update_actor"):
            kept.append(torch.randn(1024, 1024, device=CUDA) @ torch.randn(1024, 1024, device=CUDA))
    profiler.close()


def test_torch_memory_snapshot(tmp_path):
    _steps(_profiler(tmp_path, "torch_memory"))
    with open(tmp_path / "step2" / "torch_memory_rank0.pickle", "rb") as f:
        snap = pickle.load(f)
    assert snap["segments"] and any(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace)
    assert not (tmp_path / "step1").exists() and not (tmp_path / "step3").exists()


def test_torch_trace_has_the_kernels(tmp_path):
    _steps(_profiler(tmp_path, "torch"))
    with gzip.open(tmp_path / "step2" / "prof_rank-0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert any(e.get("name") == "phase:update_actor" for e in events)


def test_nsys_marks_run(tmp_path):
    for discrete in ("false", "true"):
        _steps(_profiler(tmp_path, "nsys", f"global_profiler.global_tool_config.nsys.discrete={discrete}"))
