"""KL-guard reactions wired into the trainer (in-process, world size 1, tiny model): each
configured action happens and is logged. warn_kl=1e-9 makes every step after the first (whose
KL to the reference is exactly 0) trigger the warning action."""

import pytest
import torch

from tests.e2e.conftest import demo_args, read_metrics
from trainer import cli

BASE = ["trainer.n_gpus_per_node=1", "trainer.total_training_steps=3", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "trainer.logger=[jsonl]",
        "trainer.export_hf_at_end=false", "actor_rollout_ref.actor.optim.lr=1e-2",
        "algorithm.kl_guard.warn_kl=1e-9", "algorithm.kl_guard.explode_kl=9", "algorithm.kl_guard.patience=1"]


def _run(assets, run, capsys, *extra):
    # The untrained model never solves the task: reward the response length instead, so the
    # advantages (and the update) are not zero.
    run.mkdir(parents=True, exist_ok=True)  # (a resumed run: the same directory)
    reward = run / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str))\n")
    code = cli.main(demo_args(assets, run, *BASE, f"custom_reward_function.path={reward}", *extra))
    return code, capsys.readouterr().err


def test_raise_coef_doubles_the_kl_loss_coefficient(tiny_assets, tmp_path, capsys):
    code, err = _run(tiny_assets, tmp_path / "r", capsys, "algorithm.kl_guard.warn_action=raise_coef")
    assert code == 0, err
    rows = read_metrics(tmp_path / "r")
    coefs = [row["actor/kl_coef"] for row in rows]
    # the coefficient used in a step is logged with it; the guard reacts after the step
    assert coefs == pytest.approx([0.01, 0.01, 0.02])
    assert rows[1]["kl_guard/action"] == "raise_coef" and "[kl_guard]" in err


def test_lower_lr_halves_the_learning_rate(tiny_assets, tmp_path, capsys):
    code, err = _run(tiny_assets, tmp_path / "l", capsys, "algorithm.kl_guard.warn_action=lower_lr")
    assert code == 0, err
    lrs = [row["actor/lr"] for row in read_metrics(tmp_path / "l")]
    assert lrs[0] == pytest.approx(1e-2) and lrs[1] == pytest.approx(1e-2) and lrs[2] == pytest.approx(5e-3)


def test_stop_ends_the_run_with_exit_code_3(tiny_assets, tmp_path, capsys):
    code, err = _run(tiny_assets, tmp_path / "s", capsys, "algorithm.kl_guard.warn_action=stop")
    assert code == 3 and "KL guard stopped the run at step 2" in err
    rows = read_metrics(tmp_path / "s")  # the step that stopped the run is logged, with the guard's action
    assert [row["step"] for row in rows] == [1, 2] and rows[1]["kl_guard/action"] == "stop"


