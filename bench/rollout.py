"""Rollout throughput of the engine on the workloads of `bench/common.py`, with Hugging Face `generate` as the baseline.

    python bench/rollout.py                 # 0.5b and 1.5b at 256 and 512 prompts, batch-1 steps, HF at 256
    python bench/rollout.py --skip-hf       # engine only
    python bench/rollout.py --quick         # 0.5b at 256 only, no HF
    torchrun --nproc_per_node=2 bench/rollout.py --tp 2 --models qwen2.5-7b --batch1-models "" --skip-hf
                                            # one engine over 2 GPUs (tensor parallel, NCCL)

Workload: random weights, B prompts of 128 random tokens, 256 new tokens each, EOS ignored,
temperature 1.0 (no truncation). Prints one JSON object per measurement (rank 0), figures of
the median of `--repeats` runs:

* `generated_tok_per_s`: B x new tokens / wall time of `generate()` (prefill included).
* `decode_ms_per_step_gpu`: median GPU time of a full-batch decode step (CUDA events around
  the step: input upload, graph replay, output download); `decode_ms_per_step_wall`: wall
  time of the decode phase / decode steps (the host's share shows as the difference).
* `bandwidth_util`: bytes a decode step must read (the weights once, plus the K/V of the
  mean context) / GPU step time / 4.3 TB/s; `floor_ms` is the larger of that byte floor and
  the FLOP floor (2 x params x B / 790 TFLOP/s), `ratio_to_floor` = floor / measured.
* `peak_memory_gb`: torch's peak allocation during the run (weights + KV pool + activations);
  the pool is sized for the workload (`max_model_len` = prompt + new tokens).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S, emit, model_args  # noqa: E402
from rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def random_weights(engine: LLMEngine, seed: int = 0) -> None:
    """Normal(0, 0.02) weights, unit norms: never time on all-zero data."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    with torch.no_grad():
        for name, slot in engine.param_slots().items():
            if name.endswith("norm.weight"):
                slot.view.fill_(1.0)
            else:
                slot.view.normal_(0.0, 0.02, generator=g)


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def step_bytes(engine: LLMEngine, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read: every weight once + the K/V of every sequence's context."""
    m = engine.model
    elem = torch.empty((), dtype=m.dtype).element_size()
    kv_per_token = m.args.num_hidden_layers * 2 * m.num_kv_heads * m.head_dim * elem
    return m.weight_bytes + batch * mean_context * kv_per_token


def build_engine(name: str, max_seqs: int, max_len: int, args) -> LLMEngine:
    config = EngineConfig(dtype=torch.bfloat16, max_num_seqs=max_seqs, max_model_len=max_len,
                          gpu_memory_utilization=args.gpu_memory_utilization, free_cache_engine=False,
                          enforce_eager=args.enforce_eager)
    engine = LLMEngine(model_args(name), config, tp_mesh=args.tp_mesh, device=torch.device("cuda"))
    random_weights(engine)
    return engine


def measure_engine(engine: LLMEngine, name: str, batch: int, args) -> dict:
    p, new = args.prompt_len, args.new_tokens
    prompts = random_prompts(batch, p, engine.args.vocab_size, seed=batch)
    params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=1)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))  # compile + capture
    runs = []
    for rep in range(args.repeats):
        engine.runner.step_events = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        events = engine.runner.step_events
        engine.runner.step_events = None
        assert all(len(o.token_ids) == new for o in outs)
        decode = [s.elapsed_time(e) for pre, rows, s, e in events if not pre and rows == batch]
        prefill_s = sum(s.elapsed_time(e) for pre, _, s, e in events if pre) / 1e3
        runs.append(dict(wall=wall, decode_ms=statistics.median(decode), prefill_s=prefill_s,
                         decode_steps=engine.last_stats["decode_steps"], peak=torch.cuda.max_memory_allocated()))
    best = sorted(runs, key=lambda r: r["wall"])[(len(runs) - 1) // 2]  # the median run (lower middle)
    gpu_ms = best["decode_ms"]
    nbytes = step_bytes(engine, batch, p + new / 2)
    flops = engine.args.flops(batch, batch, batch * (p + new / 2))  # one decode step
    floor_ms = max(nbytes / H200_HBM_BYTES_PER_S, flops / H200_BF16_FLOPS) * 1e3
    return emit(
        "rollout", {"engine": "meshppo", "model": name, "prompts": batch, "prompt_len": p, "new_tokens": new,
                    "temperature": 1.0, "ignore_eos": True, "tp": args.tp, "cuda_graphs": not args.enforce_eager},
        generated_tok_per_s=round(batch * new / best["wall"], 1),
        wall_s=round(best["wall"], 4),
        walls_s=[round(r["wall"], 4) for r in runs],
        prefill_s_gpu=round(best["prefill_s"], 4),
        decode_ms_per_step_gpu=round(gpu_ms, 4),
        decode_ms_per_step_wall=round((best["wall"] - best["prefill_s"]) / best["decode_steps"] * 1e3, 4),
        decode_steps=best["decode_steps"],
        bytes_per_step_gb=round(nbytes / 1e9, 4),
        bandwidth_util=round(nbytes / (gpu_ms / 1e3) / H200_HBM_BYTES_PER_S, 4),
        floor_ms=round(floor_ms, 4),
        ratio_to_floor=round(floor_ms / gpu_ms, 4),
        peak_memory_gb=round(best["peak"] / 1e9, 3),
        kv_pool_gb=round(engine.runner.kv_cache.numel() * 2 / 1e9, 3),
    )


def measure_hf(name: str, batch: int, args) -> dict:
    from transformers import AutoModelForCausalLM

    margs = model_args(name)
    cfg = margs.to_hf_config(architecture="Qwen2ForCausalLM")
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    ids = torch.tensor(random_prompts(batch, args.prompt_len, margs.vocab_size, seed=batch), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    assert out.shape[1] == args.prompt_len + args.new_tokens
    rec = emit("rollout", {"engine": "hf_generate", "model": name, "prompts": batch, "prompt_len": args.prompt_len,
                           "new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "attn": "sdpa"},
               generated_tok_per_s=round(batch * args.new_tokens / wall, 1), wall_s=round(wall, 3),
               peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3))
    del model
    return rec


def profile_decode(name: str, batch: int, args, steps: int = 32) -> None:
    """Where a decode step's GPU time goes, kernel by kernel (torch.profiler on an eager engine).

    Profiles `generate` with 1 and with 1 + `steps` new tokens; the difference is `steps`
    decode steps without the prefill. Kernel durations are those of the graphed path; only
    the launch gaps that graphs remove are missing.
    """
    from torch.profiler import ProfilerActivity, profile

    eager = argparse.Namespace(**{**vars(args), "enforce_eager": True})
    engine = build_engine(name, batch, args.prompt_len + steps + 1, eager)
    prompts = random_prompts(batch, args.prompt_len, engine.args.vocab_size, seed=batch)

    def kernels(max_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts, params)  # compile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                out[e.key] = (t, e.count)
        return out

    base, full = kernels(1), kernels(1 + steps)
    rows = []
    for key, (t, n) in full.items():
        t0, n0 = base.get(key, (0, 0))
        if n > n0:
            rows.append(((t - t0) / steps / 1e3, (n - n0) / steps, key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\nprofile {name} batch {batch}: {total:.3f} ms of kernels per decode step (eager engine)")
    print("| ms/step | launches/step | kernel |\n| --- | --- | --- |")
    for ms, n, key in rows[:16]:
        print(f"| {ms:.4f} | {n:g} | {key[:80]} |")


def _release():
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--batch1-models", default="qwen2.5-0.5b,qwen2.5-7b",
                    help="models whose batch-1 decode step is measured (bandwidth target)")
    ap.add_argument("--hf-batches", default="256", help="batches run through HF generate")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="qwen2.5-0.5b at 256 prompts only, no HF")
    ap.add_argument("--profile", default="", help="MODEL:BATCH[,MODEL:BATCH]: print a decode kernel profile")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: run under torchrun with this many ranks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/rollout.py needs a CUDA GPU", file=sys.stderr)
        return 1
    args.tp_mesh = None
    if args.tp > 1:
        import os

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if int(os.environ.get("WORLD_SIZE", "1")) != args.tp:
            print(f"--tp {args.tp}: run under torchrun --nproc_per_node={args.tp}", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        args.tp_mesh = init_device_mesh("cuda", (args.tp,), mesh_dim_names=("tp",))["tp"]
        args.skip_hf = True
        if dist.get_rank() != 0:  # every rank measures the same engine: rank 0 reports
            sys.stdout = open(os.devnull, "w")
    if args.quick:
        args.models, args.batches, args.batch1_models, args.skip_hf = "qwen2.5-0.5b", "256", "", True
    batches = [int(b) for b in args.batches.split(",") if b]
    records = []
    max_len = args.prompt_len + args.new_tokens
    for name in [m for m in args.models.split(",") if m]:
        engine = build_engine(name, max(batches), max_len, args)
        for b in batches:
            records.append(measure_engine(engine, name, b, args))
        del engine
        _release()
    for name in [m for m in args.batch1_models.split(",") if m]:
        engine = build_engine(name, 1, max_len, args)
        records.append(measure_engine(engine, name, 1, args))
        del engine
        _release()
    for spec in [x for x in args.profile.split(",") if x]:
        name, b = spec.split(":")
        profile_decode(name, int(b), args)
        _release()
    if not args.skip_hf:
        for name in [m for m in args.models.split(",") if m]:
            for b in [int(x) for x in args.hf_batches.split(",") if x]:
                records.append(measure_hf(name, b, args))
                _release()

    print("\n| engine | model | prompts | tok/s | ms/step gpu | ms/step wall | bw util | floor ratio | peak GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        w = r["workload"]
        print(f"| {w['engine']} | {w['model']} | {w['prompts']} | {r['generated_tok_per_s']:,.0f} | "
              f"{r.get('decode_ms_per_step_gpu', '-')} | {r.get('decode_ms_per_step_wall', '-')} | "
              f"{r.get('bandwidth_util', '-')} | {r.get('ratio_to_floor', '-')} | {r['peak_memory_gb']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
