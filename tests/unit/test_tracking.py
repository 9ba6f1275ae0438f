"""trainer.tracking: what each sink writes, read back (metrics.jsonl, progress bar, TensorBoard,
wandb offline), the run directory's record (config.yaml, run_info.json, banner) and dumps."""

import dataclasses
import glob
import json
import os
import stat
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from trainer.config import PPOConfig
from trainer.configlib import load_config, to_commented_yaml
from trainer.tracking import Tracking, banner, dump_generations, run_info

ROW = {"critic/score/mean": 0.5, "actor/ref_kl": 0.0123, "perf/throughput": 1234.0,
       "val/meshppo/demo_add/score": 0.45}


def _info(run_dir, step=0):
    dims = SimpleNamespace(hsdp=False, dp_shard=2, dp_replicate=1, tp=1, rollout_dp=2)
    return run_info(torch.device("cpu"), 2, 2, dims, str(run_dir), step)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_begin_keeps_metrics_up_to_the_start_step_and_records_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    # steps 0..4 from an attempt that checkpointed step 2, then died mid-write of step 5
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(5))
                                       + '{"step": 5, "x"')
    cfg = PPOConfig()
    cfg.algorithm.adv_estimator = "rloo"
    t = Tracking(["jsonl"], str(run), "p", "e", {}, 10, enabled=True)
    t.begin(2, to_commented_yaml(cfg), _info(run, 2))
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [0, 1, 2]
    t.log({"x": 3}, step=3)
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [0, 1, 2, 3]
    # the saved config is the resolved one, and loads back as the same config
    assert dataclasses.asdict(load_config(PPOConfig, run / "config.yaml")) == dataclasses.asdict(cfg)
    info = json.loads((run / "run_info.json").read_text())
    assert info["device"] == "cpu" and info["world_size"] == 2 and info["run_dir"] == str(run.resolve())
    assert info["torch"] == torch.__version__ and info["start_step"] == 2
    err = capsys.readouterr().err
    assert f"torch {torch.__version__}" in err and "CPU (no CUDA)" in err
    assert "world: 2 ranks = 1 node x 2, cpu" in err and "FULL_SHARD over 2 ranks" in err
    assert f"run directory: {run.resolve()} (resumed at step 2)" in err
    # a fresh start keeps nothing of an earlier run
    Tracking(["jsonl"], str(run), "p", "e", {}, 10, enabled=True).begin(0, "{}", _info(run))
    assert (run / "metrics.jsonl").read_text() == ""


