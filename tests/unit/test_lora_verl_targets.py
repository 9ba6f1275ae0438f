"""target_modules and exclude_modules as verl passes them to peft: a regular-expression string selects
what peft's `re.fullmatch` against whole module names selects, a list entry the module of that name or
whose name ends with "." + the entry (self_attn.q_proj); what exclude_modules selects so gets no
adapter. On a tiny Qwen2 model, in float64."""

import dataclasses
import json

import pytest
import torch

from models import Transformer
from models.lora import LoRAConfig, adapter_state_dict, inject_lora, load_peft_adapter, save_peft_adapter
from tests.unit.test_lora import ARGS, _base, _hf_qwen2, _ids

# (target_modules, exclude_modules, the projections they select in every layer: hand-listed, peft's checked below)
SELECTIONS = [
    (r".*\.(q_proj|v_proj)", None, ("q_proj", "v_proj")),
    (r"model\.layers\.\d+\.mlp\..*_proj", None, ("gate_proj", "up_proj", "down_proj")),
    (r".*layers.*(o|down)_proj", None, ("o_proj", "down_proj")),
    (["self_attn.q_proj", "mlp.down_proj"], None, ("q_proj", "down_proj")),
    (["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj", "o_proj"], None, ("v_proj", "o_proj")),
    (["up_proj", "layers.1.mlp.up_proj", "self_attn.k_proj", "k_proj"], None, ("k_proj", "up_proj")),
    ("All-Linear", None, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),  # lower()
]
EXCLUSIONS = [
    ("all-linear", ["down_proj"], ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")),
    ("all-linear", r".*\.mlp\..*", ("q_proj", "k_proj", "v_proj", "o_proj")),
    (["q_proj", "k_proj", "v_proj", "o_proj"], ["self_attn.k_proj"], ("q_proj", "v_proj", "o_proj")),
    (r".*_proj", r"model\.layers\.\d+\.self_attn\.[qk]_proj", ("v_proj", "o_proj", "gate_proj", "up_proj",
                                                                "down_proj")),
    (["q_proj", "up_proj"], ["self_attn"], ("q_proj", "up_proj")),  # an attention block, not the projections in it
    (["lm_head", "q_proj", "v_proj"], ["lm_head"], ("q_proj", "v_proj")),  # the LM head selected, then taken out
    (["q_proj", "up_proj"], ["model.layers.0.mlp.up_proj", "layers.1.mlp.up_proj"], ("q_proj",)),
]


def _peft_model(peft, hf, target_modules, exclude_modules=None, r=2, lora_alpha=4):
    return peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=lora_alpha,
                                                   target_modules=target_modules, exclude_modules=exclude_modules,
                                                   bias="none"))


def _peft_targets(peft, hf, target_modules, exclude_modules=None):
    """{(layer, projection)} peft wraps under `target_modules` and `exclude_modules`."""
    pm = _peft_model(peft, hf, target_modules, exclude_modules)
    out = set()
    for n, _ in pm.named_modules():
        if n.endswith(".lora_A"):
            parts = n.split(".")  # base_model.model.model.layers.I.self_attn.q_proj.lora_A
            assert parts[3] == "layers", n  # never the LM head or the embedding
            out.add((int(parts[4]), parts[6]))
    return out


def _trained(model):
    """`model`'s adapters with a non-zero B (a trained adapter)."""
    with torch.no_grad():
        for n, p in adapter_state_dict(model).items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(sum(map(ord, n))))
    return model


@pytest.mark.parametrize("target_modules, exclude_modules, expected", SELECTIONS + EXCLUSIONS)
def test_target_modules_select_the_hand_listed_projections(target_modules, exclude_modules, expected):
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=target_modules, exclude_modules=exclude_modules)
    assert cfg.targets == expected
    with torch.device("meta"):
        model = inject_lora(Transformer(ARGS), cfg)
    adapted = {n for n, p in model.named_parameters() if n.endswith(".lora_A")}
    assert adapted == {f"layers.{i}.{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}."
                       f"{p}.lora_A" for i in range(ARGS.num_hidden_layers) for p in expected}


@pytest.mark.parametrize("target_modules, exclude_modules, expected", SELECTIONS + EXCLUSIONS)
def test_target_modules_select_what_peft_selects_and_give_peft_logits(tmp_path, target_modules, exclude_modules,
                                                                      expected):
    peft = pytest.importorskip("peft")
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=target_modules, exclude_modules=exclude_modules)
    base = _base()
    hf = _hf_qwen2(base, tmp_path).double()
    theirs = _peft_targets(peft, hf, target_modules, exclude_modules)
    assert theirs == {(i, p) for i in range(ARGS.num_hidden_layers) for p in expected}
    model = _trained(inject_lora(_base().double(), cfg, torch.Generator().manual_seed(1)))
    save_peft_adapter(tmp_path / "a", {k: v.detach() for k, v in adapter_state_dict(model).items()}, cfg,
                      model_type=model.args.model_type)
    hf2 = _hf_qwen2(base, tmp_path / "x").double()
    pm = peft.PeftModel.from_pretrained(hf2, str(tmp_path / "a")).eval()
    ids = _ids(3)
    with torch.no_grad():
        ours, ref = model(ids), pm(input_ids=ids).logits
        with pm.disable_adapter():
            off = pm(input_ids=ids).logits
    assert (ours - ref).abs().max() < 1e-5  # (transformers keeps its rotary tables in float32)
    assert (ours - off).abs().max() > 1e-3  # (a hundred times the tolerance above: the comparison sees the adapters)


