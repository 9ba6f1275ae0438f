"""An OLMo-2 and a Gemma 3 in the trainer (CPU, one process, fp32, the demo's model built as olmo2 / gemma3_text):
a LoRA actor (verl's default target_modules, all-linear) and a critic of the type (GAE) train two steps; the run's
peft adapter loads into Olmo2ForCausalLM (Gemma3ForCausalLM) with the trained model's logits, and its merged export
is that model; the critic's checkpoint is refused by the export tool (transformers has no
Olmo2ForTokenClassification, no Gemma3ForTokenClassification)."""

import json

import pytest

from tests.e2e.lora_family import check_lora_exports, family_assets, train_lora_actor


@pytest.fixture(scope="module", params=["olmo2", "gemma3_text"])
def olmo2_assets(tmp_path_factory, request):
    return family_assets(tmp_path_factory, request.param)


def test_lora_actor_and_critic_on_olmo2_train_and_export(olmo2_assets, tmp_path, capsys):
    from models.args import HF_FAMILY

    base = olmo2_assets / "sft_model"
    config = json.loads((base / "config.json").read_text())
    family = HF_FAMILY[config["model_type"]]
    architecture = f"{family}ForCausalLM"
    assert config["architectures"] == [architecture]
    run = train_lora_actor(olmo2_assets, tmp_path, "trainer.save_freq=2", gae_critic=True)
    check_lora_exports(base, run, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 1e-2,
                       architecture)
    # the critic's checkpoint has no Hugging Face export: no transformers class reads such a value model back
    from tools.export_hf import main as export_main

    capsys.readouterr()
    assert export_main([str(run / "checkpoints"), str(tmp_path / "critic_hf"), "--role", "critic"]) == 1
    assert f"transformers has no {family}ForTokenClassification" in capsys.readouterr().err
    assert not (tmp_path / "critic_hf").exists()
