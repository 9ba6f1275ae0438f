"""Qwen2-MoE checkpoints (`model_type: qwen2_moe`, `Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) against
transformers' implementation on tiny random weights, in float64 on CPU, on the mixture-of-experts machinery Qwen3-MoE
brought: the shared expert beside the routed ones (`mlp.shared_expert`, scaled by `sigmoid(mlp.shared_expert_gate(x))`),
Qwen2's attention (q/k/v biases under config.json's `qkv_bias`), sparse and dense layers mixed; meshppo's logits and
gradients, the checkpoint's names, the export, the trainer's loading path, what runs with it (FLOPs, LoRA, critics,
reward models, the demo) and the arguments' checks."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (EAGER, TOL, check_export_round_trip, check_flops_match_the_flop_counter,
                                  check_in_memory_names_load, check_padded_and_packed_logits,
                                  check_peft_adapter_round_trip, check_reward_model_score, one_thread, randomized,
                                  trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Three layers: sparse, dense (mlp_only_layers), sparse, the top-2 weights not renormalised (the family's default) and
# q/k/v biases; one sparse layer of every second (decoder_sparse_step), renormalised, without biases (qkv_bias false);
# a window over layers 0 and 2 (use_sliding_window: Qwen2MoeConfig's every other layer below max_window_layers) with
# layer 0 dense.
SHAPES = [dict(mlp_only_layers=[1], norm_topk_prob=False),
          dict(decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False),
          dict(mlp_only_layers=[0], norm_topk_prob=True, use_sliding_window=True, sliding_window=8,
               max_window_layers=3)]


def _qwen2_moe(dtype=torch.float64, cls=None, **overrides):
    """transformers' Qwen2MoeForCausalLM (or `cls`) with sdpa attention and eager experts: 3 layers of hidden 32, 4
    experts of 16 (top 2), a shared expert of 24 and dense layers of 48; random weights large enough that the logits
    are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, max_position_embeddings=256, tie_word_embeddings=False,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=1,
              eos_token_id=2)
    cfg = transformers.Qwen2MoeConfig(**(kw | overrides))
    cfg._attn_implementation, cfg._experts_implementation = "sdpa", "eager"
    return randomized((cls or transformers.Qwen2MoeForCausalLM)(cfg), dtype)


def _saved(tmp_path, **overrides):
    hf = _qwen2_moe(**overrides)
    hf.save_pretrained(tmp_path / "qwen2_moe")
    return hf, tmp_path / "qwen2_moe"


