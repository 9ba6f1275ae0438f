"""Phi-3 / Phi-4 checkpoints (`model_type: phi3`, `Phi3ForCausalLM`) against transformers' implementation on tiny
random weights, in float64 on CPU: meshppo's model, its engine, the trainer's loading path (the checkpoint's fused
qkv_proj / gate_up_proj split into meshppo's projections), the export (fused back), the refused RoPE variants and
the sliding window (Phi-3-mini-4k's 2047 of 4096) that every layer attends through."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (TOL, check_engine_greedy, check_export_round_trip, check_padded_and_packed_logits,
                                  check_peft_adapter_round_trip, hf_causal_lm, one_thread, trainer_loads_bit_for_bit)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# GQA (4 query heads on 2 KV heads) with an explicit head_dim (24 against hidden / heads 16); and plain multi-head
# attention with head_dim from hidden / heads (Phi-3-mini's 32 heads on 32).
SHAPES = [dict(num_key_value_heads=2, head_dim=24), dict(num_key_value_heads=4)]


def _phi3(dtype=torch.float64, **overrides):
    """transformers' Phi3ForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=128,
              sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return hf_causal_lm(transformers.Phi3Config, transformers.Phi3ForCausalLM, dtype, **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _phi3(**overrides)
    hf.save_pretrained(tmp_path / "phi3")
    return hf, tmp_path / "phi3"


def _split(hf_state: dict, cfg) -> dict:
    """transformers' Phi3 state dict by meshppo's names, split as Phi3Attention.forward slices qkv_proj's output
    ([q; k; v]) and Phi3MLP.forward chunks gate_up_proj's ([gate; up])."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for k, v in hf_state.items():
        k = k.removeprefix("model.")
        if k.endswith("qkv_proj.weight"):
            base = k.removesuffix("qkv_proj.weight")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = \
                v[:q], v[q:q + kv], v[q + kv:]
        elif k.endswith("gate_up_proj.weight"):
            base = k.removesuffix("gate_up_proj.weight")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = v.chunk(2, dim=0)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_phi3(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    Phi3ForCausalLM's; its parameter count (the FLOP formula's) is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.model_type == "phi3" and ours.args.head_dim == shape.get("head_dim", 16)
    assert ours.args.attention_window is None
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path):
    """The engine on a Phi3 checkpoint (its own loading path: `LLMEngine.from_pretrained`; GQA, explicit head_dim;
    chunked prefill and preemption forced): greedy tokens are those of a no-cache loop over the training model, its
    log-probs the training forward's (to float32, which the engine returns them in); transformers' logits pick the
    same tokens."""
    from rollout.engine import LLMEngine

    hf, path = _saved(tmp_path, **SHAPES[0])
    engine, prompts, params, outs = check_engine_greedy(hf, path, VOCAB)
    loaded = LLMEngine.from_pretrained(path, engine.config, device="cpu")
    assert [o.token_ids for o in loaded.generate(prompts, params)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_phi3_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32, fused qkv_proj and
    gate_up_proj), read by the trainer's actor builder (FSDP on one gloo rank, and sharded over two): each
    projection holds its rows of the fused tensor, bit for bit. verl's wrap policy may name Phi3DecoderLayer."""
    from sharding import FSDPConfig
    from tests.dist_utils import run_distributed

    assert FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["Phi3DecoderLayer"]})
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    assert json.loads((path / "config.json").read_text())["model_type"] == "phi3"
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "phi3", 24, _split)


def test_a_fused_tensor_of_other_rows_is_refused_naming_it(tmp_path):
    """A qkv_proj whose rows are not q + k + v of config.json (another model's weights) names the tensor."""
    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointFileError

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = tensors["model.layers.1.self_attn.qkv_proj.weight"][:-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointFileError, match=r"'layers.1.self_attn.qkv_proj.weight' .* has shape \(191, 64\), "
                                                  r"expected 192 rows \(self_attn.q_proj 96 \+ self_attn.k_proj 48 "
                                                  r"\+ self_attn.v_proj 48\)"):
        Transformer.from_pretrained(path)