def test_tensorboard_keeps_the_steps_up_to_the_start_step(tmp_path):
    """As metrics.jsonl: a resumed run's TensorBoard shows each step once, the resumed run's value for the
    steps after the checkpoint (a killed attempt logged 1-4, checkpointed 2), and a fresh start in the same
    directory none of the earlier run's."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars():
        acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("x")]

    def attempt(start, steps, value):
        t = Tracking(["tensorboard"], str(tmp_path / "run"), "p", "e", {}, 10, enabled=True)
        t.begin(start, "{}", _info(tmp_path / "run", start))
        for step in steps:
            t.log({"x": value + step}, step=step)
        t.close()

    attempt(0, [0, 1, 2, 3, 4], 10.0)  # step 0: val_before_train's row
    attempt(2, [3, 4, 5], 20.0)
    assert scalars() == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]
    attempt(0, [0, 1], 30.0)
    assert scalars() == [(0, 30.0), (1, 31.0)]


def test_banner_of_a_gpu_hsdp_run():
    info = {"meshppo": "abc", "torch": "2.13", "python": "3.11", "cuda": "12.8", "nccl": "2.27.3", "device": "cuda",
            "gpu": "NVIDIA H200", "backend": "nccl", "world_size": 16, "nodes": 2, "ranks_per_node": 8,
            "fsdp": "HYBRID_SHARD", "dp_shard": 8, "dp_replicate": 2, "tp": 2, "rollout_dp": 8, "run_dir": "/r",
            "start_step": 0}
    assert banner(info).splitlines() == [
        "meshppo abc | torch 2.13 | CUDA 12.8, NCCL 2.27.3 | python 3.11",
        "world: 16 ranks = 2 nodes x 8, cuda (NVIDIA H200), nccl | training: HYBRID_SHARD over 8 ranks x 2 "
        "replicas | generation: TP 2 x 8 engine replicas",
        "run directory: /r (fresh start)"]
    # shard groups of one rank: nothing sharded, each rank a replica (one GPU: one replica)
    for world, replicas in ((1, "1 replica"), (8, "8 replicas")):
        info.update(world_size=world, nodes=1, ranks_per_node=world, fsdp="HYBRID_SHARD" if world > 1 else "FULL_SHARD",
                    dp_shard=1, dp_replicate=world, tp=1, rollout_dp=world)
        assert f"| training: unsharded, {replicas} | generation: TP 1 x " in banner(info).splitlines()[1]
    info.update(ulysses={"actor": 2, "critic": 4})
    assert "| training: unsharded, 8 replicas, Ulysses groups: actor 2, critic 4 | generation:" in banner(info)


def test_dump_generations_writes_verl_layout(tmp_path):
    rows = [{"input": "1+2=", "output": "3", "gts": "3", "score": 1.0, "acc": float("nan"), "step": 7},
            {"input": "2+2=", "output": "5", "gts": "4", "score": 0.0, "acc": 0.0, "step": 7}]
    path = dump_generations(str(tmp_path / "dumps"), 7, rows)
    assert path == str(tmp_path / "dumps" / "7.jsonl")
    back = _lines(tmp_path / "dumps" / "7.jsonl")
    assert back[1] == rows[1] and back[0]["acc"] is None  # NaN is not JSON
    # ground truths are any stored value (verl hands them on unconverted): they are dumped as JSON, not as text
    rows = [{"input": "q", "output": "a", "gts": gts, "score": 0.0, "step": 8}
            for gts in (["Paris", "paris"], {"target": ["Paris"]}, 72, True, None)]
    dump_generations(str(tmp_path / "dumps"), 8, rows)
    assert _lines(tmp_path / "dumps" / "8.jsonl") == rows


def test_dump_generations_writes_what_json_cannot_as_text(tmp_path):
    """A reward function's extras are anything: tensors and NumPy values as their numbers or lists,
    anything json cannot write as its str() (a dump never stops a run), NaN and infinities as the
    metrics write them."""
    import numpy as np

    cycle = []
    cycle.append(cycle)
    values = {"tensor": torch.tensor([1.5, 2.0]), "array": np.array([[1, 2]]), "int64": np.int64(3),
              "tuple_key": {(1, 2): "x"}, "nested_nan": [1.0, float("nan")], "cycle": cycle,
              "obj": {"a": object()}, "inf": float("inf"), "nan": float("nan"), "text": "ok"}
    path = dump_generations(str(tmp_path / "dumps"), 9, [{"step": 9, **values}])
    (row,) = _lines(tmp_path / "dumps" / "9.jsonl")
    assert row["tensor"] == [1.5, 2.0] and row["array"] == [[1, 2]] and row["int64"] == 3
    assert row["tuple_key"] == "{(1, 2): 'x'}" and row["nested_nan"] == "[1.0, nan]" and row["cycle"] == "[[...]]"
    assert row["obj"]["a"].startswith("<object object at ")
    assert row["inf"] == 1e308 and row["nan"] is None and row["text"] == "ok"
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["9.jsonl"] and path.endswith("9.jsonl")


def _bar_text(err: str) -> str:
    return err.replace("\r", "\n").strip().splitlines()[-1]


def test_progress_bar_shows_reward_kl_throughput_and_validation(tmp_path, capsys):
    t = Tracking(["console"], str(tmp_path), "p", "e", {}, 10, enabled=True)
    # no bar before the run begins: an error said while it starts (its checkpoint, its data) is a
    # line of its own, not glued to a bar's redraw
    assert capsys.readouterr().err == ""
    t.begin(2, "{}", _info(tmp_path))
    assert _bar_text(capsys.readouterr().err).startswith("ppo:  20%")  # resumed at step 2
    t.log(ROW, step=3)
    line = _bar_text(capsys.readouterr().err)
    assert "3/10" in line
    assert "reward=0.5, kl=0.0123, tok/s=1234, demo_add_val=0.450" in line
    t.close()


def test_progress_without_tqdm_prints_one_line_per_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    t = Tracking(["console"], str(tmp_path), "p", "e", {}, 10, enabled=True)
    t.begin(0, "{}", _info(tmp_path))
    capsys.readouterr()  # the banner
    t.log(ROW, step=3)
    assert capsys.readouterr().err == ("step 3: {'reward': '0.5', 'kl': '0.0123', 'tok/s': '1234'} "
                                       "{'demo_add_val': '0.450'}\n")


def test_other_ranks_write_nothing(tmp_path, capsys):
    t = Tracking(["console", "jsonl"], str(tmp_path / "r1"), "p", "e", {}, 10, enabled=False)
    t.begin(0, "{}", _info(tmp_path))
    t.log(ROW, step=1)
    t.close()
    assert not (tmp_path / "r1").exists() and capsys.readouterr().err == ""


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking(["tensorboard"], str(tmp_path), "p", "e", {}, 10, enabled=True)
    t.begin(0, "{}", _info(tmp_path))
    for step in (1, 2, 3):
        t.log({"critic/score/mean": 0.25 * step, "kl_guard/action": "warn"}, step=step)
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["critic/score/mean"]  # a string is not a scalar
    events = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_tensorboard_dir_from_the_environment(tmp_path, monkeypatch):
    """verl's TENSORBOARD_DIR, when set, is where the events go (else the run directory's tensorboard/)."""
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    t = Tracking(["tensorboard"], str(tmp_path / "run"), "p", "e", {}, 10, enabled=True)
    t.begin(0, "{}", _info(tmp_path / "run"))
    t.log({"critic/score/mean": 0.5}, step=1)
    t.close()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    assert not (tmp_path / "run" / "tensorboard").exists()


def _wandb_records(path):
    """The protobuf records of a `.wandb` file: a 7-byte ":W&B" header, then LevelDB's log
    format (32 KiB blocks of chunks with a 7-byte header: crc32c, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # Tracking makes it offline by default
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracking(["wandb"], str(tmp_path), "proj", "exp", {"algorithm": {"adv_estimator": "grpo"}}, 10, enabled=True)
    assert not (tmp_path / "wandb").exists()  # the run starts in begin, which the trainer agrees on every rank
    t.begin(0, "{}", _info(tmp_path))
    for step in (1, 2):
        t.log({"critic/score/mean": 0.5 * step, "actor/ref_kl": 0.01}, step=step)
    t.close()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process may still be flushing the file when finish() returns; wandb 0.17 writes the
    # last step's history after the exit record (then the summary and a footer), later versions before it
    deadline = time.monotonic() + 60
    while "exit" not in (kinds := [r.WhichOneof("record_type") for r in _wandb_records(path)]) or kinds.count(
            "history") < 2:
        assert time.monotonic() < deadline, "the offline run file never got its exit record and both steps' history"
        time.sleep(0.2)
    history, config = [], {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            assert record.run.project == "proj" and record.run.display_name == "exp"
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert [(h["_step"], h["critic/score/mean"], h["actor/ref_kl"]) for h in history] == [(1, 0.5, 0.01),
                                                                                         (2, 1.0, 0.01)]
    assert config["algorithm"] == {"adv_estimator": "grpo"}


class FakeWandb:
    """A `wandb` module that records each `init`'s arguments; its runs take the given id, else a new one."""

    def __init__(self):
        self.inits = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(id=kwargs.get("id") or f"run{len(self.inits)}", log=lambda *a, **k: None,
                               finish=lambda: None)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """Each start made a new wandb run, so a preempted job's curve was cut into one run per attempt (as
    verl's is). The first start's run id is kept in the run directory and a resumed run continues that run
    (resume="allow"); a fresh start in the same directory makes a new one."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"

    def start(step, val_only=False):
        t = Tracking(["wandb"], str(run), "proj", "exp", {"trainer": {"val_only": val_only}}, 10, enabled=True)
        t.begin(step, "{}", _info(run, step))
        t.close()
        return fake.inits[-1]

    first = start(0)
    assert "id" not in first and "resume" not in first and first["project"] == "proj" and first["name"] == "exp"
    assert (run / "wandb_run_id").read_text() == "run1\n"
    assert start(2) == {**first, "id": "run1", "resume": "allow"}
    assert start(4)["id"] == "run1"
    # a validation of the checkpoint (its row at a step the run holds, which wandb would drop): a run of its own
    assert "id" not in start(4, val_only=True) and (run / "wandb_run_id").read_text() == "run1\n"
    fresh = start(0)  # resume_mode=disable, or no checkpoint yet: a run of its own
    assert "id" not in fresh and (run / "wandb_run_id").read_text() == "run5\n"
    assert start(1)["id"] == "run5"


def test_an_offline_resumed_run_keeps_its_wandb_run_id(tmp_path, monkeypatch):
    """The real wandb, offline (meshppo's default): it resumes no run offline, but the resumed start's
    offline directory carries the first start's run id."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for step in (0, 2):
        t = Tracking(["wandb"], str(tmp_path), "proj", "exp", {}, 10, enabled=True)
        t.begin(step, "{}", _info(tmp_path, step))
        t.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))  # one per start
    assert sorted(os.path.basename(f) for f in files) == [f"run-{run_id}.wandb"] * 2, (run_id, files)


@pytest.mark.skipif(not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)),
                    reason="needs /dev/full, the full-disk device (Linux)")
