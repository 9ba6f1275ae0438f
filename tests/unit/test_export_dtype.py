"""Hugging Face exports keep the base checkpoint's dtype.

They were written in float32 (the trained master weights as they are) with a config.json
naming no dtype, so a bf16 base's export took twice the disk and loaded in float32 in
transformers; verl's model_merger writes it bf16 with its dtype in config.json."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from models import Transformer, load_model_args
from models.checkpoint import hf_key_to_meshppo
from models.lora import LoRAConfig, inject_lora, merged_state_dict
from tests.byte_chat import VOCAB_SIZE, build_byte_tokenizer
from trainer.checkpointing import export_hf


def _base(tmp_path, dtype=torch.bfloat16, name="base"):
    """A small Qwen2 checkpoint saved by transformers in `dtype` (config.json: `"dtype": ...`)."""
    cfg = transformers.Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to(dtype)
    path = tmp_path / name
    hf.save_pretrained(path)
    return path


def _trained(path, head="lm"):
    """The base read by meshppo (float32 master weights), then moved off bf16's grid as training moves it."""
    model = Transformer.from_pretrained(path, head=head)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    return model


def _written(out):
    """`{meshppo name: tensor}` of the export's safetensors, and its config.json."""
    tensors = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            tensors[hf_key_to_meshppo(key)] = f.get_tensor(key)
    return tensors, json.loads((out / "config.json").read_text())


def _ids():
    return torch.randint(0, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(2))


def test_a_bf16_base_exports_bf16_and_transformers_loads_it_so(tmp_path):
    base = _base(tmp_path)
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    model = _trained(base)
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in master.values())
    out = tmp_path / "export"
    export_hf(model, model.args, build_byte_tokenizer(), str(out), True)
    tensors, config = _written(out)
    assert config["dtype"] == "bfloat16"
    assert tensors.keys() == master.keys()
    for name, t in tensors.items():  # the master weights rounded to bf16 once, exactly
        assert t.dtype == torch.bfloat16 and torch.equal(t, master[name].to(torch.bfloat16)), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.dtype == torch.bfloat16 and hf.config.dtype == torch.bfloat16
    ids = _ids()
    with torch.no_grad():
        theirs = hf.float()(input_ids=ids).logits
        rounded = Transformer(model.args)
        rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in master.items()}, strict=False)
        rounded.reset_buffers()
        ours_rounded, ours = rounded(ids), model(ids)
    # transformers' model is meshppo's with its weights rounded to bf16 ...
    assert (theirs - ours_rounded).abs().max() < 1e-4
    # ... which is the trained model's up to bf16 rounding
    assert (theirs - ours).abs().max() < 2e-2 * ours.abs().max()


def test_a_lora_actor_exports_its_merged_weights_in_the_bases_dtype(tmp_path):
    base = _base(tmp_path)
    model = inject_lora(Transformer.from_pretrained(base), LoRAConfig(rank=4, alpha=8),
                        torch.Generator().manual_seed(3))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    merged = merged_state_dict({k: v.detach() for k, v in model.state_dict().items()}, model.lora_config.scaling)
    out = tmp_path / "export"
    export_hf(model, model.args, build_byte_tokenizer(), str(out), True, adapter_dir=str(out / "lora_adapter"),
              base_model=str(base))
    tensors, config = _written(out)
    assert config["dtype"] == "bfloat16" and tensors.keys() == merged.keys()
    assert all(torch.equal(t, merged[k].to(torch.bfloat16)) for k, t in tensors.items())
    assert (out / "lora_adapter" / "adapter_config.json").is_file()


def test_a_value_model_exports_in_its_bases_dtype(tmp_path):
    """The critic (a value head on a causal-LM base): its token classifier in the base's dtype."""
    base = _base(tmp_path)
    model = _trained(base, head="value")
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = tmp_path / "export"
    export_hf(model, model.args, build_byte_tokenizer(), str(out), True)
    tensors, config = _written(out)
    assert config["dtype"] == "bfloat16" and "score.weight" in tensors
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, master[k].to(torch.bfloat16)) for k, t in tensors.items())
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out)
    assert hf.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, None])
def test_a_float32_base_or_one_naming_no_dtype_exports_float32_and_says_so(tmp_path, dtype):
    base = _base(tmp_path, torch.float32)
    if dtype is None:  # a config.json that names no dtype (an older writer)
        config = json.loads((base / "config.json").read_text())
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (base / "config.json").write_text(json.dumps(config))
    assert load_model_args(base).hf_dtype == ("float32" if dtype else None)
    model = _trained(base)
    out = tmp_path / "export"
    export_hf(model, model.args, build_byte_tokenizer(), str(out), True)
    tensors, config = _written(out)
    assert config["dtype"] == "float32"
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32
