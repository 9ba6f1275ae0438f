"""verl's reward managers (`reward_model.reward_manager`): dapo's overlong penalty, batch's one call
with lists, prime's process pool with its time limit; every one checked against hand-computed
values or naive's results."""

import math
import os
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rewards import (BatchRewardManager, DAPORewardManager, NaiveRewardManager, PrimeRewardManager, RewardError,
                     load_reward_manager)
from rewards.managers import overlong_penalty
from rewards.pool import FnSpec


def _buffer(len, penalty_factor, log, enable=True):
    return SimpleNamespace(enable=enable, len=len, penalty_factor=penalty_factor, log=log)


def _plain(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


# max_resp_len 10, buffer 4, factor 0.5: no penalty up to 6 tokens, -0.5 at 10, falling on beyond it
LENGTHS = [3, 6, 7, 8, 10, 12]
PENALTIES = [0.0, 0.0, -0.125, -0.25, -0.5, -0.75]


def test_overlong_penalty_is_verls_formula():
    """verl: expected = max_resp_len - len; exceed = L - expected; min(-exceed / len * factor, 0)."""
    assert [overlong_penalty(n, 10, 4, 0.5) for n in LENGTHS] == PENALTIES
    assert overlong_penalty(4, 4, 4, 1.0) == -1.0  # a buffer as long as max_resp_len: every token counts
    assert overlong_penalty(1, 4, 4, 2.0) == -0.5


@pytest.mark.parametrize("log", [True, False])
def test_dapo_adds_the_penalty_and_records_plain_scores_as_acc(log):
    n = len(LENGTHS)
    texts = ["a" if i % 2 else "b" for i in range(n)]
    manager = DAPORewardManager(_plain, "</s>", max_resp_len=10, overlong_buffer_cfg=_buffer(4, 0.5, log))
    scores, extras, others = manager(["d"] * n, texts, ["a"] * n, [{}] * n, LENGTHS)
    raw = [float(t == "a") for t in texts]
    assert scores == [r + p for r, p in zip(raw, PENALTIES)]
    expected = {"acc": raw}
    if log:
        expected |= {"overlong_reward": PENALTIES, "overlong": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]}
    assert extras == expected and list(extras) == list(expected) and others == {}


def test_dapo_dict_results_keep_their_extras_and_get_the_penalty():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "plain":
            return 0.25
        return {"score": 1.0, "pred": solution_str, "format": 0.5}

    manager = DAPORewardManager(fn, None, max_resp_len=10, overlong_buffer_cfg=_buffer(4, 0.5, True))
    scores, extras, others = manager(["d"] * 3, ["x", "plain", "y"], ["", "", ""], [{}] * 3, [8, 8, 3])
    assert scores == [0.75, 0.0, 1.0]
    # dict rows: their own extras (no acc); the plain row: acc only
    assert extras["format"][0] == 0.5 and math.isnan(extras["format"][1]) and extras["format"][2] == 0.5
    assert math.isnan(extras["acc"][0]) and extras["acc"][1] == 0.25 and math.isnan(extras["acc"][2])
    assert extras["overlong_reward"] == [-0.25, -0.25, 0.0] and extras["overlong"] == [1.0, 1.0, 0.0]
    assert others == {"pred": ["x", None, "y"]}


def test_dapo_without_an_enabled_buffer_adds_nothing():
    for cfg in (None, _buffer(4, 0.5, True, enable=False)):
        manager = DAPORewardManager(_plain, None, max_resp_len=10, overlong_buffer_cfg=cfg)
        scores, extras, _ = manager(["d"] * 2, ["a", "b"], ["a", "a"], [{}, {}], [12, 12])
        assert scores == [1.0, 0.0] and extras == {"acc": [1.0, 0.0]}


def test_dapo_cuts_a_trailing_eos_string_and_gives_verls_extra_info():
    """verl's dapo manager cuts `tokenizer.eos_token` from the end of the decoded response (only
    there), and adds `rollout_reward_scores` to extra_info but not naive's `num_turns`, `tool_rewards` and
    `turn_scores`."""
    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((solution_str, extra_info))
        return 0.0

    row = {"index": 3}
    DAPORewardManager(fn, "</s>")(["d"] * 3, ["12</s>", "</s>12", "12</s></s>"], ["", "", ""], [row, None, row],
                                  [1, 1, 1])
    assert [s for s, _ in seen] == ["12", "</s>12", "12</s>"]
    assert [e for _, e in seen] == [{"index": 3, "rollout_reward_scores": {}}, {"rollout_reward_scores": {}},
                                    {"index": 3, "rollout_reward_scores": {}}]
    assert row == {"index": 3}
    seen.clear()
    NaiveRewardManager(fn)(["d"], ["12</s>"], [""], [row], [1])
    assert seen == [("12</s>", {"index": 3, "num_turns": 2, "tool_rewards": [], "turn_scores": [],
                                "rollout_reward_scores": {}})]


