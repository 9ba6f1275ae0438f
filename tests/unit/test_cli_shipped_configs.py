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
