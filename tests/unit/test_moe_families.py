"""Mixtral (`model_type: mixtral`, `MixtralForCausalLM`), OLMoE (`model_type: olmoe`, `OlmoeForCausalLM`) and
Granite-MoE (`granitemoe`, `GraniteMoeForCausalLM`; `granitemoeshared`, `GraniteMoeSharedForCausalLM`) checkpoints
against transformers' implementation on tiny random weights, in float64 on CPU, on the mixture-of-experts machinery
Qwen3-MoE brought (`models/moe.py`, the `MoE` block, the per-expert checkpoint tensors): meshppo's logits and
gradients, the checkpoints' names (Mixtral's `block_sparse_moe` and w1 / w3 / w2), the export, the trainer's loading
path, what runs with them (FLOPs, LoRA, critics, reward models, refusals) and the arguments' checks."""

import contextlib
import json

import re

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (EAGER, TOL, check_export_round_trip, check_flops_match_the_flop_counter,
                                  check_hf_critic_refused_at_preflight, check_in_memory_names_load,
                                  check_padded_and_packed_logits, check_peft_adapter_round_trip,
                                  check_reward_model_score, one_thread, randomized, trainer_loads_bit_for_bit,
                                  unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Each family's transformers classes, its config's name for the experts' count, and its shapes under test: Mixtral
# with GQA, an explicit head_dim and a sliding window over every layer, and without a window; OLMoE with GQA,
# attention biases (q, k, v and o_proj) and its top-k weights renormalised, and as OLMoE-1B-7B (one KV head per query
# head, not renormalised); Granite-MoE with GQA, attention biases (o_proj's too) and its four scalars, and without;
# Granite-MoE-Shared with its shared expert (24 wide), and with shared_intermediate_size 0 (none, as its config's
# default).
_GRANITE_SCALARS = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                        logits_scaling=3.0)
FAMILIES = {
    "mixtral": ("Mixtral", "num_local_experts", [dict(num_key_value_heads=2, head_dim=16, sliding_window=8),
                                                 dict(num_key_value_heads=4)]),
    "olmoe": ("Olmoe", "num_experts", [dict(num_key_value_heads=2, attention_bias=True, norm_topk_prob=True),
                                       dict(num_key_value_heads=4, norm_topk_prob=False)]),
    "granitemoe": ("GraniteMoe", "num_local_experts", [dict(num_key_value_heads=2, attention_bias=True,
                                                            **_GRANITE_SCALARS), dict(num_key_value_heads=4)]),
    "granitemoeshared": ("GraniteMoeShared", "num_local_experts", [
        dict(num_key_value_heads=2, shared_intermediate_size=24, **_GRANITE_SCALARS),
        dict(num_key_value_heads=4, attention_bias=True, shared_intermediate_size=0)]),
}
GRANITE = ("granitemoe", "granitemoeshared")
CASES = [(t, s) for t, (_, _, shapes) in FAMILIES.items() for s in shapes]


def _hf(model_type, dtype=torch.float64, cls="ForCausalLM", **overrides):
    """transformers' `<Family><cls>` with sdpa attention and eager experts: 3 layers, 4 experts of 16, each token
    through 2; random weights large enough that the logits are decisive."""
    family, experts_key, _ = FAMILIES[model_type]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=1,
              bos_token_id=None, eos_token_id=2, **{experts_key: 4})
    cfg = getattr(transformers, f"{family}Config")(**(kw | overrides))
    cfg._attn_implementation, cfg._experts_implementation = "sdpa", "eager"
    return randomized(getattr(transformers, f"{family}{cls}")(cfg), dtype)


def _saved(tmp_path, model_type, **overrides):
    hf = _hf(model_type, **overrides)
    hf.save_pretrained(tmp_path / model_type)
    return hf, tmp_path / model_type


