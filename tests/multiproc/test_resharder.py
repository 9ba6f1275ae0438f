"""The resharder fills the real engine's TP slots from FSDP shards (gloo, CPU, 4 ranks).

Configurations: shard groups of W=4 ranks (FULL_SHARD) and W=2 ranks (HYBRID_SHARD 2 x 2, each
replica resharding inside its own group), TP t in {1, 2}. For each: every slot equals the
slice of the full weights bitwise after the bf16 cast, on both the zero-redundancy and the
naive path; the bytes received meet the zero-redundancy bound; greedy tokens of the engine
equal those of the unsharded model; the FSDP shards are untouched.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import ModelArgs, Transformer
from rollout import EngineConfig, LLMEngine, SamplingParams
from sharding import FSDPConfig, ParallelDims, Resharder, build_fsdp_model, load_full_tensors
from tests.dist_utils import run_distributed

CONFIGS = [(-1, 1), (-1, 2), (2, 1), (2, 2)]  # (fsdp_size, tp)
# Qwen2-like (tied, q/k/v bias) with sizes that split evenly, and a Llama-like model whose
# vocabulary (98) and MLP width (102) do not split over 4 ranks: the embedding, LM head and
# MLP weights then take the counted fallback route on W=4.
MODELS = {
    "even": ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, model_type="qwen2", attention_bias=True,
                      tie_word_embeddings=True),
    # Qwen3-like: per-head q/k norms (replicated over TP, sharded by FSDP), heads wider than hidden / heads
    "qwen3": ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, max_position_embeddings=64, model_type="qwen3"),
    "uneven": ModelArgs(vocab_size=98, hidden_size=64, intermediate_size=102, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, mlp_bias=True),
}
PROMPTS = [[1, 5, 9, 2], [7, 3], [11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 8


def _peaky_weights(model, seed):
    """Full tensors large enough for non-degenerate greedy decoding (init std 0.02 gives near-flat logits)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        yield name, (1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                     else 0.15 * torch.randn(p.shape, generator=g))


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def _engine(args, dtype, meshes, device="cpu"):
    cfg = EngineConfig(dtype=dtype, block_size=4, num_kv_blocks=32, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=32)
    return LLMEngine(args, cfg, tp_mesh=meshes.tp, device=device)


def _expected_slice(full, shard_dim, tp_rank, tp):
    if shard_dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=shard_dim)[tp_rank]


def reshard_every_path(resharder, per_layer, engine, expected, context=()):
    """Each path into `engine`: the zero-redundancy one with `resharder`'s buckets and with `per_layer`'s, and the
    naive one, every slot filled with NaN before it runs. After each, every slot equals `expected(name, slot)`
    bitwise (`context` names the configuration in a failure). Returns the zero-redundancy path's stats and the naive
    path's."""
    stats = {}
    for path, run in (("zero_redundancy", resharder.reshard), ("per_layer", per_layer.reshard),
                      ("naive", resharder.reshard_naive)):
        for slot in engine.param_slots().values():
            slot.view.fill_(float("nan"))  # anything not written fails the bitwise comparison
        stats[path] = run()
        for name, slot in engine.param_slots().items():
            assert torch.equal(slot.view, expected(name, slot)), (path, name, *context)
    return stats["zero_redundancy"], stats["naive"]


