"""Qwen2-MoE (`model_type: qwen2_moe`) in the engine, on CPU: greedy tokens and log-probs against transformers'
Qwen2MoeForCausalLM (float64; sparse layers with their shared expert beside dense ones, q/k/v biases, a sliding window
over every other layer), the checkpoint read through the engine's own loader, the TP layout of the shared expert (each
rank's rows of its gate and up projections, its columns of the down projection, the gate whole) against shards cut by
hand, and the TP sizes refused."""

import types

import pytest
import torch

from models import ModelArgs, Transformer
from rollout.config import check_tp_divisibility
from rollout.model import EngineModel
from tests.unit.hf_family import check_engine_greedy, one_thread
from tests.unit.test_qwen2_moe import SHAPES, VOCAB, _saved

transformers = pytest.importorskip("transformers")

_one_thread = one_thread


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
def test_engine_greedy_tokens_and_log_probs_are_transformers(tmp_path, shape):
    """The engine on a Qwen2-MoE checkpoint (chunked prefill and preemption forced): greedy tokens are those of a
    no-cache loop over the training model and of transformers' logits, and each token's log-prob is log_softmax of
    transformers' logits (float64, returned in float32: within 1e-6); the engine's own reader of the directory gives
    the same tokens."""
    from rollout import LLMEngine
    from rollout.engine import EngineConfig

    hf, path = _saved(tmp_path, **shape)
    engine, prompts, params, outs = check_engine_greedy(hf, path, VOCAB)
    args = engine.model.args
    assert args.model_type == "qwen2_moe" and args.shared_expert_intermediate_size and len(args.moe_layers) == 2
    assert all((layer.shared_gate is not None) == (layer.router is not None) for layer in engine.model.layers)
    again = LLMEngine.from_pretrained(str(path), EngineConfig(dtype=torch.float64, block_size=4, num_kv_blocks=64),
                                      device="cpu")
    assert [o.token_ids for o in again.generate(prompts, params)] == [o.token_ids for o in outs]


def _args(**kw) -> ModelArgs:
    """A 2-layer Qwen2-MoE: layer 0 sparse (4 experts of 32, top-2, a shared expert of 48), layer 1 dense."""
    return ModelArgs(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               model_type="qwen2_moe", attention_bias=True, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=(1,)),
                        **kw})


@pytest.mark.parametrize("rank", [0, 1])
def test_shared_expert_slots_hold_each_ranks_rows(rank):
    """At TP 2, rank j's slots of the sparse layer hold the shared expert as a dense MLP is held: gate rows
    [24 j, 24 j + 24) then the same up rows, down_proj's columns [24 j, 24 j + 24), and its gate whole (replicated);
    the routed experts and the router as before. The views are cut by `ParamSlot.shard_of` (what load_weights and the
    resharder write), compared with shards cut by hand."""
    args = _args()
    model = Transformer.build(args, seed=0)
    tp = types.SimpleNamespace(rank=rank, size=2)  # the layout needs no process group
    engine = EngineModel(args, tp, torch.float32, torch.device("cpu"), 64)
    slots = engine.param_slots()
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert set(slots) == set(params)
    for name, slot in slots.items():
        slot.view.copy_(slot.shard_of(params[name]))
    rows = slice(24 * rank, 24 * rank + 24)
    p = "layers.0.mlp.shared_expert."
    layer = engine.layers[0]
    assert layer.shared_gate_up.shape == (48, 64) and torch.equal(
        layer.shared_gate_up, torch.cat([params[p + "gate_proj.weight"][rows], params[p + "up_proj.weight"][rows]]))
    assert torch.equal(layer.shared_down, params[p + "down_proj.weight"][:, rows])
    assert torch.equal(layer.shared_gate, params["layers.0.mlp.shared_expert_gate.weight"])
    assert slots["layers.0.mlp.shared_expert_gate.weight"].shard_dim is None
    assert (slots[p + "gate_proj.weight"].shard_dim, slots[p + "down_proj.weight"].shard_dim) == (0, 1)
    assert layer.router is not None and layer.gate_up_w is None
    assert engine.layers[1].shared_gate is None and engine.layers[1].gate_up_w is not None


def test_a_tp_size_that_does_not_divide_the_shared_expert_is_refused():
    """The shared expert's width is split over the TP ranks like a dense MLP's: a TP size that does not divide it is
    refused, naming it."""
    check_tp_divisibility(_args(shared_expert_intermediate_size=34), 2)
    with pytest.raises(ValueError, match=r"tensor parallelism 4 needs shared_expert_intermediate_size \(34\) "
                                         r"divisible by 4"):
        check_tp_divisibility(_args(shared_expert_intermediate_size=34), 4)
