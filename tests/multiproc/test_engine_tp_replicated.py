"""TP sizes vLLM runs beyond an even split: more TP ranks than KV heads (each rank holds a copy of the KV
head its query heads attend to), through the engine's own weight loading and through the resharder from
the FSDP actor (gloo, CPU, float32)."""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

KV_HEAD_CASES = {2: 1, 4: 2}  # TP size -> the model's KV heads (fewer than the TP ranks)


def kv_args(num_key_value_heads: int, **kw):
    """A tiny qwen2 (q/k/v biases, tied head) with 8 query heads and `num_key_value_heads` KV heads; its
    vocabulary of 128 gives shards of a multiple of 16 ids at TP 1, 2 and 4, so that the sampler races the same
    groups of ids (`rollout.sampler.race_group`) and draws the same tokens."""
    from tests.unit.test_engine import tiny_args

    return tiny_args("qwen2", vocab_size=128, num_attention_heads=8, num_key_value_heads=num_key_value_heads, **kw)


SAMPLINGS = ({"temperature": 0, "max_tokens": 10},
             {"n": 2, "temperature": 0.9, "top_k": 5, "max_tokens": 8, "seed": 6},
             {"n": 2, "temperature": 1.1, "top_p": 0.8, "top_k": 20, "max_tokens": 8, "seed": 7})


def assert_generates_as_tp1(engine, model, prompts, tol: float = 1e-5) -> None:
    """`engine` (TP > 1) gives TP 1's tokens for greedy and seeded top-k / top-p sampling, and its
    log-probs within `tol` (float32: the row-parallel all-reduce sums in another order)."""
    from rollout import SamplingParams
    from tests.unit.test_engine import make_engine

    tp1 = make_engine(model, num_kv_blocks=24, max_num_batched_tokens=16)
    for kw in SAMPLINGS:
        sp = SamplingParams(**kw)
        want, got = tp1.generate(prompts, sp), engine.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], kw
        diff = max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs))
        assert diff < tol, (kw, diff)
    assert len({tok for o in want for tok in o.token_ids}) > 3  # not constant outputs


def _kv_replicated_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine
    from tests.unit.test_engine import prompts_of, tiny_model

    kv = KV_HEAD_CASES[world]
    model = tiny_model(kv_args(kv))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24,
                                                max_num_batched_tokens=16), tp_mesh=mesh["tp"], device="cpu")
    engine.load_weights(model.named_parameters())
    # This rank's 8 / world query heads, and a copy of the KV head they attend to: head rank // (world / kv).
    d, head = model.args.head_dim, rank // (world // kv)
    assert engine.model.num_heads == 8 // world and engine.model.num_kv_heads == 1
    params = dict(model.named_parameters())
    slots = engine.param_slots()
    for proj in ("k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            name = f"layers.1.self_attn.{proj}.{kind}"
            assert torch.equal(slots[name].view, params[name].detach()[head * d:(head + 1) * d]), name
    q = params["layers.1.self_attn.q_proj.weight"].detach()
    assert torch.equal(slots["layers.1.self_attn.q_proj.weight"].view, q.chunk(world)[rank])
    engine.init_cache()
    assert engine.runner.kv_cache.shape[4] == 1  # the pool holds one KV head a rank
    assert_generates_as_tp1(engine, model, prompts_of([3, 17, 9, 30, 1], seed=2))


def test_tp2_with_one_kv_head_equals_tp1():
    run_distributed(_kv_replicated_body, 2)


def test_tp4_with_two_kv_heads_equals_tp1():
    run_distributed(_kv_replicated_body, 4)


def _from_pretrained_body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine
    from tests.unit.test_engine import prompts_of, tiny_model

    model = tiny_model(kv_args(1))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24,
                                                          max_num_batched_tokens=16), tp_mesh=mesh["tp"], device="cpu")
    assert_generates_as_tp1(engine, model, prompts_of([3, 17, 9], seed=2))


def test_from_pretrained_at_tp2_with_one_kv_head_equals_tp1(tmp_path):
    from models.checkpoint import save_pretrained
    from tests.unit.test_engine import tiny_model

    save_pretrained(tiny_model(kv_args(1)), tmp_path)
    run_distributed(_from_pretrained_body, 2, str(tmp_path))


