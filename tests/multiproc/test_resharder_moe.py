"""The resharder fills a Qwen3-MoE engine's TP slots from FSDP shards (gloo, CPU): one rank at TP 1, and two ranks
(FULL_SHARD) at TP 1 and TP 2.

Every slot equals its shard of the full weights bitwise after the bf16 cast, on the zero-redundancy path (one bucket,
and one a layer) and the naive one, the expert shards cut by hand (rank j: gate rows and up rows [j I/t, (j+1) I/t)
of every expert, down columns the same). FSDP shards `experts.down_proj` on its TP dimension (2), so it moves with
zero redundancy; `experts.gate_up_proj` by expert (dim 0): at TP 1 gathered whole, a counted fallback that moves
exactly the bytes it must, at TP 2 by one all-to-all (each rank sends the other its TP rows of its experts). The
float32 engine's greedy tokens from the resharded weights are the full model's. A Qwen2-MoE's shared expert travels
as a dense MLP does (its gate and up rows, its down columns, zero redundancy) and its `[1, H]` gate whole, as the
router does; a Granite-MoE-Shared's (every layer sparse, Granite's scalars) the same without the gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from models import ModelArgs, tp_shard_dim
from sharding import FSDPConfig, ParallelDims, Resharder, build_fsdp_model, load_full_tensors
from tests.dist_utils import run_distributed
from tests.multiproc.test_resharder import (_engine, _expected_slice, _peaky_weights, check_resharded_greedy,
                                            reshard_every_path)

# layers 0 and 2 sparse (4 experts of 32, top-2), layer 1 dense
ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, model_type="qwen3_moe",
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,),
                 norm_topk_prob=True)
# the same layers of a Qwen2-MoE: q/k/v biases, a shared expert of 64 beside each sparse layer's routed experts
QWEN2_MOE = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, model_type="qwen2_moe", attention_bias=True,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,),
                      shared_expert_intermediate_size=64)
# a Granite-MoE-Shared: every layer sparse (experts intermediate_size wide), its ungated shared expert of 64, its
# scalars
GRANITE_MOE_SHARED = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               model_type="granitemoeshared", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True, shared_expert_intermediate_size=64,
                               embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
                               logits_scaling=2.0)


def _expected(name: str, full: torch.Tensor, tp_rank: int, t: int) -> torch.Tensor:
    """This TP rank's shard of the full parameter `name`, the experts' cut by hand."""
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(t, dim=1)[tp_rank], up.chunk(t, dim=1)[tp_rank]], dim=1)
    if name.endswith("mlp.experts.down_proj"):
        return full.chunk(t, dim=2)[tp_rank]
    return _expected_slice(full, tp_shard_dim(name), tp_rank, t)


def check_moe(rank: int, world: int, tp: int, device="cpu", args: ModelArgs = ARGS) -> None:
    """One configuration (FULL_SHARD over `world` ranks, TP `tp`) of the model `args` on `device` (the GPU check,
    tests/gpu/multi_gpu_checks.py, runs it over NCCL)."""
    device = torch.device(device)
    dims = ParallelDims(world, tp=tp)
    meshes = dims.build_meshes(device.type)
    model = build_fsdp_model(args, meshes.train, FSDPConfig(mixed_precision={"param_dtype": "fp32"}), device=device)
    load_full_tensors(model, _peaky_weights(model, seed=3))
    S, t, tp_rank = dims.dp_shard, dims.tp, dims.tp_rank(rank)
    params = dict(model.named_parameters())
    if S > 1:  # down_proj on its TP dimension, gate_up_proj and the router by expert
        assert params["layers.0.mlp.experts.down_proj"].placements[-1] == Shard(2)
        assert params["layers.0.mlp.experts.gate_up_proj"].placements[-1] == Shard(0)
        assert params["layers.0.mlp.gate.weight"].placements[-1] == Shard(0)
    # one training step: the engine must get the live shards
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank)).to(device)
    F.cross_entropy(model(ids[:, :-1]).reshape(-1, args.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}

    engine = _engine(args, torch.bfloat16, meshes, device)
    resharder = Resharder(model, meshes, engine)
    per_layer = Resharder(model, meshes, engine, bucket_bytes=0)
    fast, stats = reshard_every_path(resharder, per_layer, engine,
                                     lambda name, slot: _expected(name, full[name].to(torch.bfloat16), tp_rank, t),
                                     (world, tp))
    gate_ups = [n for n in full if n.endswith("mlp.experts.gate_up_proj")]
    assert len(gate_ups) == len(args.moe_layers)
    # gate_up_proj: at TP 1 gathered whole over the shard group (a counted fallback: (S-1)/S of it received, which
    # is what the rank needs); at TP > 1 by one all-to-all each ((S-1)/S of the rank's TP shard received, where the
    # zero-redundancy bound is the TP shard's rows beyond this rank's chunk: 1/t - 1/S of the parameter)
    assert fast.num_fallback == (len(gate_ups) if S > 1 and t == 1 else 0)
    assert fast.num_all_to_all == (len(gate_ups) if t > 1 else 0)
    n = full[gate_ups[0]].numel()
    received = (S - 1) * n // S // t
    extra = len(gate_ups) * (received - (n // t - n // S)) * 2
    # a shared expert's gate [1, H] (replicated) is one row, which FSDP's dim-0 chunks pad to one row a rank: each rank
    # receives the S - 1 others' padded chunks, a whole row each, where the bound counts (S-1)/S of the row
    uneven = sum((S - 1) * (full[name].numel() - full[name].numel() // S) * 2
                 for name in full if name.endswith("mlp.shared_expert_gate.weight"))
    assert fast.bytes_received == fast.bytes_bound + extra + uneven, (fast, extra, uneven)
    assert extra == (0 if t == 1 else len(gate_ups) * n // 2)  # TP 2 of 2 ranks: a quarter of each, 2 bytes each
    assert fast.bytes_received <= stats.bytes_received  # the naive path moves the whole model
    check_resharded_greedy(model, meshes, args, full, device, (world, tp))


def _one_rank(rank, world):
    check_moe(rank, world, 1)


def _two_ranks(rank, world, args=ARGS):
    for tp in (1, 2):
        check_moe(rank, world, tp, args=args)


def test_reshard_moe_one_rank_tp1():
    run_distributed(_one_rank, 1)


def test_reshard_moe_two_ranks_tp1_tp2():
    run_distributed(_two_ranks, 2)


@pytest.mark.parametrize("args", [QWEN2_MOE, GRANITE_MOE_SHARED], ids=["qwen2_moe", "granitemoeshared"])
def test_reshard_a_shared_expert_two_ranks_tp1_tp2(args):
    run_distributed(_two_ranks, 2, args)