# ---------------------------------------------------------------- the model
@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    Qwen2MoeForCausalLM's, its sparse layers (routed experts plus the gated shared expert) and dense ones where
    mlp_only_layers / decoder_sparse_step place them, renormalised or not, with q/k/v biases or without, windowed where
    its layer_types say; the parameter count is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    args = ours.args
    sparse = [i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock"]
    assert args.model_type == "qwen2_moe" and args.moe_layers == sparse and 0 < len(sparse) < 3
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 16)
    assert args.shared_expert_intermediate_size == 24 and args.norm_topk_prob == shape["norm_topk_prob"]
    assert args.attention_bias == shape.get("qkv_bias", True) and not args.o_proj_bias and not args.qk_norm
    assert args.layer_windows == ([8, None, 8] if "sliding_window" in shape else [None] * 3)
    assert args.num_params() == sum(p.numel() for p in hf.parameters())
    check_padded_and_packed_logits(hf, ours, VOCAB)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_gradients_equal_transformers(tmp_path, shape):
    """The gradients of the shared expert, its gate, the router, the stacked experts, a dense layer, the attention and
    the embedding are transformers' (float64), with the top-k weights renormalised and not."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    probe = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (hf(input_ids=ids).logits * probe).sum().backward()
    (ours(ids) * probe).sum().backward()
    theirs, mine = dict(hf.named_parameters()), dict(ours.named_parameters())
    sparse, dense = ours.args.moe_layers[0], 0 if shape.get("decoder_sparse_step") == 2 else 1
    names = [f"layers.{sparse}.mlp.{p}" for p in ("shared_expert_gate.weight", "shared_expert.gate_proj.weight",
                                                  "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
                                                  "gate.weight", "experts.gate_up_proj", "experts.down_proj")]
    names += [f"layers.{dense}.mlp.down_proj.weight", "layers.1.self_attn.q_proj.weight", "embed_tokens.weight"]
    names += ["layers.0.self_attn.k_proj.bias"] if shape.get("qkv_bias", True) else []
    for name in names:
        ref = theirs[f"model.{name}"].grad
        assert ref.abs().max() > 1e-3, name
        assert (mine[name].grad - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name


def test_the_shared_expert_is_gated_per_token_and_added():
    """By hand, on one sparse block (float64): its output is the routed experts' sum plus `sigmoid(x · g)` times the
    shared expert's SwiGLU of x, token by token; with the shared expert's down projection zeroed it is the routed sum
    alone, and a gate of -inf (a large negative weight along x) silences the shared expert as well."""
    import torch.nn.functional as F

    from models.moe import experts_forward, route
    from models.transformer import MoE

    args = ModelArgs(model_type="qwen2_moe", hidden_size=32, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, shared_expert_intermediate_size=24)
    block = Transformer.build(args, seed=0, dtype=torch.float64).layers[0].mlp
    assert isinstance(block, MoE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights, experts = route(x, block.gate.weight, 2, False)
    routed = experts_forward(x, weights, experts, block.experts.gate_up_proj, block.experts.down_proj)
    s = block.shared_expert
    shared = F.linear(F.silu(F.linear(x, s.gate_proj.weight)) * F.linear(x, s.up_proj.weight), s.down_proj.weight)
    scale = torch.sigmoid(x @ block.shared_expert_gate.weight[0])
    assert 0.05 < scale.min() and scale.max() < 0.95 and shared.abs().max() > 0.1
    with torch.no_grad():
        assert (block(x) - (routed + scale[:, None] * shared)).abs().max().item() <= TOL
        s.down_proj.weight.zero_()
        assert (block(x) - routed).abs().max().item() <= TOL


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_names_load_and_export_as_transformers_writes_them(tmp_path):
    """A Qwen2-MoE checkpoint (the hub's files, transformers' save_pretrained) holds one tensor per expert and
    projection and the shared expert under `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate`:
    meshppo reads them where transformers holds them, its export writes the same names and transformers 5's stacked
    in-memory names load too."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    hf, path = _saved(tmp_path, **SHAPES[0])
    tensors = load_file(str(path / "model.safetensors"))
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    mlp = ours.layers[2].mlp
    assert torch.equal(mlp.shared_expert_gate.weight, tensors["model.layers.2.mlp.shared_expert_gate.weight"])
    assert mlp.shared_expert_gate.weight.shape == (1, 32)
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(mlp.shared_expert, p).weight, tensors[f"model.layers.2.mlp.shared_expert.{p}.weight"])
    assert torch.equal(mlp.experts.gate_up_proj[3, 16:], tensors["model.layers.2.mlp.experts.3.up_proj.weight"])
    ours.save_pretrained(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("model.layers.0.mlp.shared_expert.down_proj.weight"),
                           tensors["model.layers.0.mlp.shared_expert.down_proj.weight"])
    check_in_memory_names_load(tmp_path, hf, path, ours)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_export_round_trips_through_transformers(tmp_path, shape):
    """The trained-policy export writes what transformers' save_pretrained writes (the same tensor names, the MoE,
    shared-expert, bias and router keys) and transformers loads it as Qwen2MoeForCausalLM with meshppo's logits; a
    value model exports as Qwen2MoeForTokenClassification with its scores."""
    from safetensors import safe_open

    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, _ = check_export_round_trip(tmp_path, base, "Qwen2Moe", VOCAB, hf_kwargs=EAGER)
    saved = json.loads((base / "config.json").read_text())
    for key in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias",
                "router_aux_loss_coef", "output_router_logits", "use_sliding_window", "sliding_window",
                "max_window_layers", "layer_types"):
        assert written[key] == saved[key], key
    assert "attention_bias" not in written and "head_dim" not in written
    with safe_open(str(tmp_path / "hf_actor" / "model.safetensors"), "pt") as f:
        with safe_open(str(base / "model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32, per-expert tensors, the
    shared expert), read by the trainer's actor builder (FSDP on one gloo rank, and over two): every weight lands
    where transformers holds it in memory, bit for bit."""
    from tests.dist_utils import run_distributed

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "qwen2_moe", 8, unprefixed)


# ---------------------------------------------------------------- the arguments
def test_the_arguments_round_trip():
    """ModelArgs of a Qwen2-MoE config write it back (qkv_bias under its own name, no attention_bias; the shared
    expert's width) and read back the same; the fingerprint records the shared expert's width on a Qwen2-MoE only;
    config.json's sliding_window 0 (what Qwen2MoeConfig writes without use_sliding_window) is no window; a config.json
    without layer_types and qkv_bias (written before transformers v5: Qwen1.5-MoE-A2.7B's) has q/k/v biases and windows
    Qwen2MoeConfig's default layers, every other one from the first below max_window_layers."""
    for shape in SHAPES:
        args = ModelArgs.from_hf_config(_qwen2_moe(**shape).config)
        cfg = args.to_hf_config()
        assert type(cfg).__name__ == "Qwen2MoeConfig" and cfg.qkv_bias == shape.get("qkv_bias", True)
        assert cfg.shared_expert_intermediate_size == 24 and "attention_bias" not in cfg.to_dict()
        again = ModelArgs.from_hf_config(cfg)
        assert again.fingerprint == args.fingerprint and again.layer_windows == args.layer_windows
        assert json.loads(json.dumps(args.fingerprint)) == args.fingerprint
        assert args.fingerprint["shared_expert_intermediate_size"] == 24
    assert "shared_expert_intermediate_size" not in ModelArgs(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16).fingerprint
    plain = _qwen2_moe().config.to_dict()
    assert plain["sliding_window"] == 0 and ModelArgs.from_hf_config(plain).sliding_window is None
    hub = plain | dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=16, max_window_layers=5)
    del hub["layer_types"], hub["qkv_bias"]  # (the hub's config.json has neither: its q/k/v biases by default)
    args = ModelArgs.from_hf_config(hub)
    assert args.attention_bias
    assert args.windowed_layers == [0, 2, 4] == [i for i, kind in enumerate(
        transformers.Qwen2MoeConfig(**{k: v for k, v in hub.items() if k != "model_type"}).layer_types)
        if kind == "sliding_attention"]
    assert ModelArgs.from_hf_config(hub | {"use_sliding_window": False}).windowed_layers == []


_BASE = dict(model_type="qwen2_moe", num_hidden_layers=3, hidden_size=32, intermediate_size=48, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


@pytest.mark.parametrize("fields, match", [
    (dict(shared_expert_intermediate_size=0), r"config\.json's shared_expert_intermediate_size: expected an integer > "
                                              r"0, got 0"),
    (dict(model_type="qwen3_moe"), r"shared_expert_intermediate_size is read for model_type granitemoeshared / "
                                   r"qwen2_moe only "
                                   r"\(transformers' qwen3_moe has no shared expert\)"),
    (dict(mlp_bias=True), r"qwen2_moe with mlp_bias is not supported \(transformers' Qwen2Moe has no MLP biases"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds num_experts=4"),
    (dict(mlp_only_layers=(3,)), r"mlp_only_layers=\[3\]: expected distinct layer indices in \[0, 3\)"),
])
def test_bad_arguments_are_refused_naming_the_key(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**(_BASE | fields))


@pytest.mark.parametrize("key, value, match", [
    ("hidden_act", "gelu", r"hidden_act 'gelu' is not supported"),
    ("sliding_window", 0, r"sliding_window=0 is not a positive integer or null"),  # (with use_sliding_window)
])
def test_config_keys_meshppo_does_not_compute_are_refused(key, value, match):
    cfg = _qwen2_moe(**SHAPES[2]).config.to_dict() | {key: value}
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.parametrize("key", ["shared_expert_intermediate_size", "qkv_bias"])
def test_the_shared_expert_and_the_biases_cannot_be_overridden(key):
    """override_config of the shared expert's width or qkv_bias (tensor shapes, the checkpoint's own) is refused
    naming the key."""
    from models.args import check_overrides

    with pytest.raises(ValueError, match=rf"override_config\.{key} cannot be overridden"):
        check_overrides({key: 8})


# ---------------------------------------------------------------- what runs with it
def test_parameter_count_and_flops_count_the_shared_expert():
    """num_params is transformers' (every expert, the shared expert and its gate); flops counts the router, the top-k
    experts and the shared expert with its gate that a token runs through, as PyTorch's FLOP counter counts a forward
    and a forward and backward (full, and with LoRA on the attention); by hand: a sparse layer's per-token N is
    H·E + k·3·H·I + 3·H·S + H. (Without q/k/v biases: `flops` counts a bias as a parameter, the counter not at all.)"""
    from models.lora import LoRAConfig

    hf = _qwen2_moe(**(SHAPES[0] | dict(qkv_bias=False)))
    args = ModelArgs.from_hf_config(hf.config)
    assert args.num_params() == sum(p.numel() for p in hf.parameters())
    assert args.num_params() - args.num_params(active=True) == 2 * (4 - 2) * 3 * 32 * 16  # two sparse layers
    dense = ModelArgs.from_hf_config(hf.config.to_dict() | {"mlp_only_layers": [0, 1, 2]})
    assert args.num_params(active=True) - dense.num_params() == 2 * (32 * 4 + 2 * 3 * 32 * 16 + 3 * 32 * 24 + 32
                                                                     - 3 * 32 * 48)
    for lora in (None, LoRAConfig(8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])):
        check_flops_match_the_flop_counter(args, lora)


def test_lora_on_the_attention_saves_as_peft_and_the_mlp_is_refused(tmp_path):
    """LoRA on the attention's projections (sparse and dense layers): peft reads meshppo's adapter onto
    Qwen2MoeForCausalLM with meshppo's logits. all-linear is refused, as are a list naming the shared expert's gate and
    a pattern selecting a shared expert's projection (peft would adapt it, which meshppo's LoRA does not)."""
    from models.lora import LoRAConfig, model_targets

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    hf, path = _saved(tmp_path, **SHAPES[0])
    check_peft_adapter_round_trip(tmp_path, hf, path, "qwen2_moe", VOCAB, attention,
                                  adapted=tuple(f"self_attn.{p}" for p in attention), selected=attention)
    args = ModelArgs.from_hf_config(hf.config)
    with pytest.raises(ValueError, match=r"target_modules='all-linear' on a qwen2_moe model is not supported"):
        model_targets(LoRAConfig(4), args)
    with pytest.raises(ValueError, match=r"target_modules has \['shared_expert_gate'\], which names no module"):
        model_targets(LoRAConfig(4, target_modules=["q_proj", "shared_expert_gate"]), args)
    with pytest.raises(ValueError, match=r"matches the module model\.layers\.0\.mlp\.shared_expert\.up_proj"):
        model_targets(LoRAConfig(4, target_modules="model\\.layers\\.\\d+\\.(self_attn\\.q_proj|mlp\\.shared_expert"
                                                   "\\.up_proj)"), args)


def test_a_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """A Qwen2MoeForSequenceClassification directory (num_labels 1) loads as meshppo's value model: its score at a
    sequence's last token is transformers' logit."""
    hf = _qwen2_moe(cls=transformers.Qwen2MoeForSequenceClassification, num_labels=1, **SHAPES[0])
    check_reward_model_score(tmp_path, hf, VOCAB)


def test_the_demo_model_is_a_mixture_of_experts_with_a_shared_expert():
    """tools/prepare_demo's --model-type qwen2_moe: 4 experts, top 2, not renormalised, a shared expert, q/k/v biases,
    every layer sparse; it writes a config transformers reads as its own."""
    from tools.prepare_demo import demo_model_args

    args = demo_model_args(40, 96, 3, 4, 2, eos=2, pad=0, init_std=0.1, model_type="qwen2_moe")
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 48)
    assert args.shared_expert_intermediate_size == 96 and args.attention_bias and not args.norm_topk_prob
    assert args.moe_layers == [0, 1, 2] and type(args.to_hf_config()).__name__ == "Qwen2MoeConfig"
    model = Transformer.build(args, seed=0)
    assert model(torch.arange(10)[None]).shape == (1, 10, args.vocab_size)