def _train_and_save(pm, path):
    """peft's model `pm` as if trained (its B matrices drawn, non-zero), saved to `path` as peft saves it."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(sum(map(ord, n))))
    pm.save_pretrained(path)


def _assert_peft_logits(model, pm):
    """meshppo's `model` gives peft's logits, which the adapters change (so the comparison sees them)."""
    ids = _ids(3)
    with torch.no_grad():
        ours, ref = model(ids), pm.eval()(input_ids=ids).logits
        with pm.disable_adapter():
            off = pm(input_ids=ids).logits
    assert (ours - ref).abs().max() < 1e-5
    assert (ours - off).abs().max() > 1e-3  # (a hundred times the tolerance above: the comparison sees the adapters)


def test_an_adapter_peft_wrote_with_whole_module_names_loads(tmp_path):
    """peft resolves all-linear to the whole names of the linear modules and writes them as
    target_modules (model.layers.0.self_attn.q_proj: a model this small has too few to shorten; peft 0.14
    wrote the short names, so the test names the modules itself): such an adapter, verl's too, is read as
    peft reads it, and gives peft's logits."""
    peft = pytest.importorskip("peft")
    base = _base()
    hf = _hf_qwen2(base, tmp_path).double()
    whole = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=whole,
                                                 bias="none"))
    _train_and_save(pm, tmp_path / "a")
    written = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.1.mlp.down_proj" in written  # whole names
    model = inject_lora(_base().double(), LoRAConfig(rank=4, alpha=8, target_modules=written))
    load_peft_adapter(model, tmp_path / "a")
    _assert_peft_logits(model, pm)


def test_regex_targets_meshppo_cannot_adapt_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"target_modules='q_proj' matches no module"):
        LoRAConfig(rank=4, target_modules="q_proj")  # peft: re.fullmatch on whole names, no module either
    with pytest.raises(ValueError, match=r"target_modules='.\*' matches the module model"):
        LoRAConfig(rank=4, target_modules=".*")
    with pytest.raises(ValueError, match=r"matches the module lm_head"):
        LoRAConfig(rank=4, target_modules=r"lm_head|.*q_proj")
    with pytest.raises(ValueError, match=r"target_modules='\(' is not a regular expression"):
        LoRAConfig(rank=4, target_modules="(")
    with pytest.raises(ValueError, match=r"selects \['q_proj'\] in layer 0 but \[\] in layer 1"):
        LoRAConfig(rank=4, target_modules=r"model\.layers\.0\..*q_proj")
    cfg = LoRAConfig(rank=4, target_modules=r"model\.layers\.[01]\..*q_proj")  # two layers: seen on the model
    with pytest.raises(ValueError, match=r"selects \['q_proj'\] in layer 0 but \[\] in layer 2"):
        with torch.device("meta"):
            inject_lora(Transformer(dataclasses.replace(ARGS, num_hidden_layers=3)), cfg)


def test_list_targets_meshppo_cannot_adapt_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"target_modules=\['lm_head', 'q_proj'\] matches the module lm_head"):
        LoRAConfig(rank=4, target_modules=["lm_head", "q_proj"])
    with pytest.raises(ValueError, match=r"target_modules=\['embed_tokens'\] matches the module model.embed_tokens"):
        LoRAConfig(rank=4, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match=r"matches the module model.layers.0.input_layernorm"):
        LoRAConfig(rank=4, target_modules=["q_proj", "input_layernorm"])
    with pytest.raises(ValueError, match=r"matches the module model.layers.0.self_attn "):
        LoRAConfig(rank=4, target_modules=["self_attn"])  # peft too cannot wrap an attention block
    with pytest.raises(ValueError, match=r"target_modules has \['attn.q_proj'\], which names no module"):
        LoRAConfig(rank=4, target_modules=["attn.q_proj"])  # the end after a dot: self_attn.q_proj, not attn.q_proj
    with pytest.raises(ValueError, match=r"selects \['q_proj'\] in layer 0 but \[\] in layer 1"):
        LoRAConfig(rank=4, target_modules=["model.layers.0.self_attn.q_proj"])
    with pytest.raises(ValueError, match=r"selects \['o_proj', 'up_proj'\] in layer 0 but \['o_proj'\] in layer 1"):
        LoRAConfig(rank=4, target_modules=["o_proj", "layers.0.mlp.up_proj"])
    cfg = LoRAConfig(rank=4, target_modules=["layers.0.mlp.up_proj", "layers.1.mlp.up_proj"])
    with pytest.raises(ValueError, match=r"selects \['up_proj'\] in layer 0 but \[\] in layer 2"):
        with torch.device("meta"):
            inject_lora(Transformer(dataclasses.replace(ARGS, num_hidden_layers=3)), cfg)
    with pytest.raises(ValueError, match=r"a non-empty list of strings, got \[3\]"):
        LoRAConfig(rank=4, target_modules=[3])


