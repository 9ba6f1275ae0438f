"""Multi-turn rollouts with tools on one GPU: the e2e test's step (tests/e2e/test_multi_turn_trainer.py)
with bf16, the engine's CUDA graphs (head_dim 32) and per-sample turn budgets, in a fresh process
(its own NCCL group of one rank)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16 = ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16", "actor_rollout_ref.rollout.dtype=bfloat16")


def test_multi_turn_tool_rollouts_on_gpu(tmp_path):
    code = ("import sys; from tests.e2e.test_multi_turn_trainer import _assets, _body; "
            "_assets(sys.argv[1], hidden=128); _body(0, 1, sys.argv[1], 'cuda', *sys.argv[2:])")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), *BF16], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