def test_export_round_trips_through_transformers_phi3(tmp_path):
    """The trained-policy export (`trainer.checkpointing.export_hf`, which `tools.export_hf` runs) writes a
    directory transformers loads as Phi3ForCausalLM: qkv_proj and gate_up_proj fused back in transformers' row
    order (bit for bit the weights read), original_max_position_embeddings as read (Phi3Config's default is
    4096), with meshppo's logits; a Phi3 value model exports as Phi3ForTokenClassification."""
    hf, base = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    written, again = check_export_round_trip(tmp_path, base, "Phi3", VOCAB)
    assert written["model_type"] == "phi3"
    assert written["head_dim"] == 24 and written["original_max_position_embeddings"] == 128
    assert again.state_dict().keys() == hf.state_dict().keys()
    for k, v in hf.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _config(**kw):
    return dict(model_type="phi3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256) | kw


def test_partial_rotary_factor_is_refused_naming_the_key(tmp_path):
    """Phi-4-mini's partial_rotary_factor 0.75: transformers rotates 3/4 of each head, meshppo's RoPE the whole
    head (the logits differ), so a saved config.json naming it is refused; 1.0 loads."""
    hf = _phi3(partial_rotary_factor=0.75)
    hf.save_pretrained(tmp_path / "p")
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.75 is not supported: .* meshppo's rotates the "
                                         r"whole head"):
        Transformer.from_pretrained(tmp_path / "p")
    with pytest.raises(ValueError, match=r"config.json's partial_rotary_factor=0.5 is not supported"):
        ModelArgs.from_hf_config(_config(partial_rotary_factor=0.5))
    assert ModelArgs.from_hf_config(_config(partial_rotary_factor=1.0)).model_type == "phi3"


