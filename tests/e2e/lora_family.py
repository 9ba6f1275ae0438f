"""A LoRA actor on a model family's demo model through the trainer (CPU, one process, fp32) and its exports: what
test_granite_trainer.py, test_olmo2_trainer.py and test_lora_phi3_trainer.py run with their families."""

import json

import pytest
import torch

from tests.e2e.conftest import build_demo_assets, demo_args
from tests.e2e.test_resume import LENGTH_REWARD


def family_assets(tmp_path_factory, model_type: str):
    """The demo's assets with an untrained (init std 0.02) 1-layer, hidden-32 model of `model_type`."""
    return build_demo_assets(tmp_path_factory.mktemp(f"{model_type}_assets"), "--sft-max-steps", "0", "--init-std",
                             "0.02", "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32",
                             "--model-type", model_type)


def train_lora_actor(assets, tmp_path, *overrides: str, gae_critic: bool = False):
    """Two steps of the demo recipe on `assets` (the length reward, batch 8, mini-batches and micro-batches of 4, no
    validation) with a LoRA actor (rank 8, alpha 16, verl's default target_modules all-linear, lr 1e-2), then
    `overrides`; `gae_critic`: one response a prompt, GAE, and a critic of the actor's model (mini-batches and
    micro-batches of 4) that logs two steps' vf_loss. Returns the run directory."""
    from trainer import cli

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    critic = ("actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae",
              f"critic.model.path={assets / 'sft_model'}", "critic.ppo_micro_batch_size_per_gpu=4",
              "critic.ppo_mini_batch_size=4") if gae_critic else ()
    code = cli.main(demo_args(assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", *critic,
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                              "actor_rollout_ref.actor.optim.lr=1e-2", *overrides))
    assert code == 0
    if gae_critic:
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        assert sum("critic/vf_loss" in row for row in rows) == 2
    return run


def check_lora_exports(base, run, target_modules: list[str], adapters_act: float, architecture: str | None = None,
                       hf_kwargs: dict | None = None):
    """The run's peft adapter names `target_modules`, loads (load_peft_adapter) into meshppo's model of `base` with
    trained adapters, and PeftModel.from_pretrained on transformers' model of `base` reads it with that model's logits
    (float64, within 1e-9; the adapters move them by > `adapters_act`); the merged export hf_actor (of class
    `architecture` where given) is that model within 1e-5 (its float32 merge). `hf_kwargs`: what transformers'
    from_pretrained takes beside the path (a soft-capped model's attention: `hf_family.EAGER_FLOAT64`)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from models import Transformer
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter

    written = json.loads((run / "lora_adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == sorted(target_modules)
    ours = inject_lora(Transformer.from_pretrained(base, dtype=torch.float64), LoRAConfig(8, 16.0))
    load_peft_adapter(ours, run / "lora_adapter")
    assert ours.layers[0].self_attn.q_proj.lora_B.abs().max() > 0  # trained
    hf_kwargs = hf_kwargs or {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **hf_kwargs).eval()
    theirs = peft.PeftModel.from_pretrained(hf, run / "lora_adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_actor", dtype=torch.float64,
                                                               **hf_kwargs).eval()
    if architecture is not None:
        assert type(merged).__name__ == architecture
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            assert (ref - theirs(input_ids=ids).logits).abs().max() > adapters_act  # the adapters act
        assert (ours(ids) - ref).abs().max().item() <= 1e-9
        assert (merged(input_ids=ids).logits - ref).abs().max().item() <= 1e-5  # the float32 merge
