"""The suite's guard (tests/conftest.py): a test that leaves a default process group initialised
fails, naming itself, and the tests after it start without that group; a module-scoped fixture's
group (tests/gpu's `meshes`) is no leak, nor a test's monkeypatched `dist.is_initialized`. Run as a
pytest of its own over tiny test files, under a copy of the suite's conftest."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEAKS = """
import torch.distributed as dist


def test_leaks():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_cleans_up():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
"""

AFTER = """
import torch.distributed as dist


def test_starts_without_a_group():
    assert not dist.is_initialized()
"""

MODULE_GROUP = """
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_first(group):
    assert dist.is_initialized()


def test_second(group):
    assert dist.is_initialized()
"""


PATCHED = """
import torch.distributed as dist


def test_stands_in_for_a_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert dist.is_initialized()
"""


def test_a_test_that_leaves_a_process_group_fails_and_the_next_starts_without_it(tmp_path):
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_1_leaks.py").write_text(LEAKS)
    (tmp_path / "test_2_after.py").write_text(AFTER)
    (tmp_path / "test_3_module_group.py").write_text(MODULE_GROUP)
    (tmp_path / "test_4_after.py").write_text(AFTER)
    (tmp_path / "test_5_patched.py").write_text(PATCHED)  # a stand-in for a group is no group: no error
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "test_1_leaks.py::test_leaks left a default torch.distributed process group initialised" in out, out
    assert "7 passed, 1 error" in out, out  # the leak fails its own test only
