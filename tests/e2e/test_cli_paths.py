"""`launch/run_single_node.sh` from another directory: paths are the user's, not the repository's."""

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_single_node_resolves_paths_in_working_directory(tmp_path):
    # The working directory and the script's own path (a link to the repository) contain spaces.
    work = tmp_path / "my experiments"
    work.mkdir()
    (tmp_path / "mesh ppo").symlink_to(ROOT)
    shutil.copy(os.path.join(ROOT, "configs", "demo.yaml"), work / "my.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", str(tmp_path / "mesh ppo" / "launch" / "run_single_node.sh"), "--config", "my.yaml",
                        "trainer.experiment_name=2025-01-01", "--print-config", "trainer.default_local_dir=out"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "experiment_name: '2025-01-01'" in r.stdout and "default_local_dir: out" in r.stdout
    assert "Traceback" not in r.stderr
    # a missing relative config is looked for in the working directory
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "run_single_node.sh"), "--config", "configs/demo.yaml",
                        "--print-config"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "meshppo: config error: config file 'configs/demo.yaml' does not exist"
