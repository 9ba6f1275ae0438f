"""Fixtures shared by the multi-process and end-to-end tests, and the guard every test runs under."""

import sys

import pytest


def _default_group_exists() -> bool:
    """Whether this process has a default process group (none can before torch.distributed is imported). It asks
    c10d's own `is_initialized`, not the `torch.distributed.is_initialized` that tests monkeypatch to stand in for
    a group: pytest undoes a test's monkeypatch after this guard's teardown (`cpu_suite_without_cuda` requests
    the monkeypatch fixture, which puts it before the guard), so the guard would see the stand-in."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.distributed_c10d.is_initialized()


@pytest.fixture(autouse=True)
def no_leaked_process_group(request):
    """Fails a test that leaves a default process group initialised: the whole suite runs in one
    process, and a later test that makes its own group (or checks for none) would meet it. The
    group is destroyed first, so the tests after it run as they would alone."""
    existed = _default_group_exists()
    yield
    if not existed and _default_group_exists():
        import torch.distributed as dist

        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default torch.distributed process group initialised: "
                    "whatever inits one in this process (a test, or the product code it calls) must destroy it "
                    "on every exit path, errors included", pytrace=False)


@pytest.fixture(autouse=True)
def cpu_suite_without_cuda(request, monkeypatch):
    """The tests outside tests/gpu are the CPU suite, which CI runs on a machine without a GPU. The product takes
    CUDA wherever it is available (trainer.device=auto, the rollout.generate CLI), so on a machine with a GPU
    (`make test` there) they would run on it, in bf16, against CPU references: there they see no GPU either, in
    this process (torch.cuda.is_available) and in the ranks and runs they start (CUDA_VISIBLE_DEVICES)."""
    if request.path.parent.name == "gpu":
        return
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """Demo assets with an untrained model (no warm-up): for runs that test plumbing, not learning.
    Initialised with std 0.02, not the demo's 0.1, so the policy starts near uniform."""
    from tests.e2e.conftest import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("tiny_assets"), "--sft-max-steps", "0", "--init-std", "0.02",
                             "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32")