def test_a_full_disk_under_the_metrics_or_a_dump_is_a_user_error_naming_the_file(tmp_path):
    """A full disk (a quota, permissions) under metrics.jsonl or a generation dump was an OSError: a
    traceback on rank 0 that names neither the file nor the option. Now one UserError names the file."""
    from trainer.errors import UserError

    run = tmp_path / "run"
    run.mkdir()
    os.symlink("/dev/full", run / "metrics.jsonl")  # every write: ENOSPC
    tracking = Tracking(["jsonl"], str(run), "p", "e", {}, 2, True)
    with pytest.raises(UserError, match=rf"^writing {run}/metrics.jsonl failed \(No space left on device\)$"):
        tracking.log(ROW, step=1)
    dumps = tmp_path / "dumps"
    os.makedirs(dumps / "3.jsonl.tmp")  # the dump's temporary name taken: IsADirectoryError
    with pytest.raises(UserError, match=rf"^writing {dumps}/3.jsonl failed \(Is a directory\)$"):
        dump_generations(str(dumps), 3, [{"input": "a", "output": "b"}])
    assert not os.path.exists(dumps / "3.jsonl")


def test_wandb_files_go_to_wandb_dir_when_it_is_set(tmp_path, monkeypatch):
    """wandb.init's dir overrides WANDB_DIR, so the run directory took a run's wandb files wherever
    WANDB_DIR pointed (verl passes no dir: WANDB_DIR, else ./wandb). dir is now the run directory only
    where WANDB_DIR is unset."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for wandb_dir, expected in ((str(tmp_path / "elsewhere"), None), ("", str(tmp_path / "run"))):
        monkeypatch.setenv("WANDB_DIR", wandb_dir)
        t = Tracking(["wandb"], str(tmp_path / "run"), "proj", "exp", {}, 10, enabled=True)
        t.begin(0, "{}", _info(tmp_path / "run"))
        t.close()
        assert fake.inits[-1].get("dir") == expected, fake.inits[-1]



def _file_logger_env(monkeypatch, path=None, root=None):
    for name, value in (("VERL_FILE_LOGGER_PATH", path), ("VERL_FILE_LOGGER_ROOT", root)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_file_logger_writes_verls_lines(tmp_path, monkeypatch, capsys):
    """verl's file logger (trainer.logger=file): one line per logged step, {"step": s, "data": {metrics}}, as
    verl 0.9.1's FileLogger writes it (orjson: compact, UTF-8 as it is, NaN as null; the expected lines are
    what it writes for these rows), the values as metrics.jsonl's (an infinity as 1e+308, where orjson writes
    null), in VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl; the start-up says where."""
    _file_logger_env(monkeypatch, root=str(tmp_path / "logs"))
    t = Tracking(["console", "jsonl", "file"], str(tmp_path / "run"), "proj", "exp", {}, 10, enabled=True)
    path = tmp_path / "logs" / "proj" / "exp.jsonl"
    assert not path.parent.exists()  # nothing is written before begin
    t.begin(0, "{}", _info(tmp_path / "run"))
    assert path.read_text() == ""
    assert (f"file logger: {path} (VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl; a fresh start: "
            "emptied)") in capsys.readouterr().err
    t.log({"critic/score/mean": 0.5, "actor/ref_kl": torch.tensor(0.25), "perf/total_num_tokens": 1234,
           "actor/pg_loss": float("nan"), "val/données/score": 1.0, "kl_guard/action": "warn"}, step=1)
    t.log({"critic/score/mean": 0.75, "actor/grad_norm": float("inf")}, step=2)
    t.close()
    assert path.read_text(encoding="utf-8") == (
        '{"step":1,"data":{"critic/score/mean":0.5,"actor/ref_kl":0.25,"perf/total_num_tokens":1234,'
        '"actor/pg_loss":null,"val/données/score":1.0,"kl_guard/action":"warn"}}\n'
        '{"step":2,"data":{"critic/score/mean":0.75,"actor/grad_norm":1e+308}}\n')
    # the same rows as metrics.jsonl's, laid out as verl's
    assert [{"step": r["step"], **r["data"]} for r in _lines(path)] == _lines(tmp_path / "run" / "metrics.jsonl")


def test_file_logger_path_from_the_environment(tmp_path, monkeypatch):
    """As verl's: VERL_FILE_LOGGER_PATH over VERL_FILE_LOGGER_ROOT over the working directory, `~` expanded."""
    from trainer.tracking import file_logger_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = [({}, tmp_path / "proj" / "exp.jsonl"),
             ({"root": "roots/r"}, tmp_path / "roots" / "r" / "proj" / "exp.jsonl"),
             ({"root": "~/logs"}, tmp_path / "home" / "logs" / "proj" / "exp.jsonl"),
             ({"root": "roots/r", "path": "out/m.jsonl"}, tmp_path / "out" / "m.jsonl"),
             ({"path": "~/m.jsonl"}, tmp_path / "home" / "m.jsonl"),
             ({"root": "", "path": ""}, tmp_path / "proj" / "exp.jsonl")]  # empty: unset
    for env, expected in cases:
        _file_logger_env(monkeypatch, **env)
        assert file_logger_path("proj", "exp")[0] == expected, env
        t = Tracking(["file"], str(tmp_path / "run"), "proj", "exp", {}, 10, enabled=True)
        t.begin(0, "{}", _info(tmp_path / "run"))
        t.log({"x": 1.0}, step=1)
        assert expected.read_text() == '{"step":1,"data":{"x":1.0}}\n', env