def _actor_checkpoint(run, step):
    """The actor's weights and optimizer state saved at `step`, as plain tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / f"actor_{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"global_step_{step}" / "actor", out)
    return torch.load(out, weights_only=True)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_rollback_loads_a_checkpoint_from_before_the_kl_rose_and_never_an_abandoned_one(tiny_assets, tmp_path,
                                                                                       capsys, monkeypatch):
    """The KL of step K is measured on the weights step K-1 left, so a rollback for a streak that began
    at K goes back to checkpoint K-2 at the newest (it used to load K-1's, the very weights that tripped
    it, and roll back every step for ever), and never to a checkpoint of an abandoned branch. The KL the
    guard sees is scripted: high at steps 3 and 5 (patience 1)."""
    import json

    _scripted_kl(monkeypatch, {1: 0.0, 2: 0.0, 3: 0.03, 4: 0.0, 5: 0.03, 6: 0.0})
    run = tmp_path / "b"
    code, err = _run(tiny_assets, run, capsys, "algorithm.kl_guard.warn_action=rollback", "trainer.save_freq=1",
                     "trainer.total_training_steps=6")
    assert code == 0, err
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # the step counter moved on
    assert [row.get("kl_guard/action") for row in rows] == [None, None, "rollback", None, "rollback", None]
    assert all(row["actor/grad_norm"] > 0 for row in rows)  # every step updated the actor
    ckpt = {step: _actor_checkpoint(run, step) for step in range(1, 7)}
    moments = [state["exp_avg"] for state in ckpt[1]["optim"]["state"].values()]
    assert moments and any(m.abs().sum() > 0 for m in moments)
    same = lambda a, b: _equal(ckpt[a]["model"], ckpt[b]["model"]) and _equal(ckpt[a]["optim"], ckpt[b]["optim"])  # noqa: E731
    # step 3 judged step 2's weights: back to checkpoint 1 (not 2), which checkpoint 3 then holds
    assert f"step 3: rolled back the models to {run / 'checkpoints' / 'global_step_1'} (step 1;" in err
    assert same(3, 1) and not same(2, 1)
    # step 5 judged step 4's weights: checkpoint 3 (checkpoint 1's weights, judged healthy at step 4), not
    # the abandoned 2
    assert f"step 5: rolled back the models to {run / 'checkpoints' / 'global_step_3'} (step 3;" in err
    assert same(5, 3) and not same(5, 2) and not same(4, 3)
    # the record of the rollbacks is in the guard's checkpointed state (a resume keeps it)
    state = json.loads((run / "checkpoints" / "global_step_6" / "trainer_state.json").read_text())
    assert state["kl_guard"]["rollbacks"] == [[1, 3], [3, 5]]
    assert all((run / "checkpoints" / f"global_step_{step}").is_dir() for step in range(1, 7))  # none deleted


def test_rollback_without_a_checkpoint_says_so_and_never_loads_a_branch_a_resume_left(tiny_assets, tmp_path,
                                                                                     capsys, monkeypatch):
    """A rollback that finds no checkpoint from before the KL rose does nothing, and its row says so
    (`kl_guard/action`: rollback_skipped). A run resumed from an earlier checkpoint than the newest never
    rolls back to a checkpoint the earlier run left above it, only to the resumed one, an earlier one, or
    one it wrote since."""
    import json

    run = tmp_path / "r"
    # step 2's KL judged step 1's weights: the rollback needs a checkpoint of step 0, and there is none
    with monkeypatch.context() as patch:
        _scripted_kl(patch, {1: 0.0, 2: 0.03, 3: 0.0, 4: 0.0})
        code, err = _run(tiny_assets, run, capsys, "algorithm.kl_guard.warn_action=rollback", "trainer.save_freq=1",
                         "trainer.total_training_steps=4")
    assert code == 0, err
    assert [row.get("kl_guard/action") for row in read_metrics(run)] == [None, "rollback_skipped", None, None]
    assert "step 2: no checkpoint to roll back to" in err and "rolled back" not in err
    # Resumed from checkpoint 1, saving at steps 3 and 4: at step 4 (the KL rose there, judging step 3's
    # weights) checkpoint 2 is the earlier run's, checkpoint 1 the newest of this run's before step 3.
    _scripted_kl(monkeypatch, {2: 0.0, 3: 0.0, 4: 0.03})
    code, err = _run(tiny_assets, run, capsys, "algorithm.kl_guard.warn_action=rollback", "trainer.save_freq=3",
                     "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
                     f"trainer.resume_from_path={run / 'checkpoints' / 'global_step_1'}")
    assert code == 0, err
    assert [row.get("kl_guard/action") for row in read_metrics(run)] == [None, None, None, "rollback"]
    assert f"step 4: rolled back the models to {run / 'checkpoints' / 'global_step_1'} (step 1;" in err
    state = json.loads((run / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())
    assert state["kl_guard"]["stale_steps"] == [2]  # 3 and 4 rewritten by this run


def _scripted_kl(monkeypatch, script):
    """The guard sees `script[step]` as the step's KL (the run's own KL is the same every run only
    up to floating-point drift, and this picks which action fires at which step)."""
    from kl.guards import KLGuard

    check = KLGuard.check
    monkeypatch.setattr(KLGuard, "check", lambda self, kl, max_kl=None, step=None:
                        check(self, script[step], max_kl, step=step))


ROLLBACK_AT_4 = ["trainer.total_training_steps=5", "trainer.save_freq=1", "algorithm.kl_guard.warn_kl=0.02",
                 "algorithm.kl_guard.explode_kl=0.05", "algorithm.kl_guard.explode_action=rollback"]
KL_SCRIPT = {1: 0.0, 2: 0.0, 3: 0.03, 4: 0.06, 5: 0.0}  # warning at step 3, exploding at step 4


def test_rollback_keeps_the_raised_kl_coefficient(tiny_assets, tmp_path, capsys, monkeypatch):
    _scripted_kl(monkeypatch, KL_SCRIPT)
    run = tmp_path / "c"
    code, err = _run(tiny_assets, run, capsys, *ROLLBACK_AT_4, "algorithm.kl_guard.warn_action=raise_coef")
    assert code == 0, err
    rows = read_metrics(run)
    assert [row.get("kl_guard/action") for row in rows] == [None, None, "raise_coef", "rollback", None]
    # the KL rose at step 3, judging checkpoint 2's weights: back to checkpoint 1
    assert "rolled back the models to" in err and "global_step_1 (step 1;" in err
    # raised after step 3, and the rollback at step 4 keeps it (it used to restore checkpoint 2's 0.01)
    assert [row["actor/kl_coef"] for row in rows] == pytest.approx([0.01, 0.01, 0.01, 0.02, 0.02])


def test_rollback_keeps_the_lowered_learning_rate_and_the_schedule_position(tiny_assets, tmp_path, capsys,
                                                                            monkeypatch):
    import json

    _scripted_kl(monkeypatch, KL_SCRIPT)
    run = tmp_path / "d"
    code, err = _run(tiny_assets, run, capsys, *ROLLBACK_AT_4, "algorithm.kl_guard.warn_action=lower_lr")
    assert code == 0, err
    rows = read_metrics(run)
    assert [row.get("kl_guard/action") for row in rows] == [None, None, "lower_lr", "rollback", None]
    # lowered after step 3, and the rollback at step 4 keeps it (it used to restore checkpoint 2's 1e-2)
    assert [row["actor/lr"] for row in rows] == pytest.approx([1e-2, 1e-2, 1e-2, 5e-3, 5e-3])
    # the schedule is not rewound to checkpoint 2's position either: it stepped once per update
    state = json.loads((run / "checkpoints" / "global_step_5" / "trainer_state.json").read_text())
    assert state["actor_sched"]["last_epoch"] == 5
    assert state["actor_sched"]["base_lrs"] == pytest.approx([5e-3])



def test_a_rollback_does_not_say_that_extra_starts_fresh(tiny_assets, tmp_path, capsys, monkeypatch):
    """A rollback loads the model and optimizer and never extra (the LR schedule and RNG carry on):
    with extra left out of load_contents it said 'starting fresh: actor extra (LR schedule from its
    start, ...)', a resume's words, though the schedule went on (its position: the run's steps)."""
    import json

    _scripted_kl(monkeypatch, KL_SCRIPT)
    run = tmp_path / "e"
    code, err = _run(tiny_assets, run, capsys, *ROLLBACK_AT_4, "algorithm.kl_guard.warn_action=warn",
                     "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer]")
    assert code == 0, err
    assert [row.get("kl_guard/action") for row in read_metrics(run)] == [None, None, "warn", "rollback", None]
    assert "rolled back the models to" in err and "starting fresh" not in err
    state = json.loads((run / "checkpoints" / "global_step_5" / "trainer_state.json").read_text())
    assert state["actor_sched"]["last_epoch"] == 5