@pytest.mark.parametrize("target_modules, exclude_modules, expected", EXCLUSIONS)
def test_an_adapter_peft_built_with_exclude_modules_loads_with_peft_logits(tmp_path, target_modules, exclude_modules,
                                                                           expected):
    """peft's model under the same LoraConfig, trained (B non-zero) and saved with its exclude_modules in
    adapter_config.json: meshppo's model with the same options takes its adapters and gives its logits."""
    peft = pytest.importorskip("peft")
    pm = _peft_model(peft, _hf_qwen2(_base(), tmp_path).double(), target_modules, exclude_modules, r=4, lora_alpha=8)
    _train_and_save(pm, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["exclude_modules"]
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=target_modules, exclude_modules=exclude_modules)
    model = inject_lora(_base().double(), cfg)
    load_peft_adapter(model, tmp_path / "a")  # its config read as peft's: the same targets
    _assert_peft_logits(model, pm)


def test_exclude_modules_meshppo_cannot_follow_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"exclude_modules has \['down'\], which names no module"):
        LoRAConfig(rank=4, exclude_modules=["down"])  # peft: no module excluded (a warning), all seven adapted
    with pytest.raises(ValueError, match=r"exclude_modules='down_proj' matches no module"):
        LoRAConfig(rank=4, exclude_modules="down_proj")  # a string is a regex on whole names
    with pytest.raises(ValueError, match=r"exclude_modules='\[' is not a regular expression"):
        LoRAConfig(rank=4, exclude_modules="[")
    with pytest.raises(ValueError, match=r"a list of strings, got \{'a': 1\}"):
        LoRAConfig(rank=4, exclude_modules={"a": 1})
    with pytest.raises(ValueError, match=r"target_modules=\['q_proj'\] with exclude_modules='.\*' leaves no module"):
        LoRAConfig(rank=4, target_modules=["q_proj"], exclude_modules=".*")  # peft: all were excluded
    with pytest.raises(ValueError, match=r"target_modules='all-linear' with exclude_modules=\['layers.1.mlp.up_proj'\] "
                                         r"selects \[.*'up_proj'.*\] in layer 0 but \['down_proj', 'gate_proj', "
                                         r"'k_proj', 'o_proj', 'q_proj', 'v_proj'\] in layer 1"):
        LoRAConfig(rank=4, exclude_modules=["layers.1.mlp.up_proj"])
    cfg = LoRAConfig(rank=4, exclude_modules=r"model\.layers\.[01]\.mlp\.up_proj")  # two layers: seen on the model
    with pytest.raises(ValueError, match=r"in layer 0 but \[.*'up_proj'.*\] in layer 2"):
        with torch.device("meta"):
            inject_lora(Transformer(dataclasses.replace(ARGS, num_hidden_layers=3)), cfg)
    # a module no adapter goes to (the LM head, a value head) may be excluded: nothing changes
    assert LoRAConfig(rank=4, exclude_modules=["lm_head", "score"]).targets == LoRAConfig(rank=4).targets
    assert LoRAConfig(rank=4, exclude_modules=[]).exclude_modules is None  # peft: empty excludes nothing


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_the_module_names_matched_are_every_one_peft_sees(model_type):
    """What target_modules and exclude_modules are matched against holds every module name of the Hugging
    Face model peft wraps: verl's actor (...ForCausalLM) and critic (...ForTokenClassification, whose value
    head has a dropout before it)."""
    import transformers

    from models.lora import LM_HEAD, VALUE_HEAD, _hf_module_names

    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=50, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=8)
    for cls, heads in ((transformers.AutoModelForCausalLM, LM_HEAD),
                       (transformers.AutoModelForTokenClassification, VALUE_HEAD)):
        with torch.device("meta"):
            hf = cls.from_config(cfg)
        assert {n for n, _ in hf.named_modules() if n} <= set(_hf_module_names(2, heads)), cls


def test_a_critic_target_on_its_dropout_is_refused():
    """peft cannot wrap the critic's dropout (a target that matches it fails there); meshppo passed it over."""
    with pytest.raises(ValueError, match=r"matches the module dropout"):
        LoRAConfig(rank=4, target_modules=r"dropout|.*\.q_proj")
    with pytest.raises(ValueError, match=r"matches the module dropout"):
        LoRAConfig(rank=4, target_modules=["q_proj", "dropout"])
    assert LoRAConfig(rank=4, exclude_modules=["dropout"]).targets == LoRAConfig(rank=4).targets