def check_resharded_greedy(model, meshes, args, full, device, context=()):
    """A float32 engine (the reference's numerics) filled by the resharder from `model`'s FSDP shards generates the
    greedy tokens of the unsharded model holding `full`, and they are not constant (`context` names the
    configuration in a failure)."""
    engine32 = _engine(args, torch.float32, meshes, device)
    Resharder(model, meshes, engine32).reshard()
    ref = Transformer(args)
    ref.load_state_dict(full)
    outs = engine32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    want = [_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert [o.token_ids for o in outs] == want, context
    assert len({tok for w in want for tok in w}) > 3  # the comparison is not between constant outputs


def _check(rank, world, fsdp_size, tp, kind, device="cpu"):
    """One configuration on `device` (the GPU check, tests/gpu/multi_gpu_checks.py, runs it over NCCL)."""
    device = torch.device(device)
    args = MODELS[kind]
    dims = ParallelDims(world, fsdp_size=fsdp_size, tp=tp)
    meshes = dims.build_meshes(device.type)
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=fsdp_size, mixed_precision={"param_dtype": "fp32"}),
                             device=device)
    load_full_tensors(model, _peaky_weights(model, seed=3))
    # One training step, so that the engine must get the live shards, not the initial ones.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank)).to(device)
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, args.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    local_before = {n: p.to_local().clone() for n, p in model.named_parameters()}

    engine = _engine(args, torch.bfloat16, meshes, device)
    resharder = Resharder(model, meshes, engine)
    # One bucket per layer: the embedding then exceeds a bucket and is gathered straight into
    # the engine (the default merges this tiny model's layers into one bucket).
    per_layer = Resharder(model, meshes, engine, bucket_bytes=0)
    tp_rank, S, t = dims.tp_rank(rank), dims.dp_shard, dims.tp
    if dims.micro_dp > 1:
        assert len(per_layer.buckets) > len(resharder.buckets)
        assert any(b.direct for b in per_layer.buckets) == (args.vocab_size % S == 0)  # the embedding
    def expected(name, slot):
        return _expected_slice(full[name].to(torch.bfloat16), slot.shard_dim, tp_rank, t)

    fast, stats = reshard_every_path(resharder, per_layer, engine, expected, (fsdp_size, tp))
    P = fast.param_bytes
    assert P == sum(v.numel() for v in full.values()) * 2
    if args.vocab_size % S == 0 and args.intermediate_size % S == 0:  # every TP-sharded dimension splits over S
        assert fast.num_fallback == 0
        assert fast.bytes_received == fast.bytes_bound  # exactly the bound: nothing redundant moves
        assert fast.bytes_received <= P / t * (1 - t / S) + 0.05 * P / t, (kind, fsdp_size, tp, fast)
    else:
        # Chunks that do not line up with TP shards are gathered whole, and counted: the
        # embedding, the LM head and, per layer, the gate/up weights and biases and, at TP 1, the
        # down weight; at TP 2 FSDP's dim-0 chunks of the down weight (its columns split over TP)
        # go by one all-to-all each.
        assert fast.num_fallback == 2 + (4 if t > 1 else 5) * args.num_hidden_layers
        assert fast.num_all_to_all == (args.num_hidden_layers if t > 1 else 0)
    assert stats.bytes_received >= P * (1 - 1 / S)  # the naive path moves the whole model
    assert fast.bytes_received <= stats.bytes_received
    if t > 1 and kind != "uneven":
        assert fast.bytes_received < stats.bytes_received / t
    assert resharder.total_bytes_received == fast.bytes_received + stats.bytes_received
    assert per_layer.total_bytes_received == fast.bytes_received
    for n, p in model.named_parameters():
        assert torch.equal(p.to_local(), local_before[n]), n  # training shards untouched

    check_resharded_greedy(model, meshes, args, full, device, (kind, fsdp_size, tp))

    # The engine releases and re-allocates its weights between phases: the same resharder
    # fills the new buffer (it fetches the slots at every call and keeps none).
    engine.free_weights()
    engine.init_weights_storage()
    resharder.reshard()
    for name, slot in engine.param_slots().items():
        assert torch.equal(slot.view, expected(name, slot)), ("after re-allocation", name)


def _body(rank, world):
    for fsdp_size, tp in CONFIGS:
        for kind in MODELS:
            _check(rank, world, fsdp_size, tp, kind)

    # A target whose layout disagrees with the model is refused before anything moves.
    dims = ParallelDims(world, tp=2)
    meshes = dims.build_meshes("cpu")
    model = build_fsdp_model(MODELS["even"], meshes.train, FSDPConfig())
    slots = dict(_engine(MODELS["even"], torch.bfloat16, meshes).param_slots())
    slots.pop("norm.weight")
    with pytest.raises(ValueError, match="only in the model"):
        Resharder(model, meshes, slots)
    engine1 = LLMEngine(MODELS["even"], EngineConfig(num_kv_blocks=8, max_model_len=32), device="cpu")  # TP=1 shapes
    with pytest.raises(ValueError, match="its TP shard is"):
        Resharder(model, meshes, engine1)
    dist.barrier()


def test_reshard_fsdp_to_engine_w2_w4_tp1_tp2():
    run_distributed(_body, 4)
