"""The shipped configs run as they are written: loading one says nothing at start-up (no `meshppo:`
note that an option of the file has no effect or is read otherwise than verl reads it), so a user
of the recipe meets only the lines about their own overrides."""

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
