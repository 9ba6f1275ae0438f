"""Fixtures shared by the multi-process and end-to-end tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """Demo assets with an untrained model (no warm-up): for runs that test plumbing, not learning.
    Initialised with std 0.02, not the demo's 0.1, so the policy starts near uniform."""
    from tests.e2e.conftest import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("tiny_assets"), "--sft-max-steps", "0", "--init-std", "0.02",
                             "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32")
