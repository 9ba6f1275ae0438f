"""Two GPUs over NCCL: the trainer's parallel layouts, the same update on 1 and 2 GPUs, the TP 2
engine against TP 1, and the resharder. Each test launches one check of
tests/gpu/multi_gpu_checks.py under torchrun (its docstring says what each asserts) and prints
the check's measured figures (`pytest -s`). Skipped with fewer than 2 CUDA GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = os.path.join(ROOT, "tests", "gpu", "multi_gpu_checks.py")

# Both launches apply the same float32 update (TF32 off) from the same weights to the same
# global batch; only the order of floating-point reductions differs (FSDP's reduce-scatter, the
# micro-batch packing, matmul tiling): a few float32 ulps, measured 2e-6 of the largest update
# on CPU. A wrong loss normalisation or gradient reduction is off by a factor, 1 and above.
UPDATE_RTOL = 1e-4


def launch(check: str, nproc: int = 2, *args: str, device: str = "cuda", timeout: int = 600) -> list[dict]:
    """Run one check on `nproc` ranks; return the figures it printed (one JSON object per line)."""
    # NCCL's NVLS algorithms and symmetric memory need NVLink multicast, which not every NVLink
    # machine offers; nothing here depends on them.
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1")
    # An explicit c10d rendezvous on a free port, as the end-to-end tests (tests/e2e/conftest.py).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--nproc_per_node={nproc}", CHECKS, check,
           "--device", device, *args]
    # A session of its own: on a timeout the ranks go down with torchrun, not left holding the GPUs.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{check} on {nproc} ranks ran over {timeout} s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-8000:]}")
    assert proc.returncode == 0, (f"{check} on {nproc} ranks exited with {proc.returncode}\n--- stdout\n{out[-3000:]}"
                                  f"\n--- stderr\n{err[-8000:]}")
    assert f"{check} ok" in out, out[-3000:]
    figures = [json.loads(line) for line in out.splitlines() if line.startswith('{"check"')]
    for f in figures:
        print(json.dumps(f))
    return figures


def compare_updates(one: dict, two: dict) -> dict:
    """Parameters saved by `same_update` on two world sizes: the same start, the same update."""
    assert one["world_size"] != two["world_size"]
    names = list(one["before"])
    for n in names:
        assert torch.equal(one["before"][n], two["before"][n]), f"{n}: the launches start from different weights"
    update = max((one["after"][n] - one["before"][n]).abs().max().item() for n in names)
    diff = max((one["after"][n] - two["after"][n]).abs().max().item() for n in names)
    moved = sum(int((one["after"][n] != one["before"][n]).sum()) for n in names)
    total = sum(one["before"][n].numel() for n in names)
    # The update is not trivial: measured 0.069 at most, and nearly every entry moves.
    assert update > 1e-2 and moved > 0.9 * total, (update, moved, total)
    assert diff <= UPDATE_RTOL * update, f"parameters differ by {diff:.3g}, the update is {update:.3g}"
    g1, g2 = one["metrics"]["actor/grad_norm"], two["metrics"]["actor/grad_norm"]
    assert abs(g1 - g2) <= UPDATE_RTOL * g1, (g1, g2)
    return {"max_update": update, "max_param_diff": diff, "relative": diff / update}


def test_trainer_layouts_on_two_gpus(tmp_path):
    launch("trainer", 2, "--work-dir", str(tmp_path), timeout=900)


def same_update_run(out, ranks: int, fsdp_size: int, device: str, sp: int = 1) -> dict:
    """`same_update` on `ranks` ranks (`fsdp_size` -1: FULL_SHARD, 1: data parallelism; `sp`: Ulysses groups of
    that many ranks): the parameters before and after the update and the metrics, as rank 0 saved them to `out`."""
    launch("same_update", ranks, "--out", str(out), "--fsdp-size", str(fsdp_size), "--sp", str(sp), device=device)
    return torch.load(out)


def same_update_on_one_and_two_ranks(tmp_path, fsdp_size: int, device: str, sp: int = 1, ranks: int = 2,
                                     one: dict | None = None) -> dict:
    """The same global batch trained on 1 and on `ranks` ranks (`same_update_run`'s arguments): the parameters
    after the update agree (`compare_updates`). `one`: the 1-rank run of this `fsdp_size` made already (it takes
    no Ulysses group: the cases of one `fsdp_size` share it), else run here."""
    if one is None:
        one = same_update_run(tmp_path / "update_1.pt", 1, fsdp_size, device)
    return compare_updates(one, same_update_run(tmp_path / f"update_{ranks}.pt", ranks, fsdp_size, device, sp))


@pytest.mark.parametrize("fsdp_size", [-1, 1])
def test_same_update_on_one_and_two_gpus(tmp_path, fsdp_size):
    print(json.dumps(same_update_on_one_and_two_ranks(tmp_path, fsdp_size, "cuda")))


def test_same_update_ulysses_on_two_gpus(tmp_path):
    """Ulysses over NCCL: the all-to-alls and the gathers move CUDA tensors."""
    print(json.dumps(same_update_on_one_and_two_ranks(tmp_path, -1, "cuda", sp=2)))


def test_engine_tp2_matches_tp1():
    launch("engine_tp", 2)


def test_resharder_over_nccl():
    launch("reshard", 2)