def resharder_and_engines(reference, world: int, fsdp_size: int, tp: int):
    """`reference`'s weights as an FSDP model over `world` ranks (`fsdp_size`), and two engines at TP
    `tp`: one the FSDP model reshards into (with its `Resharder`), one loaded directly."""
    from rollout import EngineConfig, LLMEngine
    from sharding import FSDPConfig, ParallelDims, Resharder, build_fsdp_model, load_full_tensors

    meshes = ParallelDims(world, fsdp_size=fsdp_size, tp=tp).build_meshes("cpu")
    model = build_fsdp_model(reference.args, meshes.train, FSDPConfig(fsdp_size=fsdp_size), device="cpu")
    load_full_tensors(model, ((n, p.detach()) for n, p in reference.named_parameters()))
    config = EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    engine = LLMEngine(reference.args, config, tp_mesh=meshes.tp, device="cpu")
    direct = LLMEngine(reference.args, config, tp_mesh=meshes.tp, device="cpu")
    direct.load_weights(reference.named_parameters())
    return Resharder(model, meshes, engine), engine, direct


def reshard_equals_direct(reshard, engine, direct, where):
    """Runs `reshard` (a resharder's fast or naive pass) into `engine`, whose slots it first fills with
    NaN so that anything not written fails, and asserts each slot equals `direct`'s (the same weights
    loaded directly); its stats."""
    for slot in engine.param_slots().values():
        slot.view.fill_(float("nan"))
    stats = reshard()
    for name, slot in engine.param_slots().items():
        assert torch.equal(slot.view, direct.param_slots()[name].view), (where, name)
    return stats


def _reshard_body(rank, world, cases):
    """The trainer's route: FSDP actor -> engine by the resharder, against the same weights loaded directly.
    `cases`: (fsdp_size, tp, KV heads, the K/V projections' route)."""
    import torch.distributed as dist

    from tests.unit.test_engine import prompts_of, tiny_model

    for fsdp_size, tp, kv, route in cases:
        resharder, engine, direct = resharder_and_engines(tiny_model(kv_args(kv)), world, fsdp_size, tp)
        for reshard in (resharder.reshard, resharder.reshard_naive):
            stats = reshard_equals_direct(reshard, engine, direct, (fsdp_size, tp))
            if not stats.naive:
                # each rank receives only what its slots hold beyond its own chunks
                assert stats.num_fallback == 0 and stats.bytes_received == stats.bytes_bound, (fsdp_size, tp, stats)
        kv_routes = {it.route for b in resharder.buckets for it in b.items if ".k_proj." in it.name}
        assert kv_routes == {route}, (fsdp_size, tp, kv_routes)
        prompts = prompts_of([3, 17, 9], seed=2)
        from rollout import SamplingParams

        sp = SamplingParams(n=2, temperature=0.9, top_p=0.9, max_tokens=8, seed=4)
        got, want = engine.generate(prompts, sp), direct.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]  # the same weights, the same program
    dist.barrier()


def test_resharder_fills_replicated_kv_heads_as_loading_does():
    # On 4 ranks the K/V head's chunks lie on the whole shard group (gathered whole: TP 2, one KV head, 2
    # ranks a TP shard), or on a block of 2 of its 4 ranks (TP 4, two KV heads: gathered inside that block);
    # HYBRID_SHARD 2 x 2 reshards in each replica.
    run_distributed(_reshard_body, 4, ((-1, 2, 1, "full"), (-1, 4, 2, "kv"), (2, 2, 1, "full")))


def test_resharder_fills_replicated_kv_heads_with_two_ranks_a_tp_shard():
    # 8 ranks, TP 4 with two KV heads (Qwen2.5-1.5B's case on a node of 8): each head's chunks lie on a block
    # of 4 ranks, 2 of them (micro-DP) holding each TP shard
    run_distributed(_reshard_body, 8, ((-1, 4, 2, "kv"),), timeout=600)


def _kv_replicated_triton_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine, SamplingParams
    from tests.unit.test_engine import make_engine, prompts_of, tiny_model

    model = tiny_model(kv_args(1, head_dim=16))  # 16 lanes: the kernels' head tile, unpadded
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24,
                                                max_num_batched_tokens=16), tp_mesh=mesh["tp"], device="cpu")
    engine.load_weights(model.named_parameters())
    engine.runner.use_triton = True  # prefill and decode attention with Hq/t = 4 query heads over 1 KV head
    assert engine.runner.ops.__name__ == "TritonOps"
    tp1 = make_engine(model, num_kv_blocks=24, max_num_batched_tokens=16)
    prompts, sp = prompts_of([3, 17, 9], seed=2), SamplingParams(n=2, temperature=0.9, max_tokens=3, seed=5)
    want, got = tp1.generate(prompts, sp), engine.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs)) < 1e-4


def test_tp2_with_one_kv_head_triton_kernels_equal_tp1():
    """The Triton kernels' grid and GQA grouping take this rank's heads (4 query heads, 1 KV head) as the
    PyTorch path does (on CPU under the Triton interpreter)."""
    import pytest

    pytest.importorskip("triton")
    run_distributed(_kv_replicated_triton_body, 2, triton_interpret=True)
