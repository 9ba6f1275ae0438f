"""Fixtures shared by the multi-process and end-to-end tests."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """Demo assets with an untrained model (no warm-up): for runs that test plumbing, not learning."""
    out = tmp_path_factory.mktemp("tiny_assets")
    r = subprocess.run([sys.executable, "-m", "tools.prepare_demo", "--out", str(out), "--sft-max-steps", "0",
                        "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return out
