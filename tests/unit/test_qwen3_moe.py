"""Qwen3-MoE checkpoints (`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`) against transformers' implementation on tiny
random weights, in float64 on CPU: the router and experts (`models/moe.py`) against a per-token reference, both of
their paths against each other, meshppo's model (sparse and dense layers mixed) and its gradients, the checkpoint's
per-expert tensors loaded and exported, and the arguments' checks."""

import json

import pytest
import torch
import torch.nn.functional as F

from models import ModelArgs, Transformer
from models.moe import experts_forward, route
from tests.unit.hf_family import (EAGER, TOL, check_export_round_trip, check_flops_match_the_flop_counter,
                                  check_in_memory_names_load, check_padded_and_packed_logits,
                                  check_peft_adapter_round_trip, check_reward_model_score, one_thread, randomized,
                                  trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Three layers: sparse, dense (mlp_only_layers), sparse; one sparse layer of every second (decoder_sparse_step), the
# top-2 weights renormalised; GQA with an explicit head_dim; a sliding window over every layer (use_sliding_window).
SHAPES = [dict(mlp_only_layers=[1], norm_topk_prob=False),
          dict(decoder_sparse_step=2, norm_topk_prob=True),
          dict(mlp_only_layers=[0], norm_topk_prob=True, use_sliding_window=True, sliding_window=8)]


def _qwen3_moe(dtype=torch.float64, cls=None, **overrides):
    """transformers' Qwen3MoeForCausalLM (or `cls`) with sdpa attention and eager experts, random weights large
    enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=1, eos_token_id=2)
    cfg = transformers.Qwen3MoeConfig(**(kw | overrides))
    cfg._attn_implementation, cfg._experts_implementation = "sdpa", "eager"
    return randomized((cls or transformers.Qwen3MoeForCausalLM)(cfg), dtype)


def _saved(tmp_path, **overrides):
    hf = _qwen3_moe(**overrides)
    hf.save_pretrained(tmp_path / "moe")
    return hf, tmp_path / "moe"


# ---------------------------------------------------------------- models/moe.py
def _reference(x, weight, gate_up, down, top_k, norm):
    """Token by token: the router's float32 softmax, its top_k by a full sort, each expert's SwiGLU."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax((weight @ x[t]).float(), dim=-1)
        top = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        ws = torch.stack([probs[e] for e in top])
        ws = (ws / ws.sum() if norm else ws).to(x.dtype)
        for w, e in zip(ws, top):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


def _experts(dtype, tokens=13, experts=5, hidden=32, inter=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    weight = torch.randn(experts, hidden, generator=g, dtype=torch.float64)
    weight[experts - 1] = -10 * x.mean(0)  # an expert no token picks: an empty group
    gate_up = 0.3 * torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = 0.3 * torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (x, weight, gate_up, down)]


@pytest.mark.parametrize("norm", [False, True])
def test_route_and_experts_forward_are_the_per_token_formula(norm):
    """route() picks each token's top-2 experts by the float32 softmax (renormalised where asked) and
    experts_forward() sums their SwiGLU outputs by those weights, as a token-by-token loop computes it (float64);
    an expert no token picks is an empty group."""
    x, weight, gate_up, down = _experts(torch.float64)
    weights, experts = route(x, weight, 2, norm)
    assert weights.dtype == torch.float64 and experts.dtype == torch.int64 and experts.shape == (13, 2)
    assert (experts != 4).all()  # the empty group
    assert torch.allclose(weights.sum(-1), torch.ones(13, dtype=torch.float64)) == norm
    ref = _reference(x, weight, gate_up, down, 2, norm)
    got = experts_forward(x, weights, experts, gate_up, down)
    assert ref.abs().max() > 1
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_experts_forward_gradients_pass_gradcheck(top_k):
    """The backward of experts_forward (its reorderings by expert and back, which gather the gradient by the inverse
    permutation and sum each token's copies) against central differences in float64: the gradients of the tokens,
    the routing weights and both expert tensors; one expert picked by no token."""
    x, weight, gate_up, down = _experts(torch.float64, tokens=7, experts=4, hidden=8, inter=4)
    weights, experts = route(x, weight, top_k, True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up, down)]
    assert torch.autograd.gradcheck(lambda a, w, gu, d: experts_forward(a, w, experts, gu, d), leaves)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_the_grouped_gemm_path_is_the_loop_path(dtype, tol):
    """The grouped-GEMM path (CUDA bf16's; torch's CPU kernel takes float32 and bf16) gives the loop path's outputs
    and gradients (of x, the routing weights and both expert tensors): the sort, the group ends counted on the
    device and the way back to (token, slot) order agree; an expert without tokens and a batch of one token too.
    float32 within 1e-4 and bf16 within 0.1 of values ~1-10: a misrouted row is off by their size."""
    for tokens in (13, 1):
        x, weight, gate_up, down = _experts(dtype, tokens=tokens)
        weights, experts = route(x, weight, 2, True)
        outs, grads = [], []
        for grouped in (False, True):
            leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up, down)]
            out = experts_forward(leaves[0], leaves[1], experts, leaves[2], leaves[3], grouped=grouped)
            (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
            outs.append(out.float())
            grads.append([t.grad.float() for t in leaves])
        assert outs[0].abs().max() > 1
        assert (outs[0] - outs[1]).abs().max().item() <= tol
        for a, b in zip(*grads):
            assert a.abs().max() > 0.1 and (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


# ---------------------------------------------------------------- the model
@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_qwen3_moe(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    Qwen3MoeForCausalLM's, with sparse and dense layers as its mlp_only_layers / decoder_sparse_step place them,
    the top-k weights renormalised or not, a window over every layer where use_sliding_window."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    args = ours.args
    sparse = [i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert args.model_type == "qwen3_moe" and args.qk_norm and args.moe_layers == sparse and 0 < len(sparse) < 3
    assert [type(layer.mlp).__name__ for layer in ours.layers] == ["MoE" if i in sparse else "MLP" for i in range(3)]
    assert args.norm_topk_prob == shape["norm_topk_prob"] and (args.num_experts, args.num_experts_per_tok) == (4, 2)
    assert args.layer_windows == [shape.get("sliding_window")] * 3
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_gradients_equal_transformers_qwen3_moe(tmp_path):
    """The backward through the router and the experts (and a dense layer beside them) gives transformers'
    gradients, float64."""
    hf, path = _saved(tmp_path, **SHAPES[0])
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    probe = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (hf(input_ids=ids).logits * probe).sum().backward()
    (ours(ids) * probe).sum().backward()
    theirs = dict(hf.named_parameters())
    mine = dict(ours.named_parameters())
    for name in ("layers.0.mlp.gate.weight", "layers.0.mlp.experts.gate_up_proj", "layers.2.mlp.experts.down_proj",
                 "layers.1.mlp.down_proj.weight", "layers.0.self_attn.q_proj.weight", "embed_tokens.weight"):
        ref = theirs[f"model.{name}"].grad
        assert ref.abs().max() > 1e-3, name
        assert (mine[name].grad - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name


def test_stacked_expert_tensors_load_too(tmp_path):
    """A safetensors file with transformers 5's in-memory names (`mlp.experts.gate_up_proj`, stacked) loads as the
    per-expert form does; a checkpoint that lacks an expert's tensor, or has one of another shape, is refused
    naming it."""
    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointFileError

    hf, path = _saved(tmp_path, **SHAPES[0])
    per_expert = Transformer.from_pretrained(path, dtype=torch.float64)
    check_in_memory_names_load(tmp_path, hf, path, per_expert)
    assert torch.equal(per_expert.layers[0].mlp.experts.gate_up_proj[3],
                       torch.cat([hf.model.layers[0].mlp.experts.gate_up_proj[3, :16],
                                  hf.model.layers[0].mlp.experts.gate_up_proj[3, 16:]]))

    tensors = load_file(str(path / "model.safetensors"))
    for name, edit in (("model.layers.2.mlp.experts.3.up_proj.weight", None),
                       ("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(32, 8))):
        broken = tmp_path / name.split(".")[-3]
        broken.mkdir()
        (broken / "config.json").write_text((path / "config.json").read_text())
        save_file({k: v for k, v in tensors.items() if k != name} | ({name: edit} if edit is not None else {}),
                  str(broken / "model.safetensors"))
        what = (r"has 7 of the 4 experts' tensors of 'layers\.2\.mlp\.experts\.gate_up_proj'" if edit is None
                else r"'layers\.0\.mlp\.experts\.1\.down_proj\.weight' .* has shape \(32, 8\), expected \(32, 16\)")
        with pytest.raises(CheckpointFileError, match=what):
            Transformer.from_pretrained(broken)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_export_round_trips_through_transformers_qwen3_moe(tmp_path, shape):
    """The trained-policy export writes what transformers 5's save_pretrained writes (one tensor per expert and
    projection, the MoE keys, num_experts under transformers' name num_local_experts) and transformers loads it as
    Qwen3MoeForCausalLM with meshppo's logits; a value model exports as Qwen3MoeForTokenClassification with its
    scores."""
    from safetensors import safe_open

    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, again = check_export_round_trip(tmp_path, base, "Qwen3Moe", VOCAB, hf_kwargs=EAGER)
    saved = json.loads((base / "config.json").read_text())
    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "head_dim", "router_aux_loss_coef", "output_router_logits"):
        assert written[key] == saved[key], key
    with safe_open(str(tmp_path / "hf_actor" / "model.safetensors"), "pt") as f:
        with safe_open(str(base / "model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_qwen3_moe_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32, per-expert tensors),
    read by the trainer's actor builder (FSDP on one gloo rank, and over two: the stacked experts sharded along their
    expert dim): every weight lands where transformers holds it in memory (its stacked experts), bit for bit."""
    from tests.dist_utils import run_distributed

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "qwen3_moe", 16, unprefixed)


# ---------------------------------------------------------------- the arguments
def test_the_arguments_round_trip_and_dense_fingerprints_are_unchanged():
    """ModelArgs of a Qwen3-MoE config.json (num_experts under either name) write it back; a dense type's
    fingerprint records no MoE field (a checkpoint written before they existed resumes), a Qwen3-MoE's records them
    as its JSON reads them back."""
    hf = _qwen3_moe(**SHAPES[0])
    args = ModelArgs.from_hf_config(hf.config)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 16)
    assert args.mlp_only_layers == (1,) and args.moe_layers == [0, 2]
    hub = hf.config.to_dict() | {"num_experts": 6}
    del hub["num_local_experts"]
    assert ModelArgs.from_hf_config(hub).num_experts == 6
    again = ModelArgs.from_hf_config(args.to_hf_config())
    assert again.fingerprint == args.fingerprint
    assert json.loads(json.dumps(args.fingerprint)) == args.fingerprint
    assert {"num_experts", "mlp_only_layers"} <= set(args.fingerprint)
    dense = ModelArgs(model_type="qwen3")
    assert not {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers"} & set(dense.fingerprint)
    assert dense.moe_layers == []


@pytest.mark.parametrize("fields, match", [
    (dict(num_experts=0), r"config.json's num_experts: expected an integer > 0, got 0"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds num_experts=4"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size: expected an integer > 0"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step: expected an integer > 0"),
    (dict(mlp_only_layers=(3,)), r"mlp_only_layers=\[3\]: expected distinct layer indices in \[0, 3\)"),
    (dict(mlp_only_layers=(1, 1)), r"mlp_only_layers=\[1, 1\]"),
    (dict(attention_bias=True), r"qwen3_moe with attention_bias or mlp_bias is not supported"),
    (dict(model_type="qwen3"), r"num_experts is read for model_type granitemoe / granitemoeshared / mixtral / olmoe / "
                               r"qwen2_moe / qwen3_moe only"),
])
def test_bad_moe_arguments_are_refused_naming_the_key(fields, match):
    base = dict(model_type="qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16)
    with pytest.raises(ValueError, match=match):
        ModelArgs(**(base | fields))


def test_an_activation_other_than_silu_is_refused():
    cfg = _qwen3_moe().config.to_dict() | {"hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelArgs.from_hf_config(cfg)


# ---------------------------------------------------------------- what runs with it
def test_parameter_count_and_flops_count_the_experts_a_token_runs():
    """num_params is transformers' parameter count (every expert); flops counts the router and the top-k experts a
    token runs through (PyTorch's FLOP counter on a forward, and on a forward and backward, full and with LoRA on
    the attention), not all experts; by hand: a sparse layer's per-token N is H·E + k·3·H·I."""
    from models.lora import LoRAConfig

    hf = _qwen3_moe(**SHAPES[0])
    args = ModelArgs.from_hf_config(hf.config)
    assert args.num_params() == sum(p.numel() for p in hf.parameters())
    assert args.num_params() - args.num_params(active=True) == 2 * (4 - 2) * 3 * 32 * 16  # two sparse layers
    dense = ModelArgs.from_hf_config(hf.config.to_dict() | {"mlp_only_layers": [0, 1, 2]})
    assert args.num_params(active=True) - dense.num_params() == 2 * (32 * 4 + 2 * 3 * 32 * 16 - 3 * 32 * 48)
    for lora in (None, LoRAConfig(8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])):
        check_flops_match_the_flop_counter(args, lora)


def test_lora_on_the_attention_saves_as_peft_and_all_linear_is_refused(tmp_path):
    """LoRA on the attention's projections (every layer's, sparse or dense): peft reads meshppo's adapter onto
    Qwen3MoeForCausalLM with meshppo's logits, and it reads back. all-linear (peft then adapts the routers and the
    stacked experts as parameters, which meshppo's LoRA does not) is refused, as is a list naming an MLP projection
    (peft maps gate_proj / up_proj / down_proj onto the experts' parameters)."""
    from models.lora import LoRAConfig, model_targets

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    hf, path = _saved(tmp_path, **SHAPES[0])
    check_peft_adapter_round_trip(tmp_path, hf, path, "qwen3_moe", VOCAB, attention,
                                  adapted=tuple(f"self_attn.{p}" for p in attention), selected=attention)
    args = ModelArgs.from_hf_config(hf.config)
    with pytest.raises(ValueError, match=r"target_modules='all-linear' on a qwen3_moe model is not supported .*"
                                         r"\[q_proj, k_proj, v_proj, o_proj\]"):
        model_targets(LoRAConfig(4), args)
    with pytest.raises(ValueError, match=r"matches the module model\.layers\.0\.mlp\.experts\.gate_proj"):
        model_targets(LoRAConfig(4, target_modules=attention + ["gate_proj"]), args)
    with pytest.raises(ValueError, match=r"target_modules has \['gate'\], which names no module"):  # (the router)
        model_targets(LoRAConfig(4, target_modules=["q_proj", "gate"]), args)


def test_a_qwen3_moe_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """A Qwen3MoeForSequenceClassification directory (num_labels 1) loads as meshppo's value model: its score at a
    sequence's last token is transformers' logit."""
    hf = _qwen3_moe(cls=transformers.Qwen3MoeForSequenceClassification, num_labels=1, **SHAPES[0])
    check_reward_model_score(tmp_path, hf, VOCAB)


def test_the_tiled_mlp_and_fp8_rollout_are_refused_and_router_logits_noted(tmp_path):
    """tiled_mlp.enabled (whose tiles are one SwiGLU MLP's) and rollout.quantization=fp8 (which quantizes linear
    projections) are refused at the trainer's pre-flight naming the key, and apply_tiled_mlp refuses the model;
    config.json's output_router_logits=true gets a start-up note (no load-balancing loss is added, as in verl), and an
    override of it is accepted as changing nothing."""
    from models.args import check_overrides
    from models.tiled_mlp import apply_tiled_mlp
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import model_notes, preflight

    _, path = _saved(tmp_path, dtype=torch.float32, output_router_logits=True, **SHAPES[0])
    preflight(_cfg(path, 16, 32), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.tiled_mlp\.enabled=true: the tiled MLP is not "
                                          r"supported for model_type qwen3_moe"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.model.tiled_mlp.enabled=true"), devices=False)
    with pytest.raises(ValueError, match="the tiled MLP is not supported for model_type qwen3_moe"):
        apply_tiled_mlp(Transformer.from_pretrained(path), 2)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.quantization=fp8: fp8 rollout is not "
                                          r"supported for model_type qwen3_moe"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.rollout.quantization=fp8"), devices=False)
    notes = [n for n in model_notes(_cfg(path, 16, 32)) if "output_router_logits" in n]
    assert len(notes) == 1 and "router_aux_loss_coef=0.001" in notes[0]
    overridden = _cfg(path, 16, 32, "+actor_rollout_ref.model.override_config.output_router_logits=false")
    assert not [n for n in model_notes(overridden) if "output_router_logits" in n]
    assert "output_router_logits" in check_overrides({"output_router_logits": False})[1]


def test_the_demo_model_is_a_mixture_of_experts():
    """tools/prepare_demo's --model-type qwen3_moe: 4 experts, top 2, renormalised, every layer sparse."""
    from tools.prepare_demo import demo_model_args

    args = demo_model_args(40, 96, 3, 4, 2, eos=2, pad=0, init_std=0.1, model_type="qwen3_moe")
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 48)
    assert args.moe_layers == [0, 1, 2] and args.norm_topk_prob
    model = Transformer.build(args, seed=0)
    assert model(torch.arange(10)[None]).shape == (1, 10, args.vocab_size)
