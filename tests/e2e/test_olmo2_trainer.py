"""An OLMo-2 and a Gemma 3 in the trainer (CPU, one process, fp32, the demo's model built as olmo2 / gemma3_text):
a LoRA actor (verl's default target_modules, all-linear) and a critic of the type (GAE) train two steps; the run's
peft adapter loads into Olmo2ForCausalLM (Gemma3ForCausalLM) with the trained model's logits, and its merged export
is that model; the critic's checkpoint is refused by the export tool (transformers has no
Olmo2ForTokenClassification, no Gemma3ForTokenClassification)."""

import json

import pytest
import torch

from tests.e2e.conftest import build_demo_assets, demo_args
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.fixture(scope="module", params=["olmo2", "gemma3_text"])
def olmo2_assets(tmp_path_factory, request):
    return build_demo_assets(tmp_path_factory.mktemp(f"{request.param}_assets"), "--sft-max-steps", "0",
                             "--init-std", "0.02", "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden",
                             "32", "--model-type", request.param)


def test_lora_actor_and_critic_on_olmo2_train_and_export(olmo2_assets, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from models import Transformer
    from models.args import HF_FAMILY
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter

    base = olmo2_assets / "sft_model"
    config = json.loads((base / "config.json").read_text())
    family = HF_FAMILY[config["model_type"]]
    assert config["architectures"] == [f"{family}ForCausalLM"]
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    code = cli.main(demo_args(olmo2_assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
                              "algorithm.adv_estimator=gae", f"critic.model.path={base}",
                              "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                              "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.save_freq=2"))
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
    assert type(merged).__name__ == f"{family}ForCausalLM"
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            assert (ref - theirs(input_ids=ids).logits).abs().max() > 1e-2  # the adapters act
        assert (ours(ids) - ref).abs().max().item() <= 1e-9
        assert (merged(input_ids=ids).logits - ref).abs().max().item() <= 1e-5  # the float32 merge
    # the critic's checkpoint has no Hugging Face export: no transformers class reads such a value model back
    from tools.export_hf import main as export_main

    capsys.readouterr()
    assert export_main([str(run / "checkpoints"), str(tmp_path / "critic_hf"), "--role", "critic"]) == 1
    assert f"transformers has no {family}ForTokenClassification" in capsys.readouterr().err
    assert not (tmp_path / "critic_hf").exists()
