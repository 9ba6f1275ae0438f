"""Shared fixtures for end-to-end runs: demo assets built once per test session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prepare_demo_body(rank, world_size, argv):
    from tools.prepare_demo import main

    assert main(argv) == 0, f"python -m tools.prepare_demo {' '.join(argv)} failed"


def build_demo_assets(out, *args: str):
    """`python -m tools.prepare_demo --out OUT ARGS...`; returns OUT. Its `main` runs in a process forked from the
    tests' fork server (`tests.dist_utils.run_distributed`, one rank: torch and transformers already imported)
    instead of a fresh interpreter (about 5 s of imports on 2 cores, for a build of a second or two at the tiny
    sizes): the same files, as `main` sets its own thread count and seeds; its output goes to the test's captured
    stdout."""
    from tests.dist_utils import run_distributed

    run_distributed(_prepare_demo_body, 1, ["--out", str(out), *args], timeout=900)
    return out


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """Tokenizer, prompts and the supervised starting model of the demo (the real recipe, seed 0).

    MESHPPO_TEST_DEMO_ASSETS may name a directory already built by `tools.prepare_demo` with the
    default settings (it is re-checked, and left alone when up to date) to save a minute locally."""
    given = os.environ.get("MESHPPO_TEST_DEMO_ASSETS")
    return build_demo_assets(Path(given) if given else tmp_path_factory.mktemp("demo_assets"))


def torchrun(args: list[str], nproc: int = 2, timeout: int = 900, env_extra: dict | None = None,
             extra_torchrun: list[str] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    from tests.dist_utils import free_port

    # An explicit c10d rendezvous, not --standalone: with --standalone, torch 2.13's restarted
    # workers (--max-restarts) hang in init_process_group.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--nproc_per_node={nproc}",
           *extra_torchrun, os.path.join(ROOT, "train_ppo.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _train_body(rank, world_size, args):
    from trainer import cli

    code = cli.main(args)
    assert code == 0, f"rank {rank}: train_ppo.py {' '.join(args)} returned {code}"


def train_in_ranks(args: list[str], nproc: int = 2, timeout: float = 900) -> None:
    """`train_ppo.py ARGS` on `nproc` gloo ranks, each rank's `trainer.cli.main(ARGS)` as torchrun's would run it,
    in processes forked from the tests' fork server (`tests.dist_utils.run_distributed`: torch, torch._dynamo and
    transformers already imported) instead of a torchrun launch (a second or two against about 10 s of imports on
    2 cores): for the tests whose subject is what the run does, not the launch, its processes or signals. Every rank
    must return 0; their output goes to the test's captured stdout and stderr (`capfd`)."""
    from tests.dist_utils import run_distributed

    run_distributed(_train_body, nproc, args, timeout=timeout)


def demo_args(assets, run_dir, *overrides) -> list[str]:
    return ["--config", os.path.join(ROOT, "configs", "demo.yaml"),
            f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]",
            f"actor_rollout_ref.model.path={assets}/sft_model", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[jsonl]", *overrides]


def demo_trainer(assets, run_dir, reward, *overrides):
    """A `PPOTrainer` of the demo recipe on `assets` with the rule reward file `reward`, built in
    this process (a rank of `tests.dist_utils.run_distributed`, gloo), no validation set, no resume."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]",
        f"actor_rollout_ref.model.path={assets}/sft_model", f"custom_reward_function.path={reward}",
        f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", *overrides])
    return PPOTrainer(cfg, init_distributed("cpu"))


def assert_trains_only(model, optimizer, trained: set[str]) -> None:
    """`model`'s parameters that require grad are exactly `trained`, and `optimizer` holds exactly them."""
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}


def checkpoint_keys(ckpt_dir) -> list[str]:
    """The state-dict keys of every DCP checkpoint under `ckpt_dir` (e.g. `model.…`, `optim.state.…`)."""
    from torch.distributed.checkpoint import FileSystemReader

    return [k for f in Path(ckpt_dir).rglob(".metadata")
            for k in FileSystemReader(str(f.parent)).read_metadata().state_dict_metadata]


def assert_resumed_run_matches(straight, resumed, steps: int) -> None:
    """The run in `resumed`, stopped and resumed from a checkpoint, logged the same `steps`
    steps as the uninterrupted run in `straight`."""
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [row["step"] for row in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        assert_same_metrics(ra, rb)


def read_metrics(run_dir) -> list[dict]:
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# metrics that measure the machine, not the run: two runs of the same steps differ in them
MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")


def without_machine_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_METRICS)}


def assert_same_metrics(a: dict, b: dict) -> None:
    """Two runs' metrics rows of one step agree, timings and performance figures aside (a
    resumed or recovered run against the uninterrupted one)."""
    import pytest

    sa, sb = without_machine_metrics(a), without_machine_metrics(b)
    assert sa.keys() == sb.keys(), set(sa) ^ set(sb)
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-5, abs=1e-6), (a["step"], k, sa[k], sb[k])
