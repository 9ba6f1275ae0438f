"""global_profiler in the trainer (2 CPU ranks, gloo): tool=torch, steps=[2], the actor's profiler
on rank 1 only. A 3-step run writes exactly one gzipped chrome trace, rank 1's, for step 2, holding
the step's phase ranges; nothing for steps 1 and 3 or for rank 0."""

import gzip
import json
import os

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count("1") / max(len(solution_str), 1)
'''


def _body(rank, world_size, assets, root):
    from tests.e2e.conftest import demo_trainer

    save = os.path.join(root, "profile")
    trainer = demo_trainer(assets, os.path.join(root, "run"), os.path.join(root, "reward.py"),
                           "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1",
                           "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.export_hf_at_end=false",
                           "trainer.logger=[jsonl]", "global_profiler.tool=torch", "global_profiler.steps=[2]",
                           f"global_profiler.save_path={save}", "actor_rollout_ref.actor.profiler.enable=true",
                           "actor_rollout_ref.actor.profiler.ranks=[1]",
                           "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu]")
    assert trainer.train() == 0


def test_torch_profiler_traces_step_2_on_rank_1(tiny_assets, tmp_path):
    (tmp_path / "reward.py").write_text(DENSE_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path))
    save = tmp_path / "profile"
    files = sorted(str(p.relative_to(save)) for p in save.rglob("*") if p.is_file())
    assert files == ["step2/prof_rank-1.json.gz"], files
    with gzip.open(save / "step2" / "prof_rank-1.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    # one step: its range once (the trace starts and ends with the step)
    assert sum(e.get("name") == "phase:step" for e in trace["traceEvents"]) == 1
    for phase in ("phase:step", "phase:gen", "phase:reward", "phase:ref", "phase:adv", "phase:update_actor"):
        assert phase in names, (phase, sorted(n for n in names if n and n.startswith("phase:")))