def test_file_logger_keeps_the_rows_up_to_the_resumed_step(tmp_path, monkeypatch):
    """verl opens the file "wb" at every start, so a resumed run lost every earlier row. As metrics.jsonl: a
    run resumed at step 2 keeps the rows of steps 0-2 (the killed attempt's steps 3-4 and its torn line go), a
    validation-only run at step 4 adds its row after the steps up to 4, and a fresh start empties the file."""
    path = tmp_path / "f.jsonl"
    _file_logger_env(monkeypatch, path=str(path))
    path.write_text("".join(json.dumps({"step": s, "data": {"x": s}}) + "\n" for s in range(5))
                    + '{"step": 5, "data": {"x"')

    def start(step, steps=(), val_only=False):
        t = Tracking(["file"], str(tmp_path / "run"), "p", "e", {"trainer": {"val_only": val_only}}, 10, True)
        t.begin(step, "{}", _info(tmp_path / "run", step))
        for s in steps:
            t.log({"x": 10 * s}, step=s)
        t.close()
        return [(r["step"], r["data"]["x"]) for r in _lines(path)]

    assert start(2, [3, 4]) == [(0, 0), (1, 1), (2, 2), (3, 30), (4, 40)]
    assert start(4, [4], val_only=True) == [(0, 0), (1, 1), (2, 2), (3, 30), (4, 40), (4, 40)]
    assert start(0, [0]) == [(0, 0)]


