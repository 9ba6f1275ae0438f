"""A Granite in the trainer (CPU, one process, fp32, the demo's model built as granite, with granite-3.x's scalars):
a LoRA actor (verl's default target_modules, all-linear) and a Granite critic (GAE) train two steps; the run's peft
adapter loads into GraniteForCausalLM with the trained model's logits, and its merged export is that model."""

import json

import pytest
import torch

from tests.e2e.conftest import build_demo_assets, demo_args
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.fixture(scope="module")
def granite_assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("granite_assets"), "--sft-max-steps", "0", "--init-std", "0.02",
                             "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32",
                             "--model-type", "granite")


def test_lora_actor_and_critic_on_granite_train_and_export(granite_assets, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from models import Transformer
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter

    base = granite_assets / "sft_model"
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    assert (config["embedding_multiplier"], config["residual_multiplier"], config["attention_multiplier"],
            config["logits_scaling"]) == (12.0, 0.22, 0.125, 8.0)
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    code = cli.main(demo_args(granite_assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
                              "algorithm.adv_estimator=gae", f"critic.model.path={base}",
                              "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                              "actor_rollout_ref.actor.optim.lr=1e-2"))
    assert code == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert sum("critic/vf_loss" in row for row in rows) == 2
    written = json.loads((run / "lora_adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ours = inject_lora(Transformer.from_pretrained(base, dtype=torch.float64), LoRAConfig(8, 16.0))
    load_peft_adapter(ours, run / "lora_adapter")
    assert ours.layers[0].self_attn.q_proj.lora_B.abs().max() > 0  # trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).eval()
    theirs = peft.PeftModel.from_pretrained(hf, run / "lora_adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_actor", dtype=torch.float64).eval()
    assert type(merged).__name__ == "GraniteForCausalLM"
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            assert (ref - theirs(input_ids=ids).logits).abs().max() > 1e-4  # the adapters act (logits / 8, a 0.02 init)
        assert (ours(ids) - ref).abs().max().item() <= 1e-9
        assert (merged(input_ids=ids).logits - ref).abs().max().item() <= 1e-5  # the float32 merge
