"""The step's whole batch (`full`, on every rank) keeps no `[N_total, R]` tensor through the updates: once
each rank has taken its rows, the whole batch's per-token tensors and cached response mask are freed
(2 CPU ranks, gloo). Before, the cached mask (and under PF-PPO every gathered per-token field of the
redrawn batch) sat on every device until the step ended."""

import gc

import torch

from tests.dist_utils import run_distributed
from tests.e2e.test_rollout_correction_trainer import DENSE_REWARD, _config

PROMPTS, N = 8, 8  # COMMON's data.train_batch_size, demo.yaml's rollout.n


def _body(rank, world_size, assets, run_root):
    from trainer import roles
    from trainer.launch import init_distributed
    from trainer.ppo_trainer import PPOTrainer

    ctx = init_distributed("cpu")
    seen = []
    update = roles.Actor.update

    def counting_update(self, ro, *args, **kwargs):
        gc.collect()
        whole = [tuple(t.shape) for t in gc.get_objects()
                 if type(t) is torch.Tensor and t.dim() == 2 and tuple(t.shape) == (PROMPTS * N, ro.width)]
        seen.append((len(ro), whole))
        return update(self, ro, *args, **kwargs)

    roles.Actor.update = counting_update
    try:
        for name, overrides in (("plain", []), ("pf_ppo", ["algorithm.use_pf_ppo=true", "algorithm.adv_estimator=gae",
                                                            "critic.ppo_micro_batch_size_per_gpu=8"])):
            seen.clear()
            trainer = PPOTrainer(_config(assets, run_root, name, *overrides), ctx)
            trainer.step()
            assert seen == [(PROMPTS * N // world_size, [])], (name, seen)
    finally:
        roles.Actor.update = update


def test_no_whole_batch_tensor_lives_through_the_update(tiny_assets, tmp_path):
    (tmp_path / "dense_reward.py").write_text(DENSE_REWARD)
    run_distributed(_body, 2, str(tiny_assets), str(tmp_path), timeout=600)
