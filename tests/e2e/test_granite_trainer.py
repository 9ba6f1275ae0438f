"""A Granite in the trainer (CPU, one process, fp32, the demo's model built as granite, with granite-3.x's scalars):
a LoRA actor (verl's default target_modules, all-linear) and a Granite critic (GAE) train two steps; the run's peft
adapter loads into GraniteForCausalLM with the trained model's logits, and its merged export is that model."""

import json

import pytest

from tests.e2e.lora_family import check_lora_exports, family_assets, train_lora_actor


@pytest.fixture(scope="module")
def granite_assets(tmp_path_factory):
    return family_assets(tmp_path_factory, "granite")


def test_lora_actor_and_critic_on_granite_train_and_export(granite_assets, tmp_path):
    base = granite_assets / "sft_model"
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    assert (config["embedding_multiplier"], config["residual_multiplier"], config["attention_multiplier"],
            config["logits_scaling"]) == (12.0, 0.22, 0.125, 8.0)
    run = train_lora_actor(granite_assets, tmp_path, gae_critic=True)
    # the adapters act: logits / 8, a 0.02 init
    check_lora_exports(base, run, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 1e-4,
                       "GraniteForCausalLM")