def test_longrope_and_rope_types_transformers_phi3_lacks_are_refused(tmp_path):
    """Phi-3-mini-128k's rope_scaling longrope is refused naming the key; an override_config.rope_scaling that
    meshppo implements but transformers' Phi3 does not read (linear, llama3, yarn) too: the exported model would
    not load."""
    from models.checkpoint import load_model_args

    cfg = transformers.Phi3Config(**{k: v for k, v in _config().items() if k != "model_type"},
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
                                  original_max_position_embeddings=128)
    cfg.save_pretrained(tmp_path / "long")
    with pytest.raises(ValueError) as e:
        load_model_args(tmp_path / "long")
    assert "config.json's rope_scaling type 'longrope' is not supported: " in str(e.value)
    # the replacement it suggests is one transformers' Phi3 reads: plain RoPE only
    assert ("override_config.rope_scaling), null for plain RoPE (a replacement is not the checkpoint's scaling: its "
            "log-probs differ from transformers' wherever the two rotate otherwise, for longrope at every length); "
            "elsewhere") in str(e.value), str(e.value)
    _, path = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"rope_scaling of type 'linear' is not supported for model_type phi3: "
                                         r"transformers' Phi3 reads only default and longrope"):
        load_model_args(path, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert load_model_args(path, {"rope_scaling": None}).rope_scaling is None


def test_biases_and_dropouts(tmp_path):
    """transformers' Phi3 has no biases (refused, as for Mistral); its dropouts (resid_pdrop, embd_pdrop,
    attention_dropout) are off in RL as every type's: config.json's are not read, an override_config sets them
    to 0 only."""
    from models.args import check_overrides

    with pytest.raises(ValueError, match="phi3 with attention_bias or mlp_bias is not supported"):
        ModelArgs(model_type="phi3", attention_bias=True)
    _, inert = check_overrides({"resid_pdrop": 0, "embd_pdrop": 0.0, "attention_dropout": 0})
    assert set(inert) == {"resid_pdrop", "embd_pdrop", "attention_dropout"}
    with pytest.raises(ValueError, match=r"override_config.resid_pdrop=0.1 is not supported by meshppo"):
        check_overrides({"resid_pdrop": 0.1})


def test_a_phi3_mini_4k_window_runs_past_it(tmp_path):
    """Phi-3-mini-4k-instruct's sliding_window 2047 of max_position_embeddings 4096, scaled down (63 of 256):
    every layer of transformers' Phi3 attends through it, and meshppo's logits are its within and past the window; the
    trainer's pre-flight accepts a run past it (16 + 48, refused while meshppo's attention read the whole context),
    and the export keeps it."""
    from tests.unit.test_attention_window import _cfg
    from trainer.setup import preflight

    hf, path = _saved(tmp_path, sliding_window=63)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.attention_window == 63 and ours.args.windowed_layers == [0, 1]
    with torch.no_grad():
        for n in (63, 80):  # within and past the window; attending to the whole context differs past it
            ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
            assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= TOL, n
        for layer in ours.layers:
            layer.self_attn.window = None
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() > 1e-3
    preflight(_cfg(path, 16, 48), devices=False)
    ours.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 63


def _peft_phi3(hf, target_modules="all-linear", r=4, alpha=8.0):
    """peft's LoRA on transformers' Phi3 (its fused qkv_proj / gate_up_proj adapted whole), every A and B random and
    decisive (peft's B starts at zero)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def _by_meshppo_name(tensors: dict, cfg) -> dict:
    """A peft model's adapter tensors (by its parameter names) as meshppo's parameters, written out by hand: a fused
    module's A on its first part (q_proj, gate_proj), its B cut by rows as Phi3Attention slices [q; k; v] and
    Phi3MLP chunks [gate; up]."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    cuts = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))}
    out = {}
    for name, p in tensors.items():
        mod, which = name.removeprefix("base_model.model.model.").removesuffix(".default.weight").rsplit(".", 1)
        head, leaf = mod.rsplit(".", 1)
        if leaf not in cuts:
            out[f"{mod}.{which}"] = p
        elif which == "lora_A":
            out[f"{head}.{cuts[leaf][0][0]}.lora_A"] = p
        else:
            for (part, _), piece in zip(cuts[leaf], p.split([n for _, n in cuts[leaf]])):
                out[f"{head}.{part}.lora_B"] = piece
    return out


def hf_base_logits(peft_model, ids):
    with peft_model.disable_adapter():
        return peft_model(input_ids=ids).logits


def test_lora_all_linear_is_peft_on_the_fused_projections(tmp_path):
    """peft's default all-linear on Phi3ForCausalLM puts one rank-r adapter on the fused qkv_proj and gate_up_proj:
    meshppo's q / k / v (gate / up) share that adapter's A and split its B by rows. With the same adapter weights
    (peft's saved adapter, loaded through lora_adapter_path's reader) the logits are peft's, and after one backward
    of the same loss every adapter gradient is peft's (the shared A's the sum over its parts, as the fused one's);
    the optimizer gets one A per fused module."""
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter, trainable_parameters

    hf, path = _saved(tmp_path, **SHAPES[0])
    ours = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64), LoRAConfig(4, 8.0))
    attn = ours.layers[1].self_attn
    assert attn.q_proj.lora_A is attn.k_proj.lora_A is attn.v_proj.lora_A
    assert ours.layers[0].mlp.gate_proj.lora_A is ours.layers[0].mlp.up_proj.lora_A
    # per layer: A and B of qkv_proj, o_proj, gate_up_proj, down_proj as peft has them (2 x 4), B split (+2 +1)
    assert len(trainable_parameters(ours)) == 2 * (8 + 3)
    assert sum(p.numel() for p in trainable_parameters(ours)) == \
        sum(p.numel() for n, p in _peft_phi3(_phi3(**SHAPES[0])).named_parameters() if "lora_" in n)
    theirs = _peft_phi3(hf)
    theirs.save_pretrained(tmp_path / "peft")
    load_peft_adapter(ours, tmp_path / "peft")
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(2, 30, VOCAB, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref = theirs(input_ids=ids).logits
    got = ours(ids)
    with torch.no_grad():
        assert (ref - hf_base_logits(theirs, ids)).abs().max() > 1e-1  # the adapters act
    assert (got - ref).abs().max().item() <= TOL
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    lora = {n: p for n, p in theirs.named_parameters() if "lora_" in n}
    assert all(p.grad is not None for p in lora.values())
    expected = _by_meshppo_name({n: p.grad for n, p in lora.items()}, ours.args)
    mine = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(mine) == set(expected) and len(mine) == 2 * (8 + 3)
    assert min(g.abs().max() for g in expected.values()) > 1e-3  # every gradient is decisive
    for name, grad in expected.items():
        assert (mine[name] - grad).abs().max().item() <= TOL, name


def test_lora_on_phi3_saves_as_peft_and_peft_loads_it_with_our_logits(tmp_path):
    """save_peft_adapter writes a Phi3's shared A and its parts' B stacked as peft's adapter on the fused qkv_proj /
    gate_up_proj (target_modules naming the fused modules): PeftModel.from_pretrained on Phi3ForCausalLM gives
    meshppo's logits, and the directory reads back (lora_adapter_path) into the same adapters."""
    hf, path = _saved(tmp_path, **SHAPES[0])
    again = check_peft_adapter_round_trip(tmp_path, hf, path, "phi3", VOCAB,
                                          ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"])
    assert again.layers[0].self_attn.k_proj.lora_A is again.layers[0].self_attn.q_proj.lora_A


def test_lora_on_phi3_merges_into_the_export_as_peft_merges(tmp_path):
    """The merged export (each part's weight plus scaling · B_part @ A, fused back on save) is the checkpoint peft's
    merge_and_unload gives: transformers loads it with the LoRA model's logits."""
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter, merged_state_dict

    hf, path = _saved(tmp_path, **SHAPES[0])
    theirs = _peft_phi3(hf)
    theirs.save_pretrained(tmp_path / "peft")
    cfg = LoRAConfig(4, 8.0)
    ours = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64), cfg)
    load_peft_adapter(ours, tmp_path / "peft")
    plain = Transformer.from_pretrained(path, dtype=torch.float64)
    plain.load_state_dict(merged_state_dict({k: v.detach() for k, v in ours.state_dict().items()}, cfg.scaling))
    plain.save_pretrained(tmp_path / "merged")
    merged = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64).eval()
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        # the merge's maths is float32 (merge_weight): ~1e-7 of the weights, ~1e-5 of the logits; an adapter
        # merged into the wrong rows, or without its share of A, moves them by > 1e-2
        assert (merged(input_ids=ids).logits - ref).abs().max().item() <= 1e-4
        assert (merged(input_ids=ids).logits - hf_base_logits(theirs, ids)).abs().max().item() > 1e-1
        unloaded = theirs.merge_and_unload().state_dict()
        for name, t in merged.state_dict().items():
            assert (t - unloaded[name]).abs().max().item() <= 1e-6, name