def test_file_logger_on_other_ranks_writes_nothing(tmp_path, monkeypatch):
    _file_logger_env(monkeypatch, root=str(tmp_path / "logs"))
    t = Tracking(["console", "file"], str(tmp_path / "r1"), "p", "e", {}, 10, enabled=False)
    t.begin(0, "{}", _info(tmp_path))
    t.log(ROW, step=1)
    t.close()
    assert not (tmp_path / "logs").exists() and not (tmp_path / "r1").exists()


def test_file_logger_that_cannot_write_is_a_user_error_at_the_start(tmp_path, monkeypatch):
    """An unwritable place (here under a file) stops the run at its start, naming the file and the variable."""
    from trainer.errors import UserError

    (tmp_path / "a_file").write_text("")
    path = tmp_path / "a_file" / "m.jsonl"
    _file_logger_env(monkeypatch, path=str(path))
    t = Tracking(["file"], str(tmp_path / "run"), "p", "e", {}, 10, enabled=True)
    with pytest.raises(UserError, match=rf"^writing {path} \(trainer.logger=file, VERL_FILE_LOGGER_PATH\) failed "
                                        r"\(Not a directory\)$"):
        t.begin(0, "{}", _info(tmp_path / "run"))
    _file_logger_env(monkeypatch, root=str(tmp_path / "a_file"))
    t = Tracking(["file"], str(tmp_path / "run"), "p", "e", {}, 10, enabled=True)
    with pytest.raises(UserError, match=rf"^writing {tmp_path}/a_file/p/e.jsonl \(trainer.logger=file, "
                                        r"VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl\) failed "
                                        r"\(Not a directory\)$"):
        t.begin(0, "{}", _info(tmp_path / "run"))