# ---------------------------------------------------------------- the model
@pytest.mark.parametrize("model_type, shape", CASES)
def test_logits_equal_transformers(tmp_path, model_type, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    MixtralForCausalLM's (Mistral's attention, its window over every layer; every layer sparse, the top-2 weights
    renormalised) and OlmoeForCausalLM's (pre-norm blocks, q / k normed over the whole projections as OLMo-2's,
    renormalised or not) and GraniteMoeForCausalLM / GraniteMoeSharedForCausalLM (Granite's scalars; the softmax over
    the top-2 logits, `router_softmax_topk`; the shared expert added ungated), every layer a mixture of experts of
    intermediate_size; the parameter count is transformers'."""
    hf, path = _saved(tmp_path, model_type, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    args = ours.args
    assert args.model_type == model_type and args.moe_layers == [0, 1, 2]
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 16)
    assert args.norm_topk_prob == (model_type in ("mixtral", *GRANITE) or shape["norm_topk_prob"])
    assert args.router_softmax_topk == (model_type in GRANITE) and not args.shared_expert_gated
    assert args.shared_expert_intermediate_size == shape.get("shared_intermediate_size", 0)
    assert (args.embedding_scale, args.residual_multiplier, args.attention_scale, args.logits_scaling) == (
        (2.0, 0.5, 0.2, 3.0) if "logits_scaling" in shape else (1.0, 1.0, 1.0 if model_type in GRANITE else
                                                                args.head_dim ** -0.5, 1.0))
    assert args.full_qk_norm == (model_type == "olmoe") and not args.post_norm and not args.qk_norm
    assert args.o_proj_bias == shape.get("attention_bias", False)
    assert args.layer_windows == [shape.get("sliding_window")] * 3
    assert args.num_params() == sum(p.numel() for p in hf.parameters())
    check_padded_and_packed_logits(hf, ours, VOCAB)


def _hf_name(model_type: str, name: str) -> str:
    """transformers' in-memory name of meshppo's parameter `name` (Granite-MoE's sparse block is `block_sparse_moe`,
    its router `router`)."""
    if model_type in GRANITE:
        name = name.replace(".mlp.gate.", ".block_sparse_moe.router.").replace(".mlp.experts.",
                                                                             ".block_sparse_moe.experts.")
    return f"model.{name}"


