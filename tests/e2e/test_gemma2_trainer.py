"""A Gemma 2 in the trainer (CPU, one process, fp32, the demo's model built as gemma2, with gemma-2's soft caps): a
LoRA actor (verl's default target_modules, all-linear) and a Gemma 2 critic (GAE) train two steps; the run's peft
adapter loads into Gemma2ForCausalLM with the trained model's logits, its merged export is that model, and the
critic's checkpoint exports as a Gemma2ForTokenClassification with the critic's values."""

import json

import pytest
import torch

from tests.e2e.lora_family import check_lora_exports, family_assets, train_lora_actor


@pytest.fixture(scope="module")
def gemma2_assets(tmp_path_factory):
    return family_assets(tmp_path_factory, "gemma2")


def test_lora_actor_and_critic_on_gemma2_train_and_export(gemma2_assets, tmp_path):
    transformers = pytest.importorskip("transformers")
    from models import Transformer
    from tests.unit.hf_family import EAGER_FLOAT64, _register_eager_float64
    from tools.export_hf import main as export_main

    base = gemma2_assets / "sft_model"
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    run = train_lora_actor(gemma2_assets, tmp_path, "trainer.save_freq=2", gae_critic=True)
    _register_eager_float64()
    check_lora_exports(base, run, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 1e-4,
                       "Gemma2ForCausalLM", {"attn_implementation": EAGER_FLOAT64})
    assert export_main([str(run / "checkpoints"), str(tmp_path / "critic_hf"), "--role", "critic"]) == 0
    scorer = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "critic_hf", dtype=torch.float64, attn_implementation=EAGER_FLOAT64).eval()
    assert type(scorer).__name__ == "Gemma2ForTokenClassification"
    critic = Transformer.from_pretrained(tmp_path / "critic_hf", dtype=torch.float64, head="value")
    ids = torch.randint(0, config["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (scorer(input_ids=ids).logits[..., 0] - critic(ids)).abs().max().item() <= 1e-9
