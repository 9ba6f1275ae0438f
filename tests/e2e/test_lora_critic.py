"""A LoRA critic (`critic.model.lora_rank`, CPU, gloo, fp32, the tiny model): only its adapters
and its value head train and have optimizer state, its base stays frozen bit for bit, its
checkpoint holds no base weight, and a run resumed from that checkpoint (the base re-read from
the model path) reproduces the uninterrupted one."""

import torch

from tests.dist_utils import run_distributed
from tests.e2e.conftest import assert_resumed_run_matches, assert_trains_only, checkpoint_keys, demo_args, demo_trainer
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli

CRITIC_LORA = ["critic.model.lora_rank=4", "critic.model.lora_alpha=8",
               "critic.model.target_modules=[q_proj, v_proj, down_proj]", "critic.optim.lr=1e-2"]
COMMON = ["trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
          "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
          "critic.ppo_micro_batch_size_per_gpu=2", "trainer.logger=[jsonl]"]


def _critic_body(rank, world_size, assets, run_root):
    from models.lora import is_lora_name, lora_modules

    trainer = demo_trainer(assets, f"{run_root}/run", f"{run_root}/reward.py", "trainer.total_training_steps=2",
                           *COMMON, *CRITIC_LORA)
    m = trainer.models
    critic = m.critic
    trained = {n for n, _ in critic.named_parameters() if is_lora_name(n) or n.startswith("score.")}
    assert any(n.startswith("score.") for n in trained) and len(trained) > 2
    assert_trains_only(critic, m.critic_optim, trained)
    assert len(lora_modules(critic)) == 3 * m.actor_args.num_hidden_layers
    # the actor is untouched by the critic's options: fully trained, no adapters
    assert not lora_modules(m.actor) and all(p.requires_grad for p in m.actor.parameters())
    start = {n: p.to_local().detach().clone() for n, p in critic.named_parameters()}
    for _ in range(2):
        trainer.step()
    now = {n: p.to_local().detach() for n, p in critic.named_parameters()}
    for n in start:  # the base is frozen bit for bit; the adapters and the value head moved
        if start[n].numel():  # (a rank's shard of the [1, hidden] value head may be empty)
            assert torch.equal(start[n], now[n]) != (n in trained), n


def test_lora_critic_trains_only_adapters_and_value_head(tiny_assets, tmp_path):
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run_distributed(_critic_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def _run(assets, run, reward, *extra):
    code = cli.main(demo_args(assets, run, "trainer.n_gpus_per_node=1", f"custom_reward_function.path={reward}",
                              "trainer.export_hf_at_end=false", *COMMON, *CRITIC_LORA, *extra))
    assert code == 0


def test_lora_critic_resume_reproduces_the_uninterrupted_run(tiny_assets, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(tiny_assets, straight, reward, "trainer.total_training_steps=3")
    _run(tiny_assets, split, reward, "trainer.total_training_steps=2")
    saved = checkpoint_keys(split / "checkpoints" / "global_step_2" / "critic")
    assert any(k.startswith("optim.state.") for k in saved), saved[:8]
    held = [k for k in saved if k.startswith(("model.", "optim.state.")) and "lora_" not in k and ".score." not in k]
    assert not held, f"the critic's checkpoint holds base weights or their optimizer state: {held[:4]}"
    _run(tiny_assets, split, reward, "trainer.total_training_steps=3")  # resume_mode=auto: from global_step_2
    assert_resumed_run_matches(straight, split, 3)
