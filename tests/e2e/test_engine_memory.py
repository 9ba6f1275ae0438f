"""Engine memory between phases (2 CPU ranks, gloo, fp32): with `rollout.free_engine_weights`
(the default) the engine's weights are released after every generation and re-allocated by the
next reshard, which fills them again, with the KV cache released too (`free_cache_engine`) or
kept; training must not notice (bitwise the same metrics and weights as with the weights kept)."""

import os

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2


def _body(rank, world_size, assets, run_root):
    import torch

    from tests.e2e.conftest import without_machine_metrics
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    runs = {}
    for free_cache, free_weights in ((True, False), (True, True), (False, True)):
        cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
            f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]",
            f"actor_rollout_ref.model.path={assets}/sft_model",
            f"trainer.default_local_dir={run_root}/run_{free_cache}_{free_weights}",
            "trainer.resume_mode=disable", "trainer.logger=[]", "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            f"actor_rollout_ref.rollout.free_cache_engine={free_cache}",
            f"actor_rollout_ref.rollout.free_engine_weights={free_weights}"])
        trainer = PPOTrainer(cfg, ctx)
        rows = []
        for _ in range(STEPS):
            rows.append(trainer.step())
            # Each released or kept as configured, the other one's choice notwithstanding.
            assert trainer.engine.model.allocated is not free_weights
            assert (trainer.engine.runner.kv_cache is None) is free_cache
        rows.append(trainer.validate())  # a generation after a release too
        params = {k: v.to_local().detach().clone() for k, v in trainer.actor.model.state_dict().items()}
        runs[free_cache, free_weights] = [without_machine_metrics(r) for r in rows], params
    kept, kept_params = runs[True, False]
    assert kept[-1]["val/meshppo/demo_add/score"] is not None and "actor/pg_loss" in kept[0]
    for key in ((True, True), (False, True)):
        freed, freed_params = runs[key]
        assert kept == freed, (key, kept, freed)
        assert all(torch.equal(kept_params[k], freed_params[k]) for k in kept_params), key


def test_freeing_engine_weights_between_phases_changes_nothing(tiny_assets, tmp_path):
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def _pool_body(rank, world_size, assets, run_root):
    """`run` on 2 ranks at TP 1 (two engine replicas) where rank 0's KV pool cannot hold one sequence."""
    import contextlib
    import io

    import rollout.engine as engine_mod
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import run

    if rank == 0:
        engine_mod.CPU_KV_CACHE_BYTES = 0  # the pool a GPU without free memory would get
    cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.train_files=[{assets}/train.jsonl]", "data.val_files=[]", f"actor_rollout_ref.model.path={assets}/sft_model",
        f"trainer.default_local_dir={run_root}/run", "trainer.resume_mode=disable", "trainer.logger=[]",
        "trainer.total_training_steps=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(cfg)
    last = (err.getvalue().splitlines() or [""])[-1]
    where = "" if rank == 0 else "(on engine replica 0) "
    said = (f"meshppo: error (rank {rank}): {where}the KV pool would hold 0 blocks (0.00 GiB) but one sequence of "
            f"actor_rollout_ref.rollout.max_model_len=")
    assert code == 1 and last.startswith(said), err.getvalue()
    assert last.endswith("lower actor_rollout_ref.rollout.max_model_len") and "Traceback" not in err.getvalue(), last


def test_a_kv_pool_too_small_on_one_replica_stops_every_rank(tiny_assets, tmp_path):
    """At TP 1 each engine replica sizes its own pool (from its GPU's free memory): one too small for a sequence
    raised a traceback on its rank alone, while the other replica's ranks waited in the outputs' gather."""
    run_distributed(_pool_body, 2, str(tiny_assets), str(tmp_path), timeout=300)
