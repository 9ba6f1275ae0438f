"""Qwen3-MoE (`model_type: qwen3_moe`) in the engine, on CPU: its greedy tokens and log-probs against transformers'
Qwen3MoeForCausalLM (float64; sparse and dense layers mixed, top-2 weights renormalised or not, a sliding window),
the TP layout of the experts (each rank's rows of every expert's gate and up projections, its columns of every down
projection, the router whole) against shards cut by hand, and what the engine refuses (fp8 rollout; a TP size that
does not divide moe_intermediate_size)."""

import types

import pytest
import torch

from models import ModelArgs, Transformer
from rollout.config import check_quantization, check_tp_divisibility
from rollout.model import EngineModel
from rollout.parallel import TPGroup
from tests.unit.hf_family import check_engine_greedy, one_thread
from tests.unit.test_qwen3_moe import SHAPES, VOCAB, _saved

transformers = pytest.importorskip("transformers")

_one_thread = one_thread


@pytest.mark.parametrize("shape", SHAPES)
def test_engine_greedy_tokens_and_log_probs_are_transformers(tmp_path, shape):
    """The engine on a Qwen3-MoE checkpoint (chunked prefill and preemption forced): greedy tokens are those of a
    no-cache loop over the training model and of transformers' logits, and each token's log-prob is
    log_softmax of transformers' logits (float64, returned in float32: within 1e-6)."""
    hf, path = _saved(tmp_path, **shape)
    engine = check_engine_greedy(hf, path, VOCAB)[0]
    assert engine.model.args.moe_layers and len(engine.model.args.moe_layers) < 3  # sparse and dense layers


def _moe_args(**kw) -> ModelArgs:
    """A 2-layer Qwen3-MoE: layer 0 sparse (4 experts of 32, top-2), layer 1 dense (mlp_only_layers)."""
    return ModelArgs(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                               model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               mlp_only_layers=(1,)), **kw})


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_slots_hold_each_ranks_rows_of_every_expert(rank):
    """At TP 2, rank j's slots of a MoE layer hold, of every expert, gate rows [16 j, 16 j + 16) followed by the same
    up rows (gate_up_proj [E, 2I, H]: gate rows 0..31, up rows 32..63), down_proj's columns [16 j, 16 j + 16), and
    the router whole; the dense layer's MLP as before. The views are cut from the full parameters by
    `ParamSlot.shard_of` (what load_weights and the resharder write), compared with shards cut by hand."""
    args = _moe_args()
    model = Transformer.build(args, seed=0)
    tp = types.SimpleNamespace(rank=rank, size=2)  # the layout needs no process group
    engine = EngineModel(args, tp, torch.float32, torch.device("cpu"), 64)
    slots = engine.param_slots()
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert set(slots) == set(params)
    for name, slot in slots.items():
        slot.view.copy_(slot.shard_of(params[name]))
    rows = slice(16 * rank, 16 * rank + 16)
    gate_up, down = params["layers.0.mlp.experts.gate_up_proj"], params["layers.0.mlp.experts.down_proj"]
    want_gate_up = torch.cat([gate_up[:, :32][:, rows], gate_up[:, 32:][:, rows]], dim=1)
    layer = engine.layers[0]
    assert layer.experts_gate_up.shape == (4, 32, 64) and torch.equal(layer.experts_gate_up, want_gate_up)
    assert torch.equal(layer.experts_down, down[:, :, rows])
    assert torch.equal(layer.router, params["layers.0.mlp.gate.weight"])
    assert layer.gate_up_w is None and layer.down_w is None
    assert slots["layers.0.mlp.experts.gate_up_proj"].shard_dim == 1
    assert slots["layers.0.mlp.experts.down_proj"].shard_dim == 2
    assert slots["layers.0.mlp.gate.weight"].shard_dim is None
    dense = engine.layers[1]
    assert dense.router is None and dense.experts_gate_up is None
    gate, up = params["layers.1.mlp.gate_proj.weight"], params["layers.1.mlp.up_proj.weight"]
    assert torch.equal(dense.gate_up_w, torch.cat([gate[64 * rank:64 * rank + 64], up[64 * rank:64 * rank + 64]]))


def test_the_engine_runs_a_model_whose_every_layer_is_sparse():
    """No dense layer (mlp_only_layers empty): the engine holds no dense MLP, so an intermediate_size that no TP size
    divides is accepted, and its greedy tokens are the training model's (float64)."""
    from rollout import SamplingParams
    from tests.unit.test_engine import greedy_reference, make_engine

    args = _moe_args(mlp_only_layers=(), intermediate_size=7, norm_topk_prob=True)
    assert args.moe_layers == [0, 1]
    check_tp_divisibility(args, 4)
    model = Transformer.build(args, seed=0).double()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    engine = make_engine(model, dtype=torch.float64)
    assert all(layer.down_w is None for layer in engine.model.layers)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy_reference(model, p, 6) for p in prompts]


