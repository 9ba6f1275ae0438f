"""Phi-3 / Phi-4 checkpoints (`model_type: phi3`, `Phi3ForCausalLM`) against transformers' implementation on tiny
random weights, in float64 on CPU: meshppo's model, its engine, the trainer's loading path (the checkpoint's fused
qkv_proj / gate_up_proj split into meshppo's projections), the export (fused back), the refused RoPE variants and
the sliding window (Phi-3-mini-4k's 2047 of 4096) bounding the run's lengths."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (TOL, check_engine_greedy, check_export_round_trip, check_padded_and_packed_logits,
                                  hf_causal_lm, one_thread, trainer_loads_bit_for_bit)

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


def test_a_phi3_mini_4k_window_bounds_the_run(tmp_path):
    """Phi-3-mini-4k-instruct's sliding_window 2047 of max_position_embeddings 4096, scaled down (63 of 256):
    every layer of transformers' Phi3 attends through it, so meshppo's logits are its within the window and the
    trainer's pre-flight accepts a run whose prompt + response fit (16 + 47 = 63) and refuses one past it
    (16 + 48), naming the key."""
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    hf, path = _saved(tmp_path, sliding_window=63)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.attention_window == 63 and ours.args.windowed_layers == [0, 1]
    with torch.no_grad():
        for n, close in ((63, True), (80, False)):
            ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
            diff = (ours(ids) - hf(input_ids=ids).logits).abs().max().item()
            assert diff <= TOL if close else diff > 1e-3, (n, diff)
    preflight(_cfg(path, 16, 47), devices=False)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(path, 16, 48), devices=False)
    assert ("config.json's sliding_window=63 (every layer of transformers' Phi3 attends through it)"
            in str(e.value)), str(e.value)
    ours.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 63


def test_lora_on_a_fused_projection_is_refused_and_on_the_others_loads_in_peft(tmp_path):
    """peft's adapters on Phi3ForCausalLM sit on the fused qkv_proj / gate_up_proj (one rank-r update of the fused
    rows); meshppo's model keeps q / k / v and gate / up apart, so target_modules selecting them (all-linear too)
    is refused naming the key. Adapters on o_proj and down_proj, which transformers' Phi3 has as meshppo has them,
    save as a peft adapter that peft applies to Phi3ForCausalLM with meshppo's logits."""
    from models.lora import LoRAConfig, adapter_state_dict, inject_lora, save_peft_adapter

    hf, path = _saved(tmp_path, **SHAPES[0])
    for targets in ("all-linear", ["q_proj"], ["up_proj", "o_proj"]):
        ours = Transformer.from_pretrained(path, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"target_modules selects \[.*\] of a phi3 model: transformers' Phi3 "
                                             r"fuses them .*target_modules: \['o_proj', 'down_proj'\]"):
            inject_lora(ours, LoRAConfig(4, 8.0, targets))
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    cfg = LoRAConfig(4, 8.0, ["o_proj", "down_proj"])
    inject_lora(ours, cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    save_peft_adapter(tmp_path / "adapter", adapter_state_dict(ours), cfg)
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(input_ids=ids).logits
        assert (ref - base).abs().max() > 1e-2  # the adapters act
        assert (ours(ids) - ref).abs().max().item() <= TOL


def test_lora_on_a_fused_projection_is_refused_at_pre_flight(tmp_path):
    """The same refusal before any rank builds a model: the trainer's pre-flight reads the actor's (and a
    critic's) model type and its target_modules, the default all-linear among them, and names the key."""
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _saved(tmp_path, **SHAPES[0])
    lora = ("actor_rollout_ref.model.lora_rank=8",)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model: target_modules selects .* of a phi3 model.*"
                                          r"\(its target_modules, the model in "):
        preflight(_cfg(path, 16, 32, *lora), devices=False)
    with pytest.raises(ConfigError, match=r"^critic\.model: target_modules selects \['gate_proj'\]"):
        preflight(_cfg(path, 16, 32, "algorithm.adv_estimator=gae", f"critic.model.path={path}",
                       "critic.model.lora_rank=4", "critic.model.target_modules=[gate_proj,down_proj]"), devices=False)
    preflight(_cfg(path, 16, 32, *lora, "actor_rollout_ref.model.target_modules=[o_proj,down_proj]"), devices=False)


def test_lora_naming_a_fused_module_is_refused_not_narrowed(tmp_path):
    """target_modules as a regular expression may name transformers' fused modules (qkv_proj, gate_up_proj), which
    peft selects on Phi3ForCausalLM (an adapter of rank r on each fused projection); meshppo's model has no module of
    that name, so the expression selected only its other projections (o_proj, down_proj) and trained another set of
    adapters than verl's without a word. It is refused as a fused target, at model build and at the pre-flight."""
    from models.lora import LoRAConfig, inject_lora
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _saved(tmp_path, **SHAPES[0])
    regex = r".*\.(qkv_proj|o_proj|gate_up_proj|down_proj)"
    for targets in (regex, r".*\.(qkv_proj|o_proj)"):
        with pytest.raises(ValueError, match=r"target_modules selects \['qkv_proj'.*\] of a phi3 model: transformers' "
                                             r"Phi3 fuses them \(.*self_attn\.qkv_proj"):
            inject_lora(Transformer.from_pretrained(path, dtype=torch.float64), LoRAConfig(4, 8.0, targets))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model: target_modules selects \['qkv_proj', "
                                          r"'gate_up_proj'\] of a phi3 model"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.model.lora_rank=8",
                       f"actor_rollout_ref.model.target_modules='{regex}'"), devices=False)
    with pytest.raises(ConfigError, match=r"^critic\.model: target_modules selects \['gate_up_proj'\]"):
        preflight(_cfg(path, 16, 32, "algorithm.adv_estimator=gae", f"critic.model.path={path}",
                       "critic.model.lora_rank=4", r"critic.model.target_modules='.*\.(gate_up_proj|down_proj)'"),
                  devices=False)
    # the unfused ones alone, by an expression too, stay as they were
    model = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64),
                        LoRAConfig(4, 8.0, r".*\.(o_proj|down_proj)"))
    assert model.lora_config.targets == ("o_proj", "down_proj")


def test_a_list_naming_a_fused_module_says_why_and_what_to_target():
    """peft users of Phi-3 write its module names (target_modules [qkv_proj, o_proj, gate_up_proj, down_proj], or
    exclude_modules [qkv_proj, gate_up_proj] beside all-linear): the error names the fused projections and the ones
    to target, where it only listed meshppo's q_proj ... up_proj, which a Phi3 then refuses."""
    from models.lora import LoRAConfig

    with pytest.raises(ValueError, match=r"target_modules has \['qkv_proj', 'gate_up_proj'\], which names no module .*"
                                         r"\(qkv_proj is transformers' Phi3 q_proj / k_proj / v_proj fused; gate_up_proj "
                                         r"is transformers' Phi3 gate_proj / up_proj fused: .*target the others, "
                                         r"\['o_proj', 'down_proj'\]\)$"):
        LoRAConfig(4, 8.0, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"exclude_modules has \['qkv_proj'\].*qkv_proj is transformers' Phi3"):
        LoRAConfig(4, 8.0, "all-linear", exclude_modules=["qkv_proj"])
    with pytest.raises(ValueError, match=r"names no module .*'up_proj', 'down_proj'\]$"):  # a typo: as it was
        LoRAConfig(4, 8.0, ["o_proj", "qkvproj"])
