"""A LoRA actor on a Phi-3 in the trainer (CPU, one process, fp32, the demo's Phi3 model): verl's default
target_modules, all-linear, trains peft's adapters on the fused qkv_proj / gate_up_proj; the run's peft adapter
loads into Phi3ForCausalLM with the trained model's logits, and its merged export is that model."""

import json

import pytest
import torch

from tests.e2e.conftest import build_demo_assets, demo_args
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli


@pytest.fixture(scope="module")
def phi3_assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("phi3_assets"), "--sft-max-steps", "0", "--init-std", "0.02",
                             "--n-train", "64", "--n-val", "16", "--layers", "1", "--hidden", "32",
                             "--model-type", "phi3")


def test_lora_all_linear_on_phi3_trains_and_exports_peft(phi3_assets, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from models import Transformer
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    code = cli.main(demo_args(phi3_assets, run, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                              f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                              "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                              "actor_rollout_ref.actor.optim.lr=1e-2"))
    assert code == 0
    written = json.loads((run / "lora_adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    base = phi3_assets / "sft_model"
    ours = inject_lora(Transformer.from_pretrained(base, dtype=torch.float64), LoRAConfig(8, 16.0))
    load_peft_adapter(ours, run / "lora_adapter")
    assert ours.layers[0].self_attn.q_proj.lora_B.abs().max() > 0  # trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).eval()
    theirs = peft.PeftModel.from_pretrained(hf, run / "lora_adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_actor", dtype=torch.float64).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            assert (ref - theirs(input_ids=ids).logits).abs().max() > 1e-1  # the adapters act (0.37 measured)
        assert (ours(ids) - ref).abs().max().item() <= 1e-9
        assert (merged(input_ids=ids).logits - ref).abs().max().item() <= 1e-5  # float32 merge: 5e-8 measured