def test_a_tp_size_that_does_not_divide_moe_intermediate_size_is_refused():
    """moe_intermediate_size is split over the TP ranks like a dense MLP's intermediate_size: a TP size that does
    not divide it is refused, naming it (and the dense layers' intermediate_size is still checked)."""
    check_tp_divisibility(_moe_args(moe_intermediate_size=34), 2)
    with pytest.raises(ValueError, match=r"tensor parallelism 4 needs moe_intermediate_size \(34\) divisible by 4"):
        check_tp_divisibility(_moe_args(moe_intermediate_size=34), 4)
    with pytest.raises(ValueError, match=r"needs intermediate_size \(34\) divisible by 4"):
        check_tp_divisibility(_moe_args(intermediate_size=34), 4)


def test_the_pre_flight_refuses_an_engine_tp_that_does_not_divide_the_experts(tmp_path):
    """Before any rank starts: an engine TP size that does not divide a Qwen3-MoE checkpoint's moe_intermediate_size
    names the option, the field and the model; one that divides it passes."""
    import json

    from tests.unit.test_ulysses_config import _cfg
    from trainer import setup
    from trainer.configlib import ConfigError

    _, path = _saved(tmp_path, dtype=torch.float32, moe_intermediate_size=15, **SHAPES[0])
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    two = ("trainer.n_gpus_per_node=2", "trainer.device=cpu", f"actor_rollout_ref.model.path={path}")
    setup.preflight(_cfg(*two, f"{tp}=1"))
    with pytest.raises(ConfigError, match=rf"^{tp}=2: tensor parallelism 2 needs moe_intermediate_size \(15\) "
                                          rf"divisible by 2 \(the model in {path}\)$"):
        setup.preflight(_cfg(*two, f"{tp}=2"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    setup.preflight(_cfg(*two, f"{tp}=2"))


def test_an_fp8_engine_of_a_moe_model_is_refused():
    """fp8 rollout (e4m3 projections) has no form for the experts' stacked weights: the engine refuses it itself (the
    trainer's pre-flight names actor_rollout_ref.rollout.quantization, tests/unit/test_qwen3_moe.py); a dense Qwen3
    is not refused."""
    with pytest.raises(ValueError, match="fp8 rollout is not supported for model_type qwen3_moe"):
        EngineModel(_moe_args(), TPGroup(), torch.float32, torch.device("cpu"), 64, quantization="fp8")
    check_quantization(ModelArgs(model_type="qwen3", head_dim=16), "fp8")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_the_engines_sparse_branch_is_the_training_blocks_in_bf16(model_type):
    """In bf16 the engine's MoE branch (`EngineModel._feed_forward` at TP 1) computes the training model's block bit
    for bit, routing weights rounded as the family rounds them (Mixtral's kept in float32,
    `ModelArgs.router_weights_float32`): the two route through one call, `models.moe.route_model`; a Qwen2-MoE's
    shared expert and its gate added as the training block adds them. With the weights rounded to bf16 on one side
    only, the outputs differ."""
    from models.moe import experts_forward, route
    from rollout.ops import TorchOps

    extra = dict(intermediate_size=32, mlp_only_layers=()) if model_type in ("mixtral", "olmoe") else {}
    extra |= dict(shared_expert_intermediate_size=48) if model_type == "qwen2_moe" else {}
    args = _moe_args(model_type=model_type, norm_topk_prob=model_type != "olmoe", **extra)
    model = Transformer.build(args, seed=0).bfloat16()
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    tp = types.SimpleNamespace(rank=0, size=1, all_reduce=lambda x: x)  # TP 1: the all-reduce is the identity
    engine = EngineModel(args, tp, torch.bfloat16, torch.device("cpu"), 64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, slot in engine.param_slots().items():
            slot.view.copy_(slot.shard_of(params[name].detach()))
        h = torch.randn(37, 64, generator=g).bfloat16()
        got = engine._feed_forward(h, engine.layers[0], TorchOps, 1)
        want = model.layers[0].mlp(h)
        block = model.layers[0].mlp
        weights, chosen = route(h, block.gate.weight, 2, args.norm_topk_prob, not args.router_weights_float32)
        other = experts_forward(h, weights, chosen, block.experts.gate_up_proj, block.experts.down_proj)
        if model_type == "qwen2_moe":
            other = other + torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    assert torch.equal(got, want)
    assert not torch.equal(other, want)