def test_dapo_reports_errors_as_naive_does():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return "1" if solution_str == "bad" else 1.0

    with pytest.raises(RewardError, match=r"returned str '1' on sample 1 \(data_source='gsm'\)"):
        DAPORewardManager(fn, None)(["d", "gsm"], ["ok", "bad"], ["", ""], [{}, {}], [1, 1])


BATCH = '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0, bonus=0.0):
    SEEN.append(dict(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                     extra_infos=extra_infos, scale=scale, bonus=bonus))
    out = []
    for s, g in zip(solution_strs, ground_truths):
        if s == "dict":
            out.append({"score": scale, "pred": s, "len": len(s)})
        else:
            out.append(scale * (s == g) + bonus)
    return out

def per_row(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0

def short(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0] * (len(solution_strs) - 1)

def one_number(data_sources, solution_strs, ground_truths, extra_infos):
    return 1.0

def bad_item(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0, {"acc": 1}]

def broken(data_sources, solution_strs, ground_truths, extra_infos):
    raise ValueError("no batch today")

SEEN = []
'''


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "batch_reward.py"
    path.write_text(BATCH)
    return str(path)


def test_batch_calls_the_function_once_with_verls_arguments(batch_file):
    manager = load_reward_manager("batch", batch_file, "compute_score", {"scale": 2.0}, {"scale": 5.0, "bonus": 0.5})
    seen = manager.compute_score.__wrapped__.__globals__["SEEN"]
    row = {"index": 1}
    scores, extras, others = manager(["a", "b", "c"], ["x", "y", "dict"], ["x", "x", 7], [row, {}, None], [1, 2, 3])
    assert len(seen) == 1
    call = seen[0]
    # custom_reward_function.reward_kwargs (scale 2) win over reward_model.reward_kwargs (scale 5), as in verl
    assert call["scale"] == 2.0 and call["bonus"] == 0.5
    # verl's columns: NumPy object arrays for the data sources and extra infos, lists for the rest
    assert isinstance(call["data_sources"], np.ndarray) and call["data_sources"].tolist() == ["a", "b", "c"]
    assert call["solution_strs"] == ["x", "y", "dict"] and call["ground_truths"] == ["x", "x", 7]
    assert isinstance(call["extra_infos"], np.ndarray)
    assert call["extra_infos"].tolist() == [{"index": 1, "rollout_reward_scores": {}}, {"rollout_reward_scores": {}},
                                            {"rollout_reward_scores": {}}]
    assert row == {"index": 1}
    assert scores == [2.5, 0.5, 2.0]
    assert list(extras) == ["len"] and math.isnan(extras["len"][0]) and extras["len"][2] == 4.0
    assert others == {"pred": [None, None, "dict"]}


def test_batch_errors(batch_file):
    def manager(name, **kwargs):
        return load_reward_manager("batch", batch_file, name, manager_kwargs=kwargs)

    rows = (["d", "gsm"], ["x", "y"], ["x", "x"], [{}, {}], [1, 1])
    with pytest.raises(RewardError, match=r"short returned 1 results for a batch of 2 responses; expected a list of 2"):
        manager("short")(*rows)
    with pytest.raises(RewardError, match=r"one_number returned float 1\.0 for a batch of 2 responses"):
        manager("one_number")(*rows)
    with pytest.raises(RewardError, match=r"bad_item returned a dict without a 'score' key on sample 1 "
                                          r"\(data_source='gsm'\)"):
        manager("bad_item")(*rows)
    line = BATCH.splitlines().index('    raise ValueError("no batch today")') + 1
    with pytest.raises(RewardError, match=rf"broken raised on the batch of 2 responses at .*batch_reward\.py:{line}: "
                                          r"ValueError: no batch today") as info:
        manager("broken")(*rows)
    assert isinstance(info.value.__cause__, ValueError)
    # a per-response function, or one without the manager's keywords, is refused as it loads
    with pytest.raises(RewardError, match=r"'per_row' in custom reward file .* it is called by keyword, "
                                          r"fn\(data_sources=\.\.\., solution_strs=\.\.\., ground_truths=\.\.\., "
                                          r"extra_infos=\.\.\.\)"):
        manager("per_row")
    with pytest.raises(RewardError, match=r"fn\(data_sources=.*extra_infos=\.\.\., margin=\.\.\.\)"):
        manager("short", margin=1)


def test_batch_takes_any_sequence_of_results():
    import torch

    manager = BatchRewardManager(lambda **kw: torch.tensor([0.5, 1.0]))
    assert manager(["d"] * 2, ["x", "y"], ["", ""], [{}, {}], [1, 1])[0] == [0.5, 1.0]
    manager = BatchRewardManager(lambda **kw: (True, np.float32(0.25)))
    assert manager(["d"] * 2, ["x", "y"], ["", ""], [{}, {}], [1, 1])[0] == [1.0, 0.25]


PRIME = '''
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "dict":
        return {"score": 0.5, "pred": solution_str, "len": len(solution_str)}
    return float(solution_str == ground_truth)

def other_names(task, completion, reference, info):
    """verl's prime calls positionally: the parameter names are the function's own."""
    if completion == "sleep":
        time.sleep(60)
    if completion == "raise":
        raise KeyError("boom")
    if completion == "exit":
        os._exit(3)
    if completion == "tuple":
        return (0.75, {"why": "tuple"})
    if completion == "text":
        return "1"
    return float(completion == reference)

def three(data_source, solution_str, ground_truth):
    return 1.0
'''


@pytest.fixture
def prime_file(tmp_path):
    path = tmp_path / "prime_reward.py"
    path.write_text(PRIME)
    return str(path)


@pytest.fixture
def prime(prime_file):
    """A prime manager of `PRIME`'s function (by name) with 2 workers and a 2 s limit; its warnings."""
    made = []

    def make(name="compute_score", path=prime_file, timeout_s=2.0):
        warnings = []
        manager = PrimeRewardManager(FnSpec(path, name, {}), processes=2, timeout_s=timeout_s, warn=warnings.append)
        made.append(manager)
        return manager, warnings

    yield make
    for manager in made:
        manager.close()


def test_prime_scores_as_naive_does(prime, prime_file):
    rows = (["a", "b", "c", "d", "e"], ["x", "y", "dict", "x", "z"], ["x", "x", "x", "x", "z"], [{}] * 5, [1] * 5)
    manager, warnings = prime()
    scored = manager(*rows)
    naive = load_reward_manager("naive", prime_file)(*rows)
    naive[1].pop("acc")  # naive records plain scores as acc, as verl's reward loop does; prime does not (verl's)
    assert _same_scored(scored, naive)
    assert scored[0] == [1.0, 0.0, 0.5, 1.0, 1.0] and scored[2] == {"pred": [None, None, "dict", None, None]}
    assert list(scored[1]) == ["len"] and scored[1]["len"][2] == 4.0
    assert warnings == []
    # the built-in scorers without a file
    builtin = PrimeRewardManager(FnSpec(None, "compute_score", {}), processes=1)
    try:
        assert builtin(["meshppo/demo_add"] * 2, ["5", "6"], ["5", "5"], [{}, {}], [1, 1])[0] == [1.0, 0.0]
    finally:
        builtin.close()


def _same_scored(a, b) -> bool:
    """Two `(scores, extras, other_extras)` equal, NaN equal to NaN."""
    same = lambda x, y: np.array_equal(np.array(x, dtype=float), np.array(y, dtype=float), equal_nan=True)  # noqa: E731
    return (a[0] == b[0] and a[2] == b[2] and list(a[1]) == list(b[1])
            and all(same(a[1][k], b[1][k]) for k in a[1]))


def test_prime_failures_score_zero_without_hanging(prime):
    """verl's prime: a call that raises, runs past the limit or kills its worker scores 0 (and the
    batch says so); a tuple scores its first item. The pool lives on: the next batch is scored by
    the replacement workers."""
    manager, warnings = prime("other_names")
    texts = ["a", "sleep", "raise", "exit", "tuple", "b"]
    start = time.monotonic()
    scores, extras, others = manager(["d", "slow", "e", "x", "t", "d"], texts, ["a"] * 6, [{}] * 6, [1] * 6)
    assert time.monotonic() - start < 30  # the sleeper's 60 s were cut at 2
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.75, 0.0] and extras == {} and others == {}
    assert len(warnings) == 1
    assert warnings == ["reward_manager=prime: 3 of 6 calls failed and scored 0 (as verl's prime manager scores "
                        "them); the first: reward function other_names timed out after 2 s on sample 1 "
                        "(data_source='slow')"]
    assert manager(["d"] * 2, ["a", "b"], ["a", "a"], [{}, {}], [1, 1])[0] == [1.0, 0.0]
    assert len(warnings) == 1


@pytest.mark.parametrize("text,message", [
    ("sleep", "timed out after 2 s on sample 0 (data_source='d')"),
    ("raise", r"raised on sample 0 (data_source='d') at {path}:{line}: KeyError: 'boom'"),
    ("exit", "killed its worker process (exit code 3) on sample 0 (data_source='d')"),
])
def test_prime_says_why_a_call_scored_zero(prime, prime_file, text, message):
    manager, warnings = prime("other_names")
    line = PRIME.splitlines().index('        raise KeyError("boom")') + 1
    assert manager(["d"], [text], ["a"], [{}], [1])[0] == [0.0]
    assert warnings == ["reward_manager=prime: 1 of 1 calls failed and scored 0 (as verl's prime manager scores them); "
                        "the first: reward function other_names " + message.format(path=prime_file, line=line)]


def test_prime_refuses_what_naive_refuses(prime, prime_file, tmp_path):
    manager, _ = prime("other_names")
    with pytest.raises(RewardError, match=r"other_names returned str '1' on sample 1 \(data_source='b'\)"):
        manager(["a", "b"], ["x", "text"], ["x", "x"], [{}, {}], [1, 1])
    # called positionally with four arguments: a three-parameter function is refused as it loads
    with pytest.raises(RewardError, match=r"'three' in custom reward file .* it is called fn\(data_source, "
                                          r"solution_str, ground_truth, extra_info\)"):
        prime("three")
    # a worker that cannot load the function (the file broke after the manager was made) fails the batch
    path = tmp_path / "changing.py"
    path.write_text(PRIME)
    manager, _ = prime(path=str(path))
    path.write_text("raise ImportError('gone')\n")
    with pytest.raises(RewardError, match=r"a reward worker process could not load the reward function: RewardError: "
                                          r"importing custom reward file .*changing\.py failed .*ImportError: gone"):
        manager(["d"], ["x"], ["x"], [{}], [1])


def test_prime_close_stops_the_workers(prime):
    manager, _ = prime()
    manager(["d"] * 3, ["x", "y", "z"], ["x"] * 3, [{}] * 3, [1] * 3)
    workers = [w.proc for w in manager.pool._workers]
    assert len(workers) == 2 and all(p.is_alive() for p in workers)
    manager.close()
    assert not any(p.is_alive() for p in workers) and manager.pool._workers == []
    # a closed pool starts again on the next call
    assert manager(["d"], ["x"], ["x"], [{}], [1])[0] == [1.0]


def test_load_reward_manager_names_verls_managers(batch_file, prime_file):
    assert type(load_reward_manager("naive")) is NaiveRewardManager
    dapo = load_reward_manager("dapo", prime_file, manager_kwargs={"max_resp_len": 8,
                                                                   "overlong_buffer_cfg": _buffer(4, 1.0, False)},
                               eos_token="</s>")
    assert type(dapo) is DAPORewardManager and dapo.max_resp_len == 8 and dapo.eos_token == "</s>"
    assert type(load_reward_manager("batch", batch_file)) is BatchRewardManager
    manager = load_reward_manager("prime", prime_file, processes=3)
    assert type(manager) is PrimeRewardManager and manager.pool.processes == 3 and manager.pool.timeout_s == 300.0
    with pytest.raises(ValueError, match="unknown reward manager 'remote'"):
        load_reward_manager("remote")


def test_the_worker_imports_no_torch():
    """The workers load `rewards` (a fork of the fork server, not of the trainer): nothing there imports torch."""
    import subprocess
    import sys

    code = "import sys, rewards.managers; print('torch' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_prime_scores_positional_functions_of_any_parameter_names(prime):
    manager, _ = prime("other_names")
    assert manager(["d"] * 2, ["a", "b"], ["a", "a"], [{}, {}], [1, 1])[0] == [1.0, 0.0]
    with pytest.raises(RewardError, match="it is called by keyword"):
        load_reward_manager("naive", manager.pool.spec.path, "other_names")


def test_the_file_is_read_by_each_worker(prime, tmp_path):
    """A function defined in a file works: its module exists only where the file was executed."""
    path = tmp_path / "local_only.py"
    path.write_text(textwrap.dedent('''
        class Scorer:
            def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
                return 2.0

        compute_score = Scorer()
    '''))
    manager, _ = prime(path=str(path))
    assert manager(["d"], ["x"], ["x"], [{}], [1])[0] == [2.0]


HUNG = '''
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(solution_str, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
'''

TRAINER = '''
import sys
from rewards import PrimeRewardManager
from rewards.pool import FnSpec

if __name__ == "__main__":
    manager = PrimeRewardManager(FnSpec(sys.argv[1], "compute_score", {}), processes=1)
    manager(["d"], [sys.argv[2]], [""], [{}], [1])
'''


def test_a_hung_worker_dies_with_the_trainer(tmp_path):
    """A trainer killed outright (no `close`) while its worker hangs in the function leaves no worker behind."""
    import signal
    import subprocess
    import sys

    reward, trainer, marker = tmp_path / "hung.py", tmp_path / "trainer.py", tmp_path / "worker_pid"
    reward.write_text(HUNG)
    trainer.write_text(TRAINER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, str(trainer), str(reward), str(marker)], cwd=root,
                            env=dict(os.environ, PYTHONPATH=root))
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, "the trainer ended before its worker called the function"
            time.sleep(0.1)
        worker = int(marker.read_text())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while process_running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_running(worker)


def process_running(pid: int) -> bool:
    """`pid` is a process that has not exited (a zombie has: an orphan's waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_naive_records_plain_scores_as_acc_as_verls_reward_loop_does():
    """verl's default reward path (the reward loop's naive manager) records a plain result's score as
    the extra `acc` (what validation's core metric and filter_groups.metric=acc read); a dict result
    keeps its own keys."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "format": 1.0} if solution_str == "dict" else float(solution_str == ground_truth)

    scores, extras, _ = NaiveRewardManager(fn)(["d"] * 3, ["a", "dict", "b"], ["a"] * 3, [{}] * 3, [1] * 3)
    assert scores == [1.0, 0.5, 0.0]
    assert extras["acc"][0] == 1.0 and math.isnan(extras["acc"][1]) and extras["acc"][2] == 0.0
    assert math.isnan(extras["format"][0]) and extras["format"][1] == 1.0


def test_score_gives_the_functions_own_scores_before_the_overlong_penalty():
    """`score`'s fourth item (what filter_groups.metric=score reads) is what the function returned,
    bit for bit, not the penalized score minus the penalty; managers that add nothing return their scores."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.1 * len(solution_str), "acc": 1.0}

    texts = ["a" * k for k in range(1, len(LENGTHS) + 1)]
    rows = (["d"] * len(texts), texts, [""] * len(texts), [{}] * len(texts), LENGTHS)
    manager = DAPORewardManager(fn, None, max_resp_len=10, overlong_buffer_cfg=_buffer(4, 0.5, False))
    scores, _, _, own = manager.score(*rows)
    assert own == [0.1 * len(t) for t in texts]
    assert scores == [o + p for o, p in zip(own, PENALTIES)] and scores != own
    assert manager(*rows)[0] == scores
    for plain in (NaiveRewardManager(fn), DAPORewardManager(fn, None, max_resp_len=10, overlong_buffer_cfg=None)):
        scores, _, _, own = plain.score(*rows)
        assert own == scores == [0.1 * len(t) for t in texts]


ASYNC = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    await asyncio.sleep(0)
    return {"score": float(solution_str == ground_truth) + bonus, "acc": float(solution_str == ground_truth)}

async def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
    await asyncio.sleep(0)
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
'''


def test_async_reward_functions_are_awaited(tmp_path):
    """verl awaits an `async def` reward function; here each call runs it to its end (it returned a
    coroutine, refused at the first reward, after the models were built)."""
    path = tmp_path / "async_reward.py"
    path.write_text(ASYNC)
    rows = (["d"] * 3, ["a", "b", "a"], ["a"] * 3, [{}] * 3, [1] * 3)
    assert load_reward_manager("naive", str(path))(*rows)[0] == [1.0, 0.0, 1.0]
    assert load_reward_manager("naive", str(path), fn_kwargs={"bonus": 0.5})(*rows)[0] == [1.5, 0.5, 1.5]
    assert load_reward_manager("dapo", str(path), manager_kwargs={"max_resp_len": 4})(*rows)[0] == [1.0, 0.0, 1.0]
    assert load_reward_manager("batch", str(path), "batch_score")(*rows)[0] == [1.0, 0.0, 1.0]


CLASSES = '''
class Score(float):
    """A result of a class the reward file defines: unpickled in the trainer under the same module."""

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "unreadable":
        return Unreadable()
    return {"score": Score(1.0), "kind": Score(2.0)} if solution_str == "dict" else (Score(1.0), "why")

def refuse():
    raise RuntimeError("this result cannot be rebuilt")

class Unreadable(float):
    def __reduce__(self):
        return (refuse, ())
'''


def test_prime_reads_results_of_classes_its_file_defines(prime, tmp_path):
    """A worker and the trainer load the file under one module name (it was the path's hash(),
    which differs by process: unpickling such a result raised ModuleNotFoundError in the trainer);
    a result that still cannot be rebuilt there is that call's failure, scored 0 and said."""
    path = tmp_path / "class_reward.py"
    path.write_text(CLASSES)
    manager, warnings = prime(path=str(path))
    scores, extras, _ = manager(["d"] * 3, ["x", "dict", "unreadable"], ["x"] * 3, [{}] * 3, [1] * 3)
    assert scores == [1.0, 1.0, 0.0] and extras["kind"][1] == 2.0
    assert len(warnings) == 1 and "cannot be read in the trainer (RuntimeError: this result cannot be rebuilt)" \
        in warnings[0]


TOGETHER = '''
import asyncio

IN_FLIGHT = []

async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    IN_FLIGHT.append(solution_str)
    for _ in range(100):  # yields to the event loop until every call of the batch has started, or gives up
        if len(IN_FLIGHT) >= 3:
            break
        await asyncio.sleep(0)
    return {"score": float(len(IN_FLIGHT) >= 3), "echo": len(solution_str)}
'''


def test_async_reward_functions_are_awaited_together():
    """verl's reward loop gathers a batch's calls of an `async def` reward function; each call here ran
    to its end before the next began, so a function that waits on a judge waited once per response
    (512 responses of a 10 ms wait: 5.4 s against 0.02 s gathered). Every call of a batch is now in
    flight at once (each call below scores 1 only if it saw the batch's three calls started), results
    in the responses' order, with the naive and dapo managers."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "together.py")
        with open(path, "w") as f:
            f.write(TOGETHER)
        rows = (["d"] * 3, ["a", "bb", "ccc"], ["a"] * 3, [{}] * 3, [1] * 3)
        for manager, kwargs in (("naive", {}), ("dapo", {"manager_kwargs": {"max_resp_len": 4}})):
            scores, extras = load_reward_manager(manager, path, **kwargs)(*rows)[:2]
            assert scores == [1.0, 1.0, 1.0] and extras["echo"] == [1.0, 2.0, 3.0], (manager, scores, extras)
        # a call that raises names its sample, as a plain function's does
        with open(path, "w") as f:
            f.write("async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if solution_str == 'bb':\n        raise ValueError('judge down')\n    return 1.0\n")
        with pytest.raises(RewardError, match=r"sample 1 \(data_source='d'\).*ValueError: judge down"):
            load_reward_manager("naive", path)(*rows)


def test_gdpo_calls_as_naive_with_the_experiment_name():
    """verl's gdpo manager (its gdpo recipe's reward.reward_manager.name=gdpo): naive's calls, each
    extra_info the row's plus the run's experiment_name and without num_turns; a plain score is also `acc`."""
    from rewards import load_reward_manager

    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return float(solution_str == ground_truth)

    manager = load_reward_manager("gdpo", experiment_name="exp-7")
    manager.compute_score = fn
    scores, extras, _ = manager(["d"] * 2, ["a", "b"], ["a"] * 2, [{"index": 3}, None], [1] * 2)
    assert scores == [1.0, 0.0] and extras["acc"] == [1.0, 0.0]
    assert [{k: v for k, v in e.items() if k != "rollout_reward_scores"} for e in seen] == [
        {"index": 3, "experiment_name": "exp-7"}, {"experiment_name": "exp-7"}]