def test_lora_on_part_of_a_fused_projection_is_refused(tmp_path):
    """peft cannot adapt a part of a fused projection (Phi3ForCausalLM has no q_proj): target_modules naming one
    (q_proj alone, or up_proj beside o_proj, as a list or an expression) names no module of a phi3 model and is
    refused, at model build and at the trainer's pre-flight, which takes all-linear (the default) and the fused
    modules."""
    from models.lora import LoRAConfig, inject_lora
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _saved(tmp_path, **SHAPES[0])
    for targets in (["q_proj"], ["up_proj", "o_proj"], r".*\.q_proj"):
        ours = Transformer.from_pretrained(path, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"(names|matches) no module.*\(transformers' Phi3 fuses qkv_proj = "
                                             r"q_proj / k_proj / v_proj, gate_up_proj = gate_proj / up_proj: peft "
                                             r"adapts a fused module whole"):
            inject_lora(ours, LoRAConfig(4, 8.0, targets))
    lora = ("actor_rollout_ref.model.lora_rank=8",)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model: target_modules has \['q_proj'\], which names "
                                          r"no module .*\(its target_modules, the model in "):
        preflight(_cfg(path, 16, 32, *lora, "actor_rollout_ref.model.target_modules=[q_proj]"), devices=False)
    with pytest.raises(ConfigError, match=r"^critic\.model: target_modules has \['gate_proj'\]"):
        preflight(_cfg(path, 16, 32, "algorithm.adv_estimator=gae", f"critic.model.path={path}",
                       "critic.model.lora_rank=4", "critic.model.target_modules=[gate_proj,down_proj]"), devices=False)
    preflight(_cfg(path, 16, 32, *lora), devices=False)
    preflight(_cfg(path, 16, 32, *lora, r"actor_rollout_ref.model.target_modules='.*\.(qkv_proj|down_proj)'"),
              devices=False)
    model = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64),
                        LoRAConfig(4, 8.0, ["qkv_proj", "down_proj"]))
    assert {n.split(".", 3)[3] for n, p in model.named_parameters() if p.requires_grad} == {
        "q_proj.lora_A", "q_proj.lora_B", "k_proj.lora_B", "v_proj.lora_B", "down_proj.lora_A", "down_proj.lora_B"}


