"""The documented launch paths on 2 CPU ranks: `launch/run_single_node.sh` (meshppo's launcher
around torchrun) and the SLURM template with stand-in `srun` / `scontrol` scripts. A user error
is one line and its exit code; a stop signal is a checkpoint, exit 0 and one line."""

import os
import signal
import subprocess
import sys
import time

from tests.e2e.conftest import ROOT, demo_args, read_metrics
from trainer import cli

STEPS = 40  # far more than run before the signal lands: the run is stopped, not finished
# no validation (and no validation options: a start-up note would say they change nothing)
COMMON = [f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "data.val_files=[]", "trainer.log_val_generations=0",
          "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.export_hf_at_end=false",
          "actor_rollout_ref.rollout.n=4"]
# The SLURM test's run, whose requeued job finishes it: several times the steps run before the signal lands
# (3 of 0.2-0.4 s each on a busy 2-core machine; a fast machine's steps are shorter, the signal's path through
# bash and torchrun is not), without 40 steps to finish.
REQUEUED_STEPS = 24


def _common(steps: int) -> list[str]:
    """COMMON with `steps` training steps."""
    return [a for a in COMMON if not a.startswith("trainer.total_training_steps=")] + \
        [f"trainer.total_training_steps={steps}"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2", **extra)
    return env


class _Job(subprocess.Popen):
    """A launch with its output as one string, carriage returns kept (no universal newlines)."""

    def __init__(self, cmd, env):
        super().__init__(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def output(self, timeout) -> str:
        return self.communicate(timeout=timeout)[0].decode()


def _single_node(args, **env):
    return _Job(["bash", os.path.join(ROOT, "launch", "run_single_node.sh"), *args], _env(**env))


def _lines(out: str) -> list[str]:
    return [line for line in out.replace("\r", "\n").splitlines() if line.strip()]


def _no_launcher_noise(out: str):
    for noise in ("Traceback", "ChildFailedError", "SignalException", "[default0]:", "[rank0]:"):
        assert noise not in out, out


def test_config_error_is_one_line_before_any_rank(tiny_assets, tmp_path):
    p = _single_node(demo_args(tiny_assets, tmp_path / "run", *COMMON, "trainer.total_epoch=2"))
    out = p.output(timeout=300)
    assert p.returncode == 2, out
    assert _lines(out) == ["meshppo: config error: unknown config key 'trainer.total_epoch'; did you mean "
                           "'trainer.total_epochs'?"], out
    assert not (tmp_path / "run" / "logs").exists()  # no rank was started


def _config_error_body(rank, world_size, assets, root):
    """cli.main on each of 2 ranks (torchrun's variables set, as plain torchrun runs them)."""
    import contextlib
    import io

    def main(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(demo_args(assets, f"{root}/run", *args))
        return code, out.getvalue(), err.getvalue()

    # every rank finds the same error: rank 0 says it once, as one process would
    code, _, err = main("trainer.total_epoch=2")
    said = "meshppo: config error: unknown config key 'trainer.total_epoch'; did you mean 'trainer.total_epochs'?\n"
    assert code == 2 and err == (said if rank == 0 else ""), err
    # rank 1's alone (its run directory, from its environment, is a file): rank 0 says it, naming the rank
    code, _, err = main("trainer.default_local_dir=" + root + "/run${oc.env:RANK}")
    lines = err.splitlines()
    assert code == 2 and len(lines) == (1 if rank == 0 else 0), err
    assert rank != 0 or (lines[0].startswith("meshppo: config error (rank 1): ") and f"{root}/run1" in lines[0]), err
    # --print-config: the YAML once (rank 0's), not once per rank
    code, out, _ = main("--print-config")
    assert code == 0 and ("trainer:" in out) == (rank == 0), out[:200]


def test_under_plain_torchrun_rank_0_says_every_ranks_config_error(tiny_assets, tmp_path):
    """Under plain torchrun only rank 0 printed a config error: one found by another rank alone (a
    `${oc.env:...}` value, a node's disk) was printed by nobody. The ranks now agree on their errors
    through torchrun's store before any work, and rank 0 says each, with the ranks that found it."""
    from tests.dist_utils import run_distributed

    (tmp_path / "run1").write_text("a file where rank 1's run directory would be\n")
    run_distributed(_config_error_body, 2, str(tiny_assets), str(tmp_path), timeout=300)


def test_input_error_on_the_ranks_is_one_line(tiny_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    with open(f"{tiny_assets}/train.jsonl") as f:
        bad.write_text(f.readline() + "{oops\n")
    run = tmp_path / "run"
    p = _single_node(demo_args(tiny_assets, run, *COMMON, f"data.train_files=[{bad}]"))
    out = p.output(timeout=600)
    assert p.returncode == 1, out
    assert _lines(out) == [f"meshppo: error (rank 0): {bad}:2: malformed JSON: Expecting property name enclosed in "
                           "double quotes at column 2"], out
    _no_launcher_noise(out)
    assert "(rank 1)" in (run / "logs" / "rank1.log").read_text()  # the other rank's log is kept


def _reward_failing_on_rank_1(tmp_path, when: str):
    """A reward file that raises on rank 1 only: when imported ("import") or when called ("call",
    at its line 6)."""
    reward = tmp_path / "reward.py"
    fail = "if os.environ['RANK'] == '1':\n"
    body = (f"import os\n\n{fail}    raise ImportError('no module for rank 1')\n\n\n" if when == "import" else "import os\n\n\n")
    body += "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    if when == "call":
        body += f"    {fail}        raise ValueError('boom on rank 1')\n"
    reward.write_text(body + "    return 0.0\n")
    return reward


def test_a_reward_error_on_one_rank_is_said_by_rank_0(tiny_assets, tmp_path):
    """The reward function raises on rank 1 only: every rank stops in the same step, and the one
    error line on the launcher's stderr (rank 0's) carries rank 1's error, not a failed collective."""
    reward = _reward_failing_on_rank_1(tmp_path, "call")
    p = _single_node(demo_args(tiny_assets, tmp_path / "run", *COMMON, f"custom_reward_function.path={reward}"))
    out = p.output(timeout=600)
    assert p.returncode == 1, out
    errors = [line for line in _lines(out) if line.startswith("meshppo: error")]
    assert len(errors) == 1 and errors[0].startswith("meshppo: error (rank 0): (on rank 1) reward function "), out
    assert errors[0].endswith(f"at {reward}:6: ValueError: boom on rank 1"), out
    _no_launcher_noise(out)


def test_an_input_error_of_one_rank_alone_reaches_the_launchers_output(tiny_assets, tmp_path):
    """Rank 1 alone fails at set-up (its reward file import raises), so rank 0 has nothing to say but
    that a collective lost its peer; the launcher adds rank 1's own line from rank 1's log."""
    reward = _reward_failing_on_rank_1(tmp_path, "import")
    p = _single_node(demo_args(tiny_assets, tmp_path / "run", *COMMON, f"custom_reward_function.path={reward}"))
    out = p.output(timeout=600)
    assert p.returncode == 1, out
    lines = _lines(out)
    assert any(line.startswith("meshppo: error (rank 1): importing custom reward file") and
               "no module for rank 1" in line for line in lines), out
    _no_launcher_noise(out)


def test_a_config_error_of_one_rank_alone_reaches_the_launchers_output(tiny_assets, tmp_path):
    """Rank 1 alone finds a config error while the run starts (its node's tool config file is broken), while
    rank 0 waits in the dataset's build for it: rank 0 has only its failed collective to say, rank 1 said
    nothing (only rank 0 printed config errors) and the launch exited 1. Now rank 1's line reaches the
    launcher's output, exit 2."""
    (tmp_path / "tools0.yaml").write_text("tools: []\n")
    (tmp_path / "tools1.yaml").write_text("tools:\n  - class_name: tools.Calculator\n")
    tools = "actor_rollout_ref.rollout.multi_turn.tool_config_path=\"" + str(tmp_path) + "/tools${oc.env:LOCAL_RANK,0}.yaml\""
    p = _single_node(demo_args(tiny_assets, tmp_path / "run", *COMMON, "actor_rollout_ref.rollout.multi_turn.enable=true",
                               tools), MESHPPO_PEER_GRACE_S="3")
    out = p.output(timeout=600)
    assert p.returncode == 2, out
    assert ("meshppo: config error (rank 1): actor_rollout_ref.rollout.multi_turn.tool_config_path: "
            f"{tmp_path}/tools1.yaml: tools[0].config: must be a mapping") in out, out
    _no_launcher_noise(out)


def test_the_launcher_stops_ranks_left_waiting_by_another_ranks_error(tiny_assets, tmp_path):
    """Rank 1 fails at set-up while rank 0 is busy (a fault holds it 120 s at the run's start, before
    its first collective; on GPUs it would be waiting in that collective until trainer.nccl_timeout).
    MESHPPO_PEER_GRACE_S after rank 1's error the launcher stops rank 0 and torchrun, and reports
    rank 1's error."""
    reward = _reward_failing_on_rank_1(tmp_path, "import")
    t0 = time.time()
    p = _single_node(demo_args(tiny_assets, tmp_path / "run", *COMMON, f"custom_reward_function.path={reward}"),
                     MESHPPO_FAULTS="hang@0:0", MESHPPO_PEER_GRACE_S="3")
    out = p.output(timeout=600)
    assert p.returncode == 1, out
    assert time.time() - t0 < 100, out  # not the 120 s hold
    lines = _lines(out)
    assert any(line.startswith("meshppo: error (rank 1): importing custom reward file") for line in lines), out
    assert lines[-1] == ("meshppo: rank 0 still ran 3 s after rank 1's error (waiting for it in a collective): the "
                         "launcher stopped them"), out
    _no_launcher_noise(out)


def _wait_for_a_step(p, run, timeout=600):
    t0 = time.time()
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        assert p.poll() is None, p.output(60)
        assert time.time() - t0 < timeout
        time.sleep(0.2)


def _checkpointed_step(out: str, run, steps: int = STEPS) -> int:
    latest = (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert 0 < int(latest) < steps, latest
    assert [row["step"] for row in read_metrics(run)] == list(range(1, int(latest) + 1))
    return int(latest)


def test_sigterm_is_a_clean_preemption(tiny_assets, tmp_path):
    run = tmp_path / "run"
    p = _single_node(demo_args(tiny_assets, run, *COMMON, "trainer.logger=[console,jsonl]"))
    _wait_for_a_step(p, run)
    p.send_signal(signal.SIGTERM)
    out = p.output(timeout=600)
    assert p.returncode == 0, out
    step = _checkpointed_step(out, run)
    lines = _lines(out)
    assert lines[-1] == (f"meshppo: preempted by SIGTERM, checkpoint at {run}/checkpoints/global_step_{step}; the "
                         "same command resumes it (trainer.resume_mode=auto)"), out
    _no_launcher_noise(out)
    # the progress bar redraws in place (carriage returns), not one prefixed line per update
    assert "\rppo:" in out and "it/s" in out, out


def test_slurm_template_usr1_checkpoints_requeues_and_resumes(tiny_assets, tmp_path):
    """single_node.sbatch with stand-ins: `srun` runs its command here (exec, so a signal to srun
    reaches it as real srun forwards it), `scontrol` records its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $# -gt 0 && $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n[[ $1 == show ]] && echo localhost\n'
                                      "exit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    run = tmp_path / "run"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="localhost", PYTHON=sys.executable)
    cmd = ["bash", os.path.join(ROOT, "launch", "slurm", "single_node.sbatch"),
           *demo_args(tiny_assets, run, *_common(REQUEUED_STEPS))]
    # the "--config CONFIG" of demo_args: the template takes the config as its first argument
    cmd.remove("--config")

    def job():
        return _Job(cmd, env)

    p = job()
    _wait_for_a_step(p, run)
    p.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 does before the time limit
    out = p.output(timeout=600)
    assert p.returncode == 0, out
    step = _checkpointed_step(out, run, REQUEUED_STEPS)
    assert f"meshppo: preempted by SIGUSR1, checkpoint at {run}/checkpoints/global_step_{step}" in out, out
    _no_launcher_noise(out)
    assert calls.read_text().splitlines() == ["requeue 4242"]

    p = job()  # the requeued job
    out = p.output(timeout=900)
    assert p.returncode == 0, out
    assert f"resumed from {run}/checkpoints/global_step_{step}" in out, out
    assert [row["step"] for row in read_metrics(run)] == list(range(1, REQUEUED_STEPS + 1))
    assert calls.read_text().splitlines() == ["requeue 4242"]  # finished: not requeued again


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:`port`."""
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_stop_signal_before_any_rank_started_stops_the_launch(tiny_assets, tmp_path):
    """torchrun waits in a rendezvous no second node joins (no rank starts); SIGTERM used to be forwarded to
    ranks that did not exist, and torchrun (which ignores it) waited out its 10-minute rendezvous timeout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "job1", "--nproc-per-node", "1", *demo_args(tiny_assets, run, *COMMON, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")]
    p = _Job(cmd, _env())
    t0 = time.time()
    while not _listening(port):  # torchrun is up, its rendezvous store serving, waiting for the second node
        assert p.poll() is None, p.output(60)
        assert time.time() - t0 < 300
        time.sleep(0.2)
    assert p.poll() is None
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out = p.output(timeout=60)
    assert time.time() - t0 < 15, out
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "meshppo: SIGTERM: stopped before any rank of this node started" in out, out
    _no_launcher_noise(out)
    left = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout.split()
    assert left == [], left  # torchrun and anything it started are gone


def test_a_hung_rank_is_restarted_and_the_run_resumes(tiny_assets, tmp_path):
    """Rank 1 hangs at step 2 (on the first attempt only): rank 0's collective times out. That was
    recorded as a user error (the rank exited 0, the launcher killed torchrun), so MAX_RESTARTS never
    restarted the run; now torchrun restarts the ranks, which resume from the checkpoint of step 1."""
    run = tmp_path / "run"
    p = _single_node(demo_args(tiny_assets, run, *_common(4), "trainer.save_freq=1",
                               "trainer.nccl_timeout=5"),
                     MAX_RESTARTS="1", MESHPPO_FAULTS="hang@2:1", MESHPPO_PEER_GRACE_S="3")
    out = p.output(timeout=600)
    assert p.returncode == 0, out
    assert "meshppo: error (rank 0): a collective failed in phase '" in out, out  # the first attempt's
    assert f"run directory: {run} (resumed at step 1)" in out, out  # the restarted one's
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3, 4]
    _no_launcher_noise(out)


def _pid_runs(pid: int, *words: str) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    return all(word in cmdline for word in words)


def test_a_second_launch_into_a_run_directory_in_use_is_refused(tiny_assets, tmp_path):
    """A second launch into the directory of a running one (a sweep that leaves experiment_name as it
    is, a double sbatch) deleted the first's checkpoint in progress and its metrics rows, and both
    launchers showed each other's output. Now it is refused, naming the directory and the first run's
    rank 0, before anything is written: by the launcher before any rank starts, and by plain
    torchrun's ranks (every rank stops), and the first run goes on untouched. The first launcher holds
    the directory from its check on: a second launch while the first's ranks were still starting (a
    sweep started at once) passed the launcher's check and ran too."""
    import re
    import socket

    from tests.e2e.conftest import torchrun

    run = tmp_path / "run"
    args = demo_args(tiny_assets, run, *_common(5000), "trainer.save_freq=1")
    where = re.escape(str(run))
    holder = rf"the launcher: pid (\d+) on {re.escape(socket.gethostname())}, which holds {where}/\.lock"
    refused = rf"trainer.default_local_dir={where} is in use by another run \({holder}\): let it end or stop it"
    first = _single_node(args)
    t0 = time.time()
    while not (run / "logs").is_dir():  # the first launcher has checked and is starting its ranks
        assert first.poll() is None, first.output(60)
        assert time.time() - t0 < 300
        time.sleep(0.05)

    def second_launch_refused():
        second = _single_node(args)
        out = second.output(timeout=300)
        assert second.returncode == 2, out
        lines = _lines(out)
        assert len(lines) == 1 and re.match(rf"meshppo: config error: {refused}", lines[0]), out
        assert _pid_runs(int(re.search(holder, lines[0]).group(1)), "trainer.launch", str(run))

    second_launch_refused()  # while the first's ranks start
    _wait_for_a_step(first, run)
    logs = {f.name for f in (run / "logs").iterdir()}
    second_launch_refused()  # while the first runs
    assert {f.name for f in (run / "logs").iterdir()} == logs  # its logs never went there

    r = torchrun(args, timeout=300)  # every rank of it stops; rank 0 says why
    assert r.returncode != 0, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if line.startswith("meshppo: config error")]
    assert len(said) == 1 and re.match(rf"meshppo: config error \(rank 0\): {refused}", said[0]), r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr and "rank      : 1 (local_rank: 1)" in r.stderr, r.stderr[-3000:]

    first.send_signal(signal.SIGTERM)
    out = first.output(timeout=600)
    assert first.returncode == 0, out
    assert "in use" not in out, out  # the other launches' lines did not reach its output
    assert "in use" not in (run / "logs" / "rank0.log").read_text()
    latest = int((run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert [row["step"] for row in read_metrics(run)] == list(range(1, latest + 1))
