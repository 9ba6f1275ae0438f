"""LoRA adapters (models/lora.py) on a tiny Qwen2 model, against `peft` and `transformers` (float32)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from models import ModelArgs, Transformer
from models.lora import (
    LoRAConfig,
    adapter_state_dict,
    adapters_disabled,
    inject_lora,
    lora_init_tensors,
    load_peft_adapter,
    merged_state_dict,
    read_peft_adapter,
    save_peft_adapter,
    trainable_parameters,
)

transformers = pytest.importorskip("transformers")

ARGS = ModelArgs(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, model_type="qwen2", attention_bias=True,
                 tie_word_embeddings=True)
TOL = 1e-4  # float32 logits of two implementations (as tests/unit/test_model_parity.py)


def _ids(seed=0, shape=(3, 20)):
    return torch.randint(0, ARGS.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _base(seed=0, args=ARGS):
    model = Transformer.build(args, seed=seed)
    with torch.no_grad():  # biases start at zero, norms at one; give them values so that every path sees them
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
            elif n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(8))
    return model


def _adapted(cfg, seed=0, args=ARGS):
    """A base model and an adapted copy whose B is non-zero (a trained adapter)."""
    base = _base(seed, args)
    model = _base(seed, args)
    inject_lora(model, cfg, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in adapter_state_dict(model).items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=g)
    return base, model


def test_config_errors_name_the_bad_value():
    assert LoRAConfig(rank=8).targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoRAConfig(rank=8, target_modules=["v_proj", "q_proj"]).targets == ("q_proj", "v_proj")
    assert LoRAConfig(rank=64, alpha=16).scaling == 0.25
    with pytest.raises(ValueError, match="lora_rank must be a positive integer, got 0"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="lora_alpha"):
        LoRAConfig(rank=4, alpha=-1)
    with pytest.raises(ValueError, match=r"\['qkv_proj'\]"):
        LoRAConfig(rank=4, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="'all_linear'"):
        LoRAConfig(rank=4, target_modules="all_linear")
    # a projection named twice is selected once (peft's LoraConfig makes a set of the list)
    assert LoRAConfig(rank=4, target_modules=["q_proj", "q_proj", "self_attn.q_proj"]).targets == ("q_proj",)


def test_fresh_adapter_is_identity_and_base_is_frozen():
    base = _base()
    model = inject_lora(_base(), LoRAConfig(rank=4, alpha=8), torch.Generator().manual_seed(1))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(names) == 2 * 7 * ARGS.num_hidden_layers
    assert all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert {n for n, _ in base.named_parameters()} <= {n for n, _ in model.named_parameters()}  # base names kept
    a = model.layers[0].self_attn.q_proj.lora_A
    bound = 1 / ARGS.hidden_size ** 0.5  # peft: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound and a.std() > 0.5 * bound
    assert torch.equal(model.layers[0].mlp.down_proj.lora_B, torch.zeros(ARGS.hidden_size, 4))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    assert len(trainable_parameters(model)) == len(names)
    with pytest.raises(RuntimeError, match="already applied"):
        inject_lora(model, LoRAConfig(rank=4))


def test_adapters_off_is_the_base_model_bitwise():
    base, model = _adapted(LoRAConfig(rank=4, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    ids = _ids()
    with torch.no_grad():
        on = model(ids)
        with adapters_disabled(model):
            off = model(ids)
            lp_off, _ = model(ids[:, :-1], labels=ids[:, 1:])
        lp_base, _ = base(ids[:, :-1], labels=ids[:, 1:])
        assert torch.equal(off, base(ids))
        assert torch.equal(lp_off, lp_base)  # the reference log-probs of a LoRA actor
        assert (on - off).abs().max() > 0.05  # the adapters do change the policy
        assert torch.equal(model(ids), on)  # switched back on after the block


def test_gradients_reach_only_the_adapters():
    _, model = _adapted(LoRAConfig(rank=4, alpha=8))
    ids = _ids()
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, ARGS.vocab_size), ids[:, 1:].reshape(-1)).backward()
    for n, p in model.named_parameters():
        if n.endswith((".lora_A", ".lora_B")):
            assert p.grad is not None and p.grad.abs().max() > 0, n
        else:
            assert p.grad is None, n
    # The adapter gradient is that of the merged weight pushed through B·A: for B,
    # dL/dB = s · dL/dW · Aᵀ. Check it on one projection against a float64 merged model.
    m = model.layers[1].mlp.up_proj
    ref = Transformer(ARGS).double()
    sd = merged_state_dict({k: v.detach().double() for k, v in model.state_dict().items()}, m.scaling)
    ref.load_state_dict(sd)
    ref.requires_grad_(False)
    ref.layers[1].mlp.up_proj.weight.requires_grad_(True)
    F.cross_entropy(ref(ids[:, :-1]).reshape(-1, ARGS.vocab_size), ids[:, 1:].reshape(-1)).backward()
    want = m.scaling * ref.layers[1].mlp.up_proj.weight.grad @ m.lora_A.detach().double().T
    torch.testing.assert_close(m.lora_B.grad.double(), want, rtol=1e-4, atol=1e-7)


def test_injection_on_meta_then_materialised_equals_eager():
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["k_proj", "gate_proj"])
    eager = inject_lora(Transformer.build(ARGS, seed=3), cfg, torch.Generator().manual_seed(5))
    with torch.device("meta"):
        meta = Transformer(ARGS)
    inject_lora(meta, cfg)
    assert meta.layers[0].self_attn.k_proj.lora_A.is_meta
    meta.to_empty(device="cpu")
    params = dict(meta.named_parameters())
    with torch.no_grad():
        for name, t in list(Transformer(ARGS).init_tensors(torch.Generator().manual_seed(3))):
            params[name].copy_(t)
        for name, t in lora_init_tensors(meta, torch.Generator().manual_seed(5)):
            params[name].copy_(t)
    meta.reset_buffers()
    for (n, a), (n2, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert n == n2 and torch.equal(a, b), n


def _hf_qwen2(model, tmp_path):
    model.save_pretrained(tmp_path / "base", state_dict={k: v for k, v in model.state_dict().items()
                                                          if not k.endswith((".lora_A", ".lora_B"))})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    return hf


def test_peft_loads_the_export_and_gives_our_logits(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    base, model = _adapted(cfg)
    save_peft_adapter(tmp_path / "adapter", {k: v.detach() for k, v in adapter_state_dict(model).items()}, cfg,
                      base_model_name_or_path="tiny-qwen2", model_type=model.args.model_type)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["peft_type"] == "LORA" and written["task_type"] == "CAUSAL_LM" and written["r"] == 8
    assert written["base_model_name_or_path"] == "tiny-qwen2" and written["bias"] == "none"
    hf = _hf_qwen2(base, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    # every adapter was loaded, under peft's own names
    loaded = {n for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 5 * ARGS.num_hidden_layers
    ids = _ids(4)
    with torch.no_grad():
        ours, theirs = model(ids), peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            theirs_off = peft_model(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= TOL
    assert (ours - theirs_off).abs().max() > 100 * TOL  # the comparison sees the adapters


def test_export_round_trips_and_bad_adapters_are_refused(tmp_path):
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "gate_proj"])
    _, model = _adapted(cfg)
    sd = {k: v.detach().clone() for k, v in adapter_state_dict(model).items()}
    save_peft_adapter(tmp_path / "a", sd, cfg, model_type=ARGS.model_type)
    other = inject_lora(_base(), cfg, torch.Generator().manual_seed(9))
    load_peft_adapter(other, tmp_path / "a")
    for k, v in adapter_state_dict(other).items():
        assert torch.equal(v, sd[k]), k
    ids = _ids(5)
    with torch.no_grad():
        assert torch.equal(other(ids), model(ids))
    read_cfg, _ = read_peft_adapter(tmp_path / "a")
    assert read_cfg == cfg

    with pytest.raises(ValueError, match=r"r \(lora_rank\)=4, the configuration says 8"):
        load_peft_adapter(inject_lora(_base(), LoRAConfig(rank=8, alpha=8, target_modules=["q_proj", "gate_proj"])),
                          tmp_path / "a")
    with pytest.raises(ValueError, match="target_modules"):
        load_peft_adapter(inject_lora(_base(), LoRAConfig(rank=4, alpha=8, target_modules=["q_proj"])), tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        read_peft_adapter(tmp_path)
    bad = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    bad["use_dora"] = True
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        read_peft_adapter(tmp_path / "a")
    # a shape that does not fit the model (an adapter for a wider model)
    sd2 = dict(sd)
    sd2["layers.0.self_attn.q_proj.lora_A"] = torch.zeros(4, ARGS.hidden_size + 1)
    save_peft_adapter(tmp_path / "b", sd2, cfg, model_type=ARGS.model_type)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.lora_A has shape \(4, 65\)"):
        load_peft_adapter(other, tmp_path / "b")


@pytest.mark.parametrize("args", [ARGS, dataclasses.replace(ARGS, model_type="qwen3", attention_bias=False,
                                                             head_dim=24)], ids=["qwen2", "qwen3"])
def test_merged_export_loads_in_transformers_with_our_logits(tmp_path, args):
    cfg = LoRAConfig(rank=8, alpha=32)
    _, model = _adapted(cfg, args=args)
    merged = merged_state_dict({k: v.detach() for k, v in model.state_dict().items()}, cfg.scaling)
    assert not any("lora" in k for k in merged)
    model.save_pretrained(tmp_path / "merged", state_dict=merged)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ids = _ids(6)
    with torch.no_grad():
        ours = model(ids)
        with adapters_disabled(model):
            off = model(ids)
        assert (hf(input_ids=ids).logits - ours).abs().max() <= TOL
    assert (ours - off).abs().max() > 100 * TOL
