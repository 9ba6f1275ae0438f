"""Resharding FSDP actor → engine TP weights: the zero-redundancy path against the naive one.

    python bench/reshard.py                               # one GPU (or CPU): one process
    torchrun --nproc_per_node=N bench/reshard.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--tp 1] [--fsdp-size -1]
    torchrun --nproc_per_node=2 bench/reshard.py --num-layers 2        # quick CPU run (gloo)

NCCL on GPUs, gloo on CPU. The actor is an fp32 FSDP2 model sharded on its TP dimensions
(random weights: speed does not depend on the values), the target a real bf16 `LLMEngine`.
Per model and path it prints one JSON line: world, tp, bf16 parameter bytes P, bytes received
per rank (max over ranks), the zero-redundancy bound `P/t·(1 − t/S)`, ms (median over
repeats, synchronised), ms per GB of bf16 weights, the peak extra device memory, and for
a summary line the speed-up over the naive path measured in the same run. On one
GPU the floor is the fp32→bf16 cast-copy, 0.70 ms per GB of output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit, model_args  # noqa: E402
from models import Transformer  # noqa: E402
from rollout import EngineConfig, LLMEngine  # noqa: E402
from sharding import FSDPConfig, ParallelDims, Resharder, apply_fsdp  # noqa: E402

CAST_COPY_MS_PER_GB = 0.70  # H200 fp32 → bf16 cast-copy, per GB of bf16 output


def build_actor(args, mesh, device, seed):
    """fp32 FSDP2 actor with random local shards (generated on the device: no full model anywhere)."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh, FSDPConfig())
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=g)
    model.reset_buffers()
    return model


def profiled(fn, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from bench.common import kernel_breakdown

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    return kernel_breakdown(prof, wall)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def measure(fn, device, warmup, repeats):
    for _ in range(warmup):
        fn()
    times, stats = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        stats = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    # The slowest rank decides when the engine can start.
    return max_over_ranks(statistics.median(times), device), stats


def peak_extra_bytes(fn, device) -> int:
    if device.type != "cuda":
        return -1
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def check_slots(model, engine, tp_rank, tp):
    """The engine holds the bf16 TP shard of every parameter (spot check after timing)."""
    slots = engine.param_slots()
    for name, p in list(model.named_parameters())[:4] + list(model.named_parameters())[-3:]:
        full = p.full_tensor().to(slots[name].view.dtype)
        d = slots[name].shard_dim
        want = full if d is None or tp == 1 else full.chunk(tp, dim=d)[tp_rank]
        if not torch.equal(slots[name].view, want):
            raise AssertionError(f"engine slot {name} does not hold its TP shard after resharding")


def max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fsdp-size", type=int, default=-1)
    ap.add_argument("--num-layers", type=int, default=None, help="override the layer count (quick runs)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    ap.add_argument("--profile", action="store_true", help="add the device time by kernel class of one reshard")
    opts = ap.parse_args()

    if "RANK" not in os.environ:  # plain `python bench/reshard.py`: a one-process world
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if cuda:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dims = ParallelDims.from_env(fsdp_size=opts.fsdp_size, tp=opts.tp)
    meshes = dims.build_meshes(device.type)
    rank = dist.get_rank()

    for name in opts.models.split(","):
        overrides = {} if opts.num_layers is None else {"num_hidden_layers": opts.num_layers}
        args = model_args(name, **overrides)
        model = build_actor(args, meshes.train, device, seed=0)
        engine = LLMEngine(args, EngineConfig(dtype=torch.bfloat16, enforce_eager=True, max_num_seqs=8,
                                              max_num_batched_tokens=256, max_model_len=256, num_kv_blocks=16),
                           tp_mesh=meshes.tp, device=device)
        workload = {"model": name, "layers": args.num_hidden_layers, "world": dims.world_size, "tp": dims.tp,
                    "fsdp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate, "master_dtype": "fp32",
                    "engine_dtype": "bf16", "device": device.type}
        variants = [("zero_redundancy", Resharder(model, meshes, engine), "reshard")]
        if device.type == "cuda":
            # How the local cast-copies are launched: one kernel per tensor, or all through one
            # multi-tensor call (the default batches only tensors below FOREACH_MAX_NUMEL).
            variants += [("zero_redundancy_per_tensor_copies", Resharder(model, meshes, engine, foreach_max_numel=0),
                          "reshard"),
                         ("zero_redundancy_all_foreach", Resharder(model, meshes, engine, foreach_max_numel=None),
                          "reshard")]
            if dims.world_size > 1:
                # Gather bucket size: a layer per bucket, and buckets four times the default.
                variants += [("zero_redundancy_layer_buckets", Resharder(model, meshes, engine, bucket_bytes=0),
                              "reshard"),
                             ("zero_redundancy_256mb_buckets",
                              Resharder(model, meshes, engine, bucket_bytes=256 << 20), "reshard")]
        if not opts.no_naive:
            variants.append(("naive", variants[0][1], "reshard_naive"))
        results = {}
        for path, resharder, method in variants:
            fn = getattr(resharder, method)
            try:
                seconds, stats = measure(fn, device, opts.warmup, opts.repeats)
                check_slots(model, engine, dims.tp_rank(rank), dims.tp)
                peak = peak_extra_bytes(fn, device)
            except RuntimeError as e:  # report and go on with the other variants (every rank fails alike)
                if rank == 0:
                    emit("reshard", workload, path=path, error=f"{type(e).__name__}: {e}"[:500])
                continue
            gb = stats.param_bytes / 1e9
            ms = seconds * 1e3
            results[path] = ms
            figures = dict(path=path, param_bytes_bf16=stats.param_bytes, slot_bytes_per_rank=stats.slot_bytes,
                           bytes_received_per_rank=int(max_over_ranks(stats.bytes_received, device)),
                           zero_redundancy_bound=stats.bytes_bound,
                           naive_bytes=int(stats.param_bytes * (1 - 1 / dims.dp_shard)),
                           fallback_params=stats.num_fallback, all_to_all_params=stats.num_all_to_all,
                           collectives=stats.num_collectives,
                           ms=round(ms, 3), ms_per_gb=round(ms / gb, 3),
                           received_gb_per_s=round(stats.bytes_received / seconds / 1e9, 1), peak_extra_bytes=int(max_over_ranks(peak, device)),
                           bucket_buffer_bytes=stats.buffer_bytes)
            if opts.profile and device.type == "cuda":
                figures["profile"] = profiled(fn, device)
            if device.type == "cuda" and dims.world_size == 1:
                figures.update(floor_ms_per_gb=CAST_COPY_MS_PER_GB,
                               ratio_to_floor=round(ms / gb / CAST_COPY_MS_PER_GB, 2))
            if rank == 0:
                emit("reshard", workload, **figures)
        if rank == 0 and "naive" in results:
            emit("reshard", workload, path="summary", zero_redundancy_ms=round(results["zero_redundancy"], 3),
                 naive_ms=round(results["naive"], 3),
                 speedup_vs_naive=round(results["naive"] / results["zero_redundancy"], 2))
        del engine, model, variants
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
