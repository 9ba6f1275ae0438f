"""A new user's path: the shipped configs run as they are written (loading one says nothing at
start-up: no `meshppo:` note that an option of the file has no effect or is read otherwise than verl
reads it, so a user of the recipe meets only the lines about their own overrides), the README's make
table says what the Makefile does, and the demo builder refuses an empty --out in one line."""

import os

import pytest

from trainer.config import PPOConfig, config_notes
from trainer.configlib import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_config_gets_no_start_up_note(name):
    # the PPO recipes printed "trainer.max_critic_ckpt_to_keep=null: ... verl would keep every critic checkpoint"
    assert config_notes(load_config(PPOConfig, os.path.join(ROOT, "configs", name), [])) == []


def test_the_readme_names_every_make_target_that_installs():
    """README's Launching table lists the targets that run `make install` (it left out test-trl)."""
    import re

    with open(os.path.join(ROOT, "Makefile")) as f:
        installs = [m.group(1) for m in re.finditer(r"^([\w-]+):([^=#\n]*)", f.read(), re.M)
                    if "install" in m.group(2).split()]
    with open(os.path.join(ROOT, "README.md")) as f:
        said = re.search(r"`make install` \(run by ([^)]*)\)", f.read()).group(1)
    assert sorted(re.findall(r"`([\w-]+)`", said)) == sorted(installs), (said, installs)


def test_prepare_demo_refuses_an_empty_out(tmp_path):
    """`python -m tools.prepare_demo --out ''` (an unset variable) is argparse's one-line error, exit 2;
    it was a FileNotFoundError traceback from makedirs('') after the options were read."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tools.prepare_demo", "--out", ""], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1].endswith("error: --out '' is empty: give the assets directory, e.g. "
                                              "runs/demo_assets") and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
