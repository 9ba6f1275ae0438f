"""target_modules as verl passes it to peft: a regular-expression string selects what peft's
`re.fullmatch` against whole module names selects, on a tiny Qwen2 model, in float64."""

import pytest
import torch

from models import Transformer
from models.lora import LoRAConfig, adapter_state_dict, inject_lora, save_peft_adapter
from tests.unit.test_lora import ARGS, _base, _hf_qwen2, _ids

peft = pytest.importorskip("peft")


def _peft_targets(hf, target_modules):
    """{(layer, projection)} peft wraps under `target_modules`."""
    pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4,
                                                 target_modules=target_modules, bias="none"))
    out = set()
    for n, _ in pm.named_modules():
        if n.endswith(".lora_A"):
            parts = n.split(".")  # base_model.model.model.layers.I.self_attn.q_proj.lora_A
            assert parts[3] == "layers", n  # never the LM head or the embedding
            out.add((int(parts[4]), parts[6]))
    return out


@pytest.mark.parametrize("regex", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.mlp\..*_proj",
                                   r".*layers.*(o|down)_proj"])
def test_regex_target_selects_what_peft_selects_and_gives_peft_logits(tmp_path, regex):
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=regex)
    base = _base()
    hf = _hf_qwen2(base, tmp_path).double()
    theirs = _peft_targets(hf, regex)
    assert {p for _, p in theirs} == set(cfg.targets) and {i for i, _ in theirs} == set(range(ARGS.num_hidden_layers))
    model = inject_lora(_base().double(), cfg, torch.Generator().manual_seed(1))
    with torch.no_grad():
        for n, p in adapter_state_dict(model).items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(n) % 1000))
    save_peft_adapter(tmp_path / "a", {k: v.detach() for k, v in adapter_state_dict(model).items()}, cfg)
    hf2 = _hf_qwen2(base, tmp_path / "x").double()
    pm = peft.PeftModel.from_pretrained(hf2, str(tmp_path / "a")).eval()
    ids = _ids(3)
    with torch.no_grad():
        ours, ref = model(ids), pm(input_ids=ids).logits
        with pm.disable_adapter():
            off = pm(input_ids=ids).logits
    assert (ours - ref).abs().max() < 1e-5  # (transformers keeps its rotary tables in float32)
    assert (ours - off).abs().max() > 1e-2


def test_regex_targets_meshppo_cannot_adapt_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"target_modules='q_proj' matches no module"):
        LoRAConfig(rank=4, target_modules="q_proj")  # peft: re.fullmatch on whole names, no module either
    with pytest.raises(ValueError, match=r"target_modules='.\*' matches the module model"):
        LoRAConfig(rank=4, target_modules=".*")
    with pytest.raises(ValueError, match=r"matches the module lm_head"):
        LoRAConfig(rank=4, target_modules=r"lm_head|.*q_proj")
    with pytest.raises(ValueError, match=r"target_modules='\(' is not a regular expression"):
        LoRAConfig(rank=4, target_modules="(")
    cfg = LoRAConfig(rank=4, target_modules=r"model\.layers\.0\..*q_proj")  # one layer only: seen on the model
    with pytest.raises(ValueError, match=r"selects \['q_proj'\] in layer 0 but \[\] in layer 1"):
        with torch.device("meta"):
            inject_lora(Transformer(ARGS), cfg)