def test_wandb_proxy_is_wandbs_https_proxy(tmp_path, monkeypatch):
    """verl's +trainer.wandb_proxy=URL: wandb.init gets wandb.Settings(https_proxy=URL); without it, no settings
    (wandb's own, HTTPS_PROXY included). A URL wandb refuses is one line naming the option."""
    wandb = pytest.importorskip("wandb")
    from trainer.errors import UserError

    inits = []
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or SimpleNamespace(id="r", finish=lambda: None))
    for proxy in ("http://proxy:3128", None, ""):
        t = Tracking(["wandb"], str(tmp_path / "run"), "proj", "exp", {"trainer": {"wandb_proxy": proxy}}, 10, True)
        t.begin(0, "{}", _info(tmp_path / "run"))
        t.close()
        settings = inits[-1].get("settings")
        assert (settings.https_proxy if settings is not None else None) == (proxy or None), inits[-1]
    t = Tracking(["wandb"], str(tmp_path / "run"), "proj", "exp", {"trainer": {"wandb_proxy": "proxy:3128"}}, 10, True)
    with pytest.raises(UserError, match=r"^trainer.wandb_proxy='proxy:3128': wandb does not take it as its https "
                                        r"proxy \(.+\); give a URL such as http://proxy:3128$"):
        t.begin(0, "{}", _info(tmp_path / "run"))