def test_a_list_naming_a_fused_module_on_another_model_says_whose_it_is():
    """qkv_proj / gate_up_proj are transformers' Phi3 modules: a list naming one with a module no model type has is
    refused saying so (a typo stays as it was)."""
    from models.lora import LoRAConfig

    assert LoRAConfig(4, 8.0, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]).targets == \
        ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    with pytest.raises(ValueError, match=r"target_modules has \['qkv_proj', 'qproj'\], which names no module .*"
                                         r"\(qkv_proj is transformers' Phi3 q_proj / k_proj / v_proj fused, a module "
                                         r"of phi3 models only\)$"):
        LoRAConfig(4, 8.0, ["qkv_proj", "qproj"])
    with pytest.raises(ValueError, match=r"names no module .*'up_proj', 'down_proj'\]$"):  # a typo: as it was
        LoRAConfig(4, 8.0, ["o_proj", "qkvproj"])


def test_lora_flops_count_one_adapter_per_fused_projection():
    """The MFU's LoRA FLOPs on a Phi3 count peft's adapters: one on qkv_proj (in -> q + 2 kv rows) and one on
    gate_up_proj, their A once. PyTorch's counter on meshppo's forward + backward sees that plus what meshppo's
    separate projections run again with the shared A (x·Aᵀ, A's gradient and the input's through A: 2·r·in each,
    a token and extra part; layer 0's q / k / v compute no input gradient)."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.lora import LoRAConfig, inject_lora

    args = ModelArgs(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, model_type="phi3",
                     tie_word_embeddings=False)
    model = Transformer.build(args, seed=0)
    r, h = 8, 256
    lora = LoRAConfig(rank=r)
    inject_lora(model, lora, generator=torch.Generator().manual_seed(0))
    batch, seq, response = 3, 40, 24
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    index = torch.cat([torch.arange(row * seq + seq - response, (row + 1) * seq) for row in range(batch)])
    with FlopCounterMode(display=False) as counter:
        logp, _ = model(ids, labels=ids.reshape(-1)[index], label_index=index)
        logp.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0) - 2 * h * 1000 * batch * response
    tokens = batch * seq
    # extra parts: k, v and up per layer; layer 0's k / v skip the input gradient
    again = tokens * (2 * (6 * r * h) + 6 * r * h + (2 * (4 * r * h) + 6 * r * h))
    predicted = args.flops(tokens, batch * response, 0, backward=True, lora=lora)
    assert abs(predicted + again - counted) / counted < 5e-3, (predicted, again, counted)
    # by hand, against the same shapes with an A on every projection (a llama): per layer and token, the A of k, v
    # and up (6·r·h each) less, but layer 0's q / k / v compute no input gradient (2·r·h each) there either
    import dataclasses

    separate = dataclasses.replace(args, model_type="llama")
    assert separate.flops(1, 0, 0, backward=True, lora=lora) - args.flops(1, 0, 0, backward=True, lora=lora) == \
        2 * 3 * 6 * r * h - 2 * 2 * r * h