@pytest.mark.parametrize("model_type, shape", CASES[::2])
def test_gradients_equal_transformers(tmp_path, model_type, shape):
    """The gradients of the router, the stacked experts, the attention (OLMoE's q_norm) and the embedding are
    transformers' (float64); a Granite-MoE-Shared's shared expert's gate and up rows and down projection its
    `shared_mlp`'s."""
    hf, path = _saved(tmp_path, model_type, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    probe = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (hf(input_ids=ids).logits * probe).sum().backward()
    (ours(ids) * probe).sum().backward()
    theirs, mine = dict(hf.named_parameters()), dict(ours.named_parameters())
    names = ["layers.0.mlp.gate.weight", "layers.0.mlp.experts.gate_up_proj", "layers.2.mlp.experts.down_proj",
             "layers.1.self_attn.q_proj.weight", "embed_tokens.weight"]
    names += ["layers.1.self_attn.q_norm.weight", "layers.0.self_attn.o_proj.bias"] if model_type == "olmoe" else []
    for name in names:
        ref = theirs[_hf_name(model_type, name)].grad
        assert ref.abs().max() > 1e-3, name
        assert (mine[name].grad - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name
    if model_type == "granitemoeshared":
        shared = ours.layers[1].mlp.shared_expert
        pairs = [(torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad]),
                  theirs["model.layers.1.shared_mlp.input_linear.weight"].grad),
                 (shared.down_proj.weight.grad, theirs["model.layers.1.shared_mlp.output_linear.weight"].grad)]
        for got, ref in pairs:
            assert ref.abs().max() > 1e-3
            assert (got - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


def test_mixtral_routing_weights_stay_float32_as_transformers_keeps_them():
    """In bfloat16, meshppo's sparse block of a Mixtral is transformers' MixtralSparseMoeBlock (its default grouped_mm
    experts) bit for bit: the top-k weights stay in float32 (MixtralTopKRouter does not cast them), each expert's output
    times its weight in float32, the sum rounded once. Both run the same products (torch's grouped GEMM on the same
    rows, two slots summed), so equality is exact, not a tolerance; weights rounded to bf16 first (Qwen3-MoE's and
    OLMoE's router) give other numbers, which the check would see."""
    from models.moe import experts_forward, route
    from models.transformer import MoE

    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"  # (what from_pretrained gives it: transformers' default)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    block = block.to(torch.bfloat16)
    args = ModelArgs(model_type="mixtral", hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True)
    assert args.router_weights_float32
    ours = MoE(args).to(torch.bfloat16)
    ours.load_state_dict(block.state_dict())
    x = torch.randn(1, 50, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        ref = block(x)
        assert torch.equal(ours(x), ref)
        weights, experts = route(x[0], ours.gate.weight, 2, True)  # rounded to bf16 first
        rounded = experts_forward(x[0], weights, experts, ours.experts.gate_up_proj, ours.experts.down_proj)
        assert not torch.equal(rounded, ref[0])


# ---------------------------------------------------------------- checkpoints
def test_mixtral_checkpoint_names_load_and_export_as_transformers_writes_them(tmp_path):
    """A Mixtral checkpoint names its sparse block `block_sparse_moe` and its experts' projections w1 (gate), w3 (up)
    and w2 (down), as the hub's files and transformers' save_pretrained do: meshppo reads them onto its stacked experts
    (expert 3's gate rows are w1's, its up rows w3's) and its export writes the same names; transformers 5's stacked
    in-memory names load too; a missing expert tensor is refused naming the stack."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointFileError

    hf, path = _saved(tmp_path, "mixtral", **FAMILIES["mixtral"][2][0])
    tensors = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in tensors
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    gate_up = ours.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(gate_up[:16], tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"])
    assert torch.equal(gate_up[16:], tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(ours.layers[2].mlp.experts.down_proj[1], tensors["model.layers.2.block_sparse_moe.experts.1.w2.weight"])
    assert torch.equal(ours.layers[0].mlp.gate.weight, tensors["model.layers.0.block_sparse_moe.gate.weight"])

    ours.save_pretrained(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w3.weight"),
                           tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"])

    check_in_memory_names_load(tmp_path, hf, path, ours)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.block_sparse_moe.experts.0.w2.weight"},
              str(broken / "model.safetensors"))
    with pytest.raises(CheckpointFileError, match=r"has 3 of the 4 experts' tensors of 'layers\.2\.mlp\.experts\."
                                                  r"down_proj'"):
        Transformer.from_pretrained(broken)


def test_granite_moe_checkpoint_names_load_and_export_as_transformers_writes_them(tmp_path):
    """A Granite-MoE-Shared checkpoint keeps its experts stacked under its own names, as the hub's files and
    transformers' save_pretrained write them: `block_sparse_moe.input_linear` (each expert's gate rows, then its up
    rows), `output_linear` and `router.layer`, and its shared expert's fused `shared_mlp.input_linear` (gate rows, then
    up) and `output_linear`. meshppo reads them onto its stacked experts, router and shared expert and its export writes
    the same names, tensor for tensor; transformers 5's in-memory names (`block_sparse_moe.experts.gate_up_proj`,
    `router.weight`) load too; a shared_mlp.input_linear of another width is refused naming the file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointFileError

    hf, path = _saved(tmp_path, "granitemoeshared", **FAMILIES["granitemoeshared"][2][0])
    tensors = load_file(str(path / "model.safetensors"))
    assert {"model.layers.1.block_sparse_moe.input_linear.weight",
            "model.layers.1.block_sparse_moe.router.layer.weight",
            "model.layers.1.shared_mlp.input_linear.weight"} <= set(tensors)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    mlp = ours.layers[1].mlp
    assert torch.equal(mlp.experts.gate_up_proj, tensors["model.layers.1.block_sparse_moe.input_linear.weight"])
    assert torch.equal(mlp.experts.down_proj, tensors["model.layers.1.block_sparse_moe.output_linear.weight"])
    assert torch.equal(mlp.gate.weight, tensors["model.layers.1.block_sparse_moe.router.layer.weight"])
    fused = tensors["model.layers.1.shared_mlp.input_linear.weight"]
    assert torch.equal(mlp.shared_expert.gate_proj.weight, fused[:24])
    assert torch.equal(mlp.shared_expert.up_proj.weight, fused[24:])
    assert torch.equal(mlp.shared_expert.down_proj.weight, tensors["model.layers.1.shared_mlp.output_linear.weight"])
    assert not hasattr(mlp, "shared_expert_gate")

    ours.save_pretrained(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
        for key in tensors:
            assert torch.equal(f.get_tensor(key), tensors[key]), key

    check_in_memory_names_load(tmp_path, hf, path, ours)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors | {"model.layers.2.shared_mlp.input_linear.weight": fused[:40].clone()},
              str(broken / "model.safetensors"))
    with pytest.raises(CheckpointFileError, match=r"'layers\.2\.mlp\.shared_expert\.gate_up_proj\.weight' in .* has "
                                                  r"shape \(40, 32\), expected 48 rows"):
        Transformer.from_pretrained(broken)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_round_trips_through_transformers(tmp_path, model_type):
    """The trained-policy export writes what transformers' save_pretrained writes (the same tensor names, the MoE and
    router keys) and transformers loads it with meshppo's logits; a Mixtral value model exports as
    MixtralForTokenClassification with its scores, an OLMoE's and a Granite-MoE's are refused (transformers has no
    Olmoe or GraniteMoe classifier)."""
    from safetensors import safe_open

    family, experts_key, shapes = FAMILIES[model_type]
    _, base = _saved(tmp_path, model_type, dtype=torch.float32, **shapes[0])
    written, _ = check_export_round_trip(tmp_path, base, family, VOCAB, token_classifier=model_type == "mixtral",
                                         hf_kwargs=EAGER)
    assert "norm_topk_prob" not in written if model_type in GRANITE else True
    saved = json.loads((base / "config.json").read_text())
    keys = [experts_key, "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef", "output_router_logits"]
    keys += {"mixtral": ["sliding_window", "router_jitter_noise", "head_dim"],
             "olmoe": ["norm_topk_prob", "clip_qkv", "attention_bias"]}.get(model_type, [
                 "attention_bias", *_GRANITE_SCALARS, *(["shared_intermediate_size"] if model_type == "granitemoeshared"
                                                        else [])])
    for key in keys:
        assert written[key] == saved[key], key
    with safe_open(str(tmp_path / "hf_actor" / "model.safetensors"), "pt") as f:
        with safe_open(str(base / "model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_saved_directory_loads_through_the_trainers_model_path(tmp_path, model_type, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32, per-expert tensors;
    Mixtral's under its own names), read by the trainer's actor builder (FSDP on one gloo rank, and over two): every
    weight lands where transformers holds it in memory (its stacked experts), bit for bit."""
    from tests.dist_utils import run_distributed

    _, path = _saved(tmp_path, model_type, dtype=torch.float32, **FAMILIES[model_type][2][0])
    head_dim = 16 if model_type == "mixtral" else 8
    run_distributed(trainer_loads_bit_for_bit, world, str(path), model_type, head_dim,
                    granite_moe_names if model_type in GRANITE else unprefixed)


def granite_moe_names(state_dict, config):
    """transformers' state dict of a Granite-MoE(-Shared) by meshppo's names: its router and experts under `mlp`, its
    shared expert's fused `shared_mlp.input_linear` as the gate rows then the up rows of `mlp.shared_expert`."""
    out = {}
    for k, v in state_dict.items():
        k = k.removeprefix("model.").replace(".block_sparse_moe.router.", ".mlp.gate.").replace(
            ".block_sparse_moe.experts.", ".mlp.experts.")
        if ".shared_mlp.input_linear." in k:
            gate, up = v.chunk(2)
            out[k.replace(".shared_mlp.input_linear.", ".mlp.shared_expert.gate_proj.")] = gate
            out[k.replace(".shared_mlp.input_linear.", ".mlp.shared_expert.up_proj.")] = up
        else:
            out[k.replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj.")] = v
    return out


# ---------------------------------------------------------------- the arguments
@pytest.mark.parametrize("model_type, shape", CASES)
def test_the_arguments_round_trip(model_type, shape):
    """ModelArgs of a Mixtral or OLMoE config write it back (the experts' count under the config's own name, no
    moe_intermediate_size, decoder_sparse_step or mlp_only_layers, which their configs lack), and read back the
    same."""
    hf = _hf(model_type, **shape)
    args = ModelArgs.from_hf_config(hf.config)
    cfg = args.to_hf_config().to_dict()
    assert type(args.to_hf_config()).__name__ == f"{FAMILIES[model_type][0]}Config"
    assert cfg[FAMILIES[model_type][1]] == 4 and cfg["intermediate_size"] == 16
    assert not {"moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"} & set(cfg)
    if model_type == "olmoe":
        assert cfg["norm_topk_prob"] == shape["norm_topk_prob"] and cfg["attention_bias"] == shape.get(
            "attention_bias", False)
    again = ModelArgs.from_hf_config(cfg)
    assert again.fingerprint == args.fingerprint and again.layer_windows == args.layer_windows


_BASE = dict(num_hidden_layers=3, hidden_size=32, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16)


@pytest.mark.parametrize("fields, match", [
    (dict(model_type="mixtral", norm_topk_prob=False), r"mixtral with norm_topk_prob=False is not supported: "
                                                       r"transformers' Mixtral has norm_topk_prob true"),
    (dict(model_type="mixtral", norm_topk_prob=True, moe_intermediate_size=8),
     r"mixtral with moe_intermediate_size=8 is not supported: transformers' Mixtral has moe_intermediate_size 16"),
    (dict(model_type="olmoe", mlp_only_layers=(1,)), r"olmoe with mlp_only_layers=\(1,\) is not supported: "
                                                     r"transformers' Olmoe has mlp_only_layers \[\]"),
    (dict(model_type="olmoe", decoder_sparse_step=2), r"olmoe with decoder_sparse_step=2 is not supported"),
    (dict(model_type="olmoe", head_dim=16), r"olmoe with head_dim=16 is not supported: transformers' Olmoe norms the "
                                            r"query over hidden_size \(32\)"),
    (dict(model_type="olmoe", mlp_bias=True), r"olmoe with mlp_bias is not supported"),
    (dict(model_type="mixtral", norm_topk_prob=True, attention_bias=True),
     r"mixtral with attention_bias or mlp_bias is not supported \(transformers' Mixtral has no biases"),
    (dict(model_type="mixtral", norm_topk_prob=True, num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds"),
    (dict(model_type="granitemoe", norm_topk_prob=False), r"granitemoe with norm_topk_prob=False is not supported: "
                                                          r"transformers' GraniteMoe has norm_topk_prob true"),
    (dict(model_type="granitemoe", norm_topk_prob=True, mlp_bias=True),
     r"granitemoe with mlp_bias is not supported \(transformers' GraniteMoe has no MLP biases"),
    (dict(model_type="granitemoe", norm_topk_prob=True, shared_expert_intermediate_size=8),
     r"shared_expert_intermediate_size is read for model_type granitemoeshared / qwen2_moe only"),
    (dict(model_type="granitemoeshared", norm_topk_prob=True, shared_expert_intermediate_size=-8),
     r"config\.json's shared_intermediate_size: expected an integer >= 0, got -8"),
    (dict(model_type="mistral", num_experts=0, num_experts_per_tok=2, moe_intermediate_size=0),
     r"num_experts_per_tok is read for model_type granitemoe / granitemoeshared / mixtral / olmoe / qwen2_moe / "
     r"qwen3_moe only"),
])
def test_bad_arguments_are_refused_naming_the_key(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**(_BASE | fields))


@pytest.mark.parametrize("model_type, key, value, match", [
    ("mixtral", "router_jitter_noise", 0.1, r"config\.json's router_jitter_noise=0\.1 is not supported for mixtral "
                                            r"\(transformers' Mixtral multiplies each sparse layer's input by uniform "
                                            r"noise .*; only 0 is: set actor_rollout_ref\.model\.override_config\."
                                            r"router_jitter_noise=0 in the trainer"),
    ("olmoe", "clip_qkv", 8.0, r"config\.json's clip_qkv=8\.0 is not supported for olmoe \(transformers' Olmoe then "
                               r"clamps the query, key and value projections .*; only null is$"),
    ("mixtral", "hidden_act", "gelu", r"hidden_act 'gelu' is not supported"),
    ("granitemoe", "hidden_act", "gelu", r"hidden_act 'gelu' is not supported"),
    ("granitemoeshared", "logits_scaling", 0.0, r"config\.json's logits_scaling: expected a number > 0, got 0\.0"),
])
def test_config_keys_meshppo_does_not_compute_are_refused(model_type, key, value, match):
    """Mixtral's router_jitter_noise > 0 (random log-probs in transformers' training mode, which verl's actor runs
    in; refused with the override that sets it to 0) and OLMoE's clip_qkv (a clamp meshppo's attention and engine do
    not apply) are refused naming the key, as is an activation other than silu."""
    cfg = _hf(model_type).config.to_dict() | {key: value}
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(cfg)


def test_router_jitter_noise_is_overridden_to_zero(tmp_path):
    """override_config.router_jitter_noise=0 (the refusal's fix) loads a Mixtral whose config.json sets jitter, and
    its export writes 0; another value is refused naming the key, as is the override on a type without jitter; the
    trainer's actor (as build_models loads it) is refused without the override, naming the key, and loads with it; the
    trainer's config refuses another value."""
    from models.args import check_overrides
    from models.checkpoint import load_model_args
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError

    _, path = _saved(tmp_path, "mixtral", dtype=torch.float32, router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported for mixtral"):
        load_model_args(path)
    args = load_model_args(path, {"router_jitter_noise": 0})
    assert args.extra_hf["router_jitter_noise"] == 0 and args.to_hf_config().router_jitter_noise == 0
    with pytest.raises(ValueError, match=r"override_config\.router_jitter_noise=0\.1 is not supported by meshppo "
                                         r"\(transformers' Mixtral multiplies"):
        check_overrides({"router_jitter_noise": 0.1})
    _, olmoe = _saved(tmp_path, "olmoe", dtype=torch.float32)
    with pytest.raises(ValueError, match="override_config.router_jitter_noise=0.0: model_type olmoe has no router "
                                         "jitter noise"):
        load_model_args(olmoe, {"router_jitter_noise": 0})
    for extra, refused in (((), True), (("+actor_rollout_ref.model.override_config.router_jitter_noise=0",), False)):
        model = _cfg(path, 16, 32, *extra).actor_rollout_ref.model  # (what build_models loads the actor by)
        with pytest.raises(ValueError, match="router_jitter_noise=0.1") if refused else contextlib.nullcontext():
            load_model_args(model.path, model.override_config)
    with pytest.raises(ConfigError, match=r"override_config\.router_jitter_noise=0\.2 is not supported by meshppo"):
        _cfg(path, 16, 32, "+actor_rollout_ref.model.override_config.router_jitter_noise=0.2")


# ---------------------------------------------------------------- what runs with it
@pytest.mark.parametrize("model_type", FAMILIES)
def test_flops_count_the_experts_a_token_runs(model_type):
    """num_params counts every expert; flops the router and the top-k experts a token runs through, as PyTorch's FLOP
    counter counts a forward and a forward and backward; by hand: a layer's per-token N is H·E + k·3·H·I beside the
    attention."""
    args = ModelArgs.from_hf_config(_hf(model_type).config)
    assert args.num_params() - args.num_params(active=True) == 3 * (4 - 2) * 3 * 32 * 16
    check_flops_match_the_flop_counter(args)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_on_the_attention_saves_as_peft_and_all_linear_is_refused(tmp_path, model_type):
    """LoRA on the attention's projections: peft reads meshppo's adapter onto transformers' model with meshppo's
    logits. all-linear (peft with transformers 5 then adapts each layer's router and stacked experts as parameters,
    which meshppo's LoRA does not) is refused, as is a list naming an MLP projection."""
    from models.lora import LoRAConfig, model_targets

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    hf, path = _saved(tmp_path, model_type, **FAMILIES[model_type][2][0])
    check_peft_adapter_round_trip(tmp_path, hf, path, model_type, VOCAB, attention,
                                  adapted=tuple(f"self_attn.{p}" for p in attention), selected=attention)
    args = ModelArgs.from_hf_config(hf.config)
    with pytest.raises(ValueError, match=rf"target_modules='all-linear' on a {model_type} model is not supported") as err:
        model_targets(LoRAConfig(4), args)
    # the router and experts it names are modules of transformers' model
    router, = re.findall(r"adapts each layer's router \((\S+)\)", str(err.value))
    experts, = re.findall(r"stacked experts \((\S+)' gate_up_proj", str(err.value))
    modules = dict(hf.named_modules())
    assert f"model.layers.0.{router}" in modules and f"model.layers.0.{experts}" in modules, (router, experts)
    block = "block_sparse_moe" if model_type in GRANITE else "mlp"
    with pytest.raises(ValueError, match=rf"matches the module model\.layers\.0\.{block}\.experts\.down_proj"):
        model_targets(LoRAConfig(4, target_modules=attention + ["down_proj"]), args)
    if model_type == "granitemoeshared":  # its shared expert's nn.Linear modules, which peft would adapt
        from models.lora import _hf_module_names, peft_targets

        with pytest.raises(ValueError, match=r"target_modules has \['input_linear'\], which names no module"):
            LoRAConfig(4, target_modules=attention + ["input_linear"])  # (a config's own check, on no model)
        names = _hf_module_names(3, model_type=model_type, sparse_layers=[0, 1, 2])
        with pytest.raises(ValueError, match=r"matches the module model\.layers\.0\.shared_mlp\.input_linear"):
            peft_targets(attention + ["input_linear"], names, model_type=model_type)


def test_a_mixtral_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """A MixtralForSequenceClassification directory (num_labels 1) loads as meshppo's value model: its score at a
    sequence's last token is transformers' logit."""
    hf = _hf("mixtral", cls="ForSequenceClassification", num_labels=1)
    check_reward_model_score(tmp_path, hf, VOCAB)


@pytest.mark.parametrize("model_type", ["olmoe", *GRANITE])
def test_an_olmoe_or_granite_moe_critic_is_not_exported_as_a_hugging_face_directory(tmp_path, model_type):
    """transformers has no Olmoe or GraniteMoe classifier: a critic of one passes the pre-flight, and is refused naming
    the key where its checkpoints would write it as a Hugging Face directory."""
    _, path = _saved(tmp_path, model_type, dtype=torch.float32)
    family = FAMILIES[model_type][0]
    check_hf_critic_refused_at_preflight(path, rf"an? {model_type} value model cannot be written as a Hugging Face "
                                               rf"directory: transformers has no {family}ForTokenClassification, so")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_tiled_mlp_and_fp8_rollout_are_refused(tmp_path, model_type):
    """tiled_mlp.enabled and rollout.quantization=fp8 are refused at the trainer's pre-flight naming the key, as on a
    Qwen3-MoE."""
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _saved(tmp_path, model_type, dtype=torch.float32)
    preflight(_cfg(path, 16, 32), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.tiled_mlp\.enabled=true: the tiled MLP is not "
                                          rf"supported for model_type {model_type}"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.model.tiled_mlp.enabled=true"), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.quantization=fp8: fp8 rollout is not "
                                          rf"supported for model_type {model_type}"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.rollout.quantization=fp8"), devices=False)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_demo_model_is_a_mixture_of_experts(model_type):
    """tools/prepare_demo's --model-type mixtral / olmoe: 4 experts of intermediate_size, top 2, every layer sparse;
    Mixtral's renormalised, OLMoE's not; it writes a config transformers reads as its own."""
    from tools.prepare_demo import demo_model_args

    args = demo_model_args(40, 96, 3, 4, 2, eos=2, pad=0, init_std=0.1, model_type=model_type)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.intermediate_size) == (
        4, 2, 48, 48)
    assert args.moe_layers == [0, 1, 2] and args.norm_topk_prob == (model_type in ("mixtral", *GRANITE))
    assert args.shared_expert_intermediate_size == (96 if model_type == "granitemoeshared" else 0)
    assert args.logits_scaling == (8.0 if model_type in GRANITE else 1.0)
    assert type(args.to_hf_config()).__name__ == f"{FAMILIES[model_type][0]}Config"
    model = Transformer.build(args, seed=0)
    assert model(torch.arange(10)[None]).shape == (1, 10, args.vocab_size)