def test_wandb_proxy_is_a_trainer_option_said_unused_without_wandb():
    """+trainer.wandb_proxy (verl's Tracking reads it, its yaml lacks it) was an unknown key ('did you mean
    trainer.val_only?'); now an option, passed to wandb, and said to change nothing when trainer.logger has no
    wandb."""
    from trainer.config import config_notes, validate
    from trainer.configlib import load_config

    demo = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml")

    def notes(*overrides):
        cfg = load_config(PPOConfig, demo, list(overrides))
        validate(cfg)
        return cfg, [n for n in config_notes(cfg) if "wandb_proxy" in n]

    cfg, said = notes("+trainer.wandb_proxy=http://proxy:3128", "trainer.logger=[console,jsonl]")
    assert cfg.trainer.wandb_proxy == "http://proxy:3128"
    assert dataclasses.asdict(cfg)["trainer"]["wandb_proxy"] == "http://proxy:3128"  # what Tracking reads
    assert said == ["trainer.wandb_proxy=http://proxy:3128 has no effect: it is wandb's proxy, and "
                    "trainer.logger=[console, jsonl] has no wandb"]
    assert notes("trainer.wandb_proxy=http://proxy:3128", "trainer.logger=[console,wandb]")[1] == []
    assert notes("trainer.logger=[console,jsonl]")[1] == []
    assert PPOConfig().trainer.wandb_proxy is None


def test_validation_generations_go_to_tensorboard_and_wandb_with_the_validations_row(tmp_path, monkeypatch):
    """trainer.log_val_generations' samples, queued by the validation, are written with the next row (the
    validation's) as verl's: a `val/generations` text in TensorBoard and a `val/generations` wandb table,
    columns step, input_i, output_i, score_i, one row a validation (each logged table holds the earlier
    rows); a row without queued samples writes none, and the jsonl row is unchanged."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged, tables = [], []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data
            tables.append(self)

    fake = SimpleNamespace(Table=Table, init=lambda **kw: SimpleNamespace(
        id="r", log=lambda values, step: logged.append((step, values)), finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = Tracking(["jsonl", "tensorboard", "wandb"], str(tmp_path), "p", "e", {}, 10, enabled=True)
    t.begin(0, "{}", _info(tmp_path))
    t.queue_generations([("1+2=", "3", 1.0), ("4+5=", "8", 0.0)])
    t.log({"val/demo/score": 0.5}, step=0)
    t.log({"critic/score/mean": 0.25}, step=1)
    t.queue_generations([("1+2=", "4", 0.0), ("4+5=", "9", 1.0)])
    t.log({"val/demo/score": 0.5}, step=2)
    t.close()

    assert [(s, sorted(v)) for s, v in logged] == [(0, ["val/demo/score", "val/generations"]),
                                                   (1, ["critic/score/mean"]), (2, ["val/demo/score", "val/generations"])]
    columns = ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert logged[0][1]["val/generations"].columns == logged[2][1]["val/generations"].columns == columns
    assert logged[0][1]["val/generations"].data == [[0, "1+2=", "3", 1.0, "4+5=", "8", 0.0]]
    assert logged[2][1]["val/generations"].data == [[0, "1+2=", "3", 1.0, "4+5=", "8", 0.0],
                                                    [2, "1+2=", "4", 0.0, "4+5=", "9", 1.0]]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 0, "val/demo/score": 0.5}, {"step": 1, "critic/score/mean": 0.25}, {"step": 2, "val/demo/score": 0.5}]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("val/generations/text_summary")
    assert [e.step for e in texts] == [0, 2]
    second = texts[1].tensor_proto.string_val[0].decode()
    assert "**Input:** 1+2=" in second and "**Output:** 4" in second and "**Score:** 1.0" in second
