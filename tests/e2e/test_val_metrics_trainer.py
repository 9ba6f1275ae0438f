"""End-to-end: verl's validation metrics (`val-core/`, `val-aux/`) logged by a 2-rank run."""

import json
import math

from tests.e2e.conftest import demo_args, read_metrics, train_in_ranks
from trainer.val_metrics import validation_metrics

VAL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The length; acc: the answer right; pred: the first character (few answers: ties); a string
    extra; `ones` only on responses with a 1 in them."""
    out = {"score": len(solution_str) / 10, "acc": solution_str.strip() == str(ground_truth),
           "pred": solution_str[:1], "note": "text " + solution_str[:2]}
    if "1" in solution_str:
        out["ones"] = solution_str.count("1")
    return out
'''


def test_validation_logs_verls_metrics_of_the_dumped_samples(tiny_assets, tmp_path):
    """val_kwargs.n=4 sampled responses per prompt, validated in chunks of 6 prompts
    (data.val_batch_size; 16 prompts) on 2 ranks: the logged metrics are `validation_metrics` of
    the validation dump's rows (each prompt's 4 rows in a block, the prompts of every chunk their
    own), `acc` the core variable, the string extra no variable, `pred` voting; `val/.../score`
    stays the mean score."""
    reward = tmp_path / "reward.py"
    reward.write_text(VAL_REWARD)
    run = tmp_path / "run"
    train_in_ranks(demo_args(tiny_assets, run, "trainer.val_only=true", f"custom_reward_function.path={reward}",
                             f"trainer.validation_data_dir={tmp_path / 'val'}", "data.val_batch_size=6",
                             "actor_rollout_ref.rollout.val_kwargs.n=4",
                             "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"))
    (logged,) = read_metrics(run)
    with open(tmp_path / "val" / "0.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 16 * 4
    variables = {"reward": [row["score"] for row in rows], "acc": [row["acc"] for row in rows],
                 "ones": [math.nan if row["ones"] is None else row["ones"] for row in rows]}
    want = validation_metrics([row["data_source"] for row in rows], [i // 4 for i in range(len(rows))], variables,
                              [row["pred"] for row in rows])
    got = {k: v for k, v in logged.items() if k.startswith(("val-core/", "val-aux/"))}
    # single-turn samples: 2 turns each, logged as verl 0.9.1's agent loop logs them in every run
    turns = {k: got.pop(k) for k in list(got) if k.startswith("val-aux/num_turns/")}
    assert turns == {"val-aux/num_turns/min": 2, "val-aux/num_turns/max": 2, "val-aux/num_turns/mean": 2.0}
    assert got == want
    src = "val-core/meshppo/demo_add"
    assert {k for k in got if k.startswith("val-core/")} == {
        f"{src}/acc/mean@4", f"{src}/acc/best@4/mean", f"{src}/acc/best@4/std", f"{src}/acc/maj@4/mean",
        f"{src}/acc/maj@4/std"}
    for var in ("reward", "acc"):
        assert {k.split("/", 4)[-1] for k in got if f"/{var}/" in k} == {
            f"{m}@{n}{s}" for m, n, s in [("mean", 4, ""), ("std", 4, "")]} | {
            f"{m}@{n}/{s}" for m in ("best", "worst", "maj") for n in (2, 4) for s in ("mean", "std")}
    # every prompt's 4 samples, none merged with another chunk's prompt of the same index
    assert not any("@8" in k for k in got) and "val-aux/meshppo/demo_add/note/mean@4" not in got
    assert any(row["ones"] is None for row in rows) and any(row["ones"] is not None for row in rows)
    assert logged["val/meshppo/demo_add/score"] == sum(row["score"] for row in rows) / len(rows)
    assert got[f"{src}/acc/mean@4"] == sum(row["acc"] for row in rows) / len(rows)
