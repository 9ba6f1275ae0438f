"""Reading and checking a config loads no model, FSDP, engine or kernel implementation: a config error
(`meshppo: config error: ...`) is said without importing torch._dynamo, transformers or triton, in
train_ppo.py's process (`trainer.cli.main`) and in the launcher's (`trainer.launch.main`, run before
any rank starts); `--print-config` of a model directory reads its config.json with transformers'
AutoConfig and loads nothing else of them. Each case runs in a fresh interpreter, whose `sys.modules`
is then read."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
HEAVY = ("torch._dynamo", "transformers", "triton", "models.transformer", "sharding.fsdp", "rollout.engine")

# Runs `entry` (a module's main) with argv in a fresh interpreter and prints its exit code and which
# of HEAVY it left in sys.modules, as JSON on the last line of stdout.
_PROBE = """
import contextlib, importlib, io, json, sys
entry, argv, heavy = json.loads(sys.argv[1])
module, _, name = entry.partition(":")
code = None
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    code = getattr(importlib.import_module(module), name)(argv) if name else None
print(json.dumps({"code": code, "stderr": err.getvalue(), "loaded": [m for m in heavy if m in sys.modules]}))
"""


def _probe(entry: str, argv: list[str], tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHPPO_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([entry, argv, HEAVY])], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["trainer.config", "trainer.cli", "trainer.launch", "trainer.setup",
                                    "models", "sharding", "rollout", "agent", "data", "ppo", "rewards", "kl"])
def test_importing_the_config_path_loads_no_implementation(module, tmp_path):
    assert _probe(module, [], tmp_path)["loaded"] == []


@pytest.mark.parametrize("entry", ["trainer.cli:main", "trainer.launch:main"])
@pytest.mark.parametrize("args,line", [
    (["actor_rollout_ref.actor.optim.lrr=1e-3"],
     "meshppo: config error: unknown config key 'actor_rollout_ref.actor.optim.lrr'; did you mean "
     "'actor_rollout_ref.actor.optim.lr'?"),
    # (--print-config: checked against the launch the config describes, in train_ppo.py's process too)
    (["trainer.n_gpus_per_node=3", "--print-config"],
     "meshppo: config error: ppo_mini_batch_size x rollout.n = 128 sequences must split evenly over 3 ranks: "
     "change actor_rollout_ref.actor.ppo_mini_batch_size")])
def test_a_config_error_is_said_without_the_implementations(entry, args, line, tmp_path):
    out = _probe(entry, ["--config", DEMO, f"trainer.default_local_dir={tmp_path}/run", *args], tmp_path)
    assert (out["code"], out["stderr"].splitlines()) == (2, [line])
    assert out["loaded"] == []


@pytest.mark.parametrize("entry", ["trainer.cli:main", "trainer.launch:main"])
def test_print_config_of_the_demo_loads_no_implementation(entry, tiny_assets, tmp_path):
    """The demo's model directory is read (its config.json, by transformers' AutoConfig, for the checks and
    the start-up notes), not built."""
    out = _probe(entry, ["--config", DEMO, f"actor_rollout_ref.model.path={tiny_assets}/sft_model",
                         f"data.train_files=[{tiny_assets}/train.jsonl]", f"data.val_files=[{tiny_assets}/val.jsonl]",
                         f"trainer.default_local_dir={tmp_path}/run", "--print-config"], tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert set(out["loaded"]) <= {"transformers"}, out["loaded"]
