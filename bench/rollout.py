"""Rollout throughput of the engine on the workloads of `bench/common.py`, with Hugging Face `generate` as the baseline.

    python bench/rollout.py                 # 0.5b and 1.5b at 256 and 512 prompts, batch-1 steps, HF at 256
    python bench/rollout.py --skip-hf       # engine only
    python bench/rollout.py --quick         # 0.5b at 256 only, no HF
    python bench/rollout.py --models qwen2.5-0.5b --batches "" --batch1-models "" --skip-hf --eos-models qwen2.5-0.5b
                                            # the EOS workload only (variable lengths, continuous batching)
    python bench/rollout.py --models "" --batch1-models "" --skip-hf --turns-models qwen2.5-0.5b
                                            # the multi-turn workload only (K/V kept between turns or not)
    torchrun --nproc_per_node=2 bench/rollout.py --tp 2 --models qwen2.5-7b --batch1-models "" --skip-hf
                                            # one engine over 2 GPUs (tensor parallel, NCCL)

At TP 1 each engine (a model at all its `--batches`, a batch-1 model, an EOS model), each
`--profile` and each HF model at one batch runs in a fresh process of its own, and the tables at
the end gather their records (`--in-process`: all in this one). A decode step measured in a
second engine of a process ran 6-7 % slower on some H200s (BENCHMARKS.md, "Twenty-second pass").

Fixed workload: random weights, B prompts of 128 random tokens, 256 new tokens each, EOS
ignored, temperature 1.0 (no truncation). Prints one JSON object per measurement (rank 0);
figures are those of the median run of `--repeats` (odd, default 3; the run of median wall
time, so the figures of one record come from one run):

* `generated_tok_per_s`: B x new tokens / wall time of `generate()` (prefill included).
* `decode_ms_per_step_gpu`: median GPU time of a full-batch decode step (CUDA events around
  the step: input upload, graph replay, output download); `decode_ms_per_step_wall`: wall
  time of the decode phase / decode steps (the host's share shows as the difference).
* `bytes_per_step_gb`: what a decode step really reads: every weight once, except the input
  embedding table, of which only the B looked-up rows are read (tied embeddings: the table
  is read whole as the LM head), plus the K/V of every sequence's context (the mean context
  of the run). `bandwidth_util` = those bytes / GPU step time / 4.3 TB/s; `floor_ms` is the
  larger of that byte floor and the FLOP floor (2 x params x B / 790 TFLOP/s),
  `ratio_to_floor` = floor / measured. `logits_gb`: the logits a step writes and the sampler
  reads back (not in the byte count: a head fused with the sampler would not move them).
* `decode_ms_first`, `decode_ms_last`: the median GPU time of the first and of the last 8
  full-batch decode steps, and `decode_us_per_context_token` the slope of step time over the
  run (each step's context is one token longer): what attention over a longer context costs.
* `peak_memory_gb`: torch's peak allocation during the run (weights + KV pool + activations);
  the pool is sized for the workload (`max_model_len` = prompt + new tokens).
* `gpu_clock_mhz`, `gpu_power_w`: the SM clock and board power over the measured runs (medians of
  `nvidia-smi` samples, `bench.common.GpuTelemetry`; null without it), with `gpu_max_clock_mhz`,
  `gpu_power_limit_w` and `gpu_power_capped_share` (samples at >= 95 % of the limit). An H200
  at its power limit lowers its clock, and every time above with it.
* `--quantization fp8` (workload `quantization`): the engine's qkv, gate/up and down projections as
  e4m3 GEMMs; the byte count reads them at one byte, and `quantize_s` is what quantizing them took
  in the warm-up generate (the first after the weights were written).
* `--kv-cache-dtype fp8` (workload `kv_cache_dtype`): the KV cache as e4m3 values with a float32 scale
  per token and KV head; the byte count reads the cache at that size (values and scales).

Multi-turn workload (`--turns-models`): `--turns-prompts` (256) samples of 128-token prompts,
`--turns` (4) model turns each of `--turn-tokens` (64) tokens (`--turn-lengths fixed`) or of a
long tail of that mean (`exponential`: 1 + an exponential draw, capped at 4x; EOS ignored, the
lengths set by each request's `max_tokens`), `--tool-tokens` (64) random tokens appended to every
sample between turns (a tool's answer). Four variants, alternating, median of `--repeats`:
`joined` (one call; each sample's next turn joins it as soon as its turn ended, from its kept
K/V: `generate(on_finish=...)`, as `agent.loop` runs), `kept` and `recomputed` (one call per turn
over every sample, the lockstep loop, with the K/V kept between turns or the context prefilled
again), and `one_call` (one call generating as many tokens per sample, without the tool answers:
the floor). Reported per variant: generated tok/s (model tokens / wall), the tokens prefilled and
the prefill steps' GPU time; `joined_mean_decode_batch`; `joined_speedup` = kept wall / joined
wall, `kept_speedup` = recomputed wall / kept wall.

EOS workload (`--eos-models`): `--eos-prompts` (1024) prompts of 128 tokens through an engine
of `--eos-max-seqs` (256) slots, up to `--eos-max-tokens` (1024) new tokens, temperature 1.0,
EOS honoured. Random weights never pick a particular token, so EOS is made likely on purpose:
M = V / `--eos-mean` token ids, spread evenly over the vocabulary, are all EOS ids
(`SamplingParams.eos_token_id` as a list, verl's multi-EOS form). With random weights the
next-token distribution is broad and, on average, the same for every id, so a sample ends at
each step with probability about 1 / eos_mean: geometric lengths (mean about eos_mean, the
mode at 1, a long tail up to the cap), deterministic for a seed. Reported: generated tok/s
(tokens actually generated / wall), the length distribution (p50 / p90 / p99 / max, the
fraction cut at the cap), and how continuous batching keeps the batch full: the mean running
batch over the steps that decode (decode steps, and prefill steps that the decoding
sequences ride along with: `prefill_steps_decoding`), `occupancy` = that mean / slots, the
fraction of those steps at full batch, and prefill steps (slots refilled); where the wall
time went: `prefill_s_gpu` and `decode_s_gpu` (CUDA events around each step, as above) and
`gpu_idle_s`, the rest of the wall, when the GPU waited for the host. Then, as between PPO phases,
the engine frees its KV pool, then its weights, then its graphs (`freed_*_gb`: what each gave
back, allocated and reserved; `left_allocated_gb`: what the engine still holds), refills
its weights and runs once more: `graph_capture_s_after_free` is what a step pays to recapture
the graphs of every batch size it visits (`graph_capture_s_first` includes the eager warm-up
of the first capture; the trainer's `free_engine_weights` keeps the graphs). `--capture-sizes` with fewer sizes trades padding for capture time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S, GpuTelemetry, emit, model_args  # noqa: E402
from models.checkpoint import hf_architecture  # noqa: E402
from rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from rollout.config import KV_CACHE_DTYPES, QUANTIZATIONS  # noqa: E402


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


def step_bytes(engine: LLMEngine, batch: int, mean_context: float) -> tuple[float, float]:
    """(bytes one decode step reads, bytes of its logits); see the module docstring."""
    m = engine.model
    elem = torch.empty((), dtype=m.dtype).element_size()
    table = m.vocab_local * m.hidden * elem
    rows = min(batch, m.vocab_local) * m.hidden * elem
    weights = m.weight_bytes - (0 if m.args.tie_word_embeddings else table) + rows
    weights -= m.fp8_weight_bytes * (elem - 1)  # fp8: the quantized projections are read as e4m3, one byte each
    kv_per_token = engine.runner.kv_bytes_per_block() / engine.runner.block_size  # e4m3 cache: values and scales
    return weights + batch * mean_context * kv_per_token, 2.0 * batch * m.vocab_local * elem


def step_seconds(events) -> tuple[float, float]:
    """GPU seconds in the prefill steps and in the decode steps of `runner.step_events`."""
    prefill = sum(s.elapsed_time(e) for pre, _, s, e in events if pre) / 1e3
    decode = sum(s.elapsed_time(e) for pre, _, s, e in events if not pre) / 1e3
    return prefill, decode


def step_trend(step_ms: list[float], edge: int = 8) -> dict:
    """How a run's decode steps (in order; the context grows by one token a step) change over it:
    the medians of the first and the last `edge` steps, and the least-squares slope of step time
    against step index, in µs per token of context (what each step's longer context costs)."""
    n = len(step_ms)
    if n < 2:
        return {"decode_ms_first": None, "decode_ms_last": None, "decode_us_per_context_token": None}
    slope = statistics.linear_regression(range(n), step_ms).slope
    k = min(edge, n)
    return {"decode_ms_first": round(statistics.median(step_ms[:k]), 4),
            "decode_ms_last": round(statistics.median(step_ms[-k:]), 4),
            "decode_us_per_context_token": round(slope * 1e3, 4)}


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (`--repeats` is odd, so there is one)."""
    if len(runs) % 2 == 0:
        raise ValueError(f"median_run needs an odd number of runs, got {len(runs)}")
    return sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]


def engine_config(max_seqs: int, max_len: int, args) -> EngineConfig:
    """The benchmarked engine's config: the command line's engine options, the engine's defaults otherwise."""
    return EngineConfig(dtype=torch.bfloat16, max_num_seqs=max_seqs, max_model_len=max_len,
                        gpu_memory_utilization=args.gpu_memory_utilization, free_cache_engine=False,
                        enforce_eager=args.enforce_eager, tp_all_reduce=args.tp_all_reduce,
                        cudagraph_capture_sizes=args.capture_sizes, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype,
                        **({} if args.max_num_batched_tokens is None
                           else {"max_num_batched_tokens": args.max_num_batched_tokens}),
                        **({} if args.prefill_graph_max_tokens is None
                           else {"prefill_graph_max_tokens": args.prefill_graph_max_tokens}))


def build_engine(name: str, max_seqs: int, max_len: int, args) -> LLMEngine:
    config = engine_config(max_seqs, max_len, args)
    engine = LLMEngine(model_args(name), config, tp_mesh=args.tp_mesh, device=torch.device("cuda"))
    random_weights(engine)
    return engine


def measure_engine(engine: LLMEngine, name: str, batch: int, args) -> dict:
    p, new = args.prompt_len, args.new_tokens
    prompts = random_prompts(batch, p, engine.args.vocab_size, seed=batch)
    params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=1)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))  # compile + capture
    quantize_s = engine.last_stats["quantize_s"]  # fp8: the first generate after the weights were written
    runs = []
    for rep in range(args.repeats):
        engine.runner.step_events = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with args.telemetry.window():
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = engine.runner.step_events
        engine.runner.step_events = None
        assert all(len(o.token_ids) == new for o in outs)
        decode = [s.elapsed_time(e) for pre, rows, s, e in events if not pre and rows == batch]
        runs.append(dict(wall=wall, decode_ms=statistics.median(decode), prefill_s=step_seconds(events)[0],
                         decode_steps=engine.last_stats["decode_steps"],
                         prefill_steps=engine.last_stats["prefill_steps"], peak=torch.cuda.max_memory_allocated(),
                         trend=step_trend(decode)))
    run = median_run(runs)
    gpu_ms = run["decode_ms"]
    nbytes, logits_bytes = step_bytes(engine, batch, p + new / 2)
    # one decode step of this rank: the byte count above is the rank's, and TP splits the matmuls
    flops = engine.args.flops(batch, batch, batch * (p + new / 2)) / args.tp
    floor_ms = max(nbytes / H200_HBM_BYTES_PER_S, flops / H200_BF16_FLOPS) * 1e3
    return emit(
        "rollout", {"engine": "meshppo", "model": name, "prompts": batch, "prompt_len": p, "new_tokens": new,
                    "temperature": 1.0, "ignore_eos": True, "tp": args.tp, "cuda_graphs": not args.enforce_eager,
                    "prefill_graph_tokens": engine.runner.prefill_graph_tokens,
                    "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                    "quantization": engine.config.quantization, "kv_cache_dtype": engine.config.kv_cache_dtype,
                    "tp_all_reduce": engine.tp_all_reduce,
                    # the engine serves every --batches size: its KV pool (peak_memory_gb) is sized for this many
                    "max_num_seqs": engine.config.max_num_seqs},
        generated_tok_per_s=round(batch * new / run["wall"], 1),
        wall_s=round(run["wall"], 4),
        walls_s=[round(r["wall"], 4) for r in runs],
        prefill_s_gpu=round(run["prefill_s"], 4),
        decode_ms_per_step_gpu=round(gpu_ms, 4),
        decode_ms_per_step_wall=round((run["wall"] - run["prefill_s"]) / run["decode_steps"] * 1e3, 4),
        decode_steps=run["decode_steps"],
        prefill_steps=run["prefill_steps"],
        bytes_per_step_gb=round(nbytes / 1e9, 4),
        logits_gb=round(logits_bytes / 1e9, 4),
        bandwidth_util=round(nbytes / (gpu_ms / 1e3) / H200_HBM_BYTES_PER_S, 4),
        floor_ms=round(floor_ms, 4),
        ratio_to_floor=round(floor_ms / gpu_ms, 4),
        peak_memory_gb=round(run["peak"] / 1e9, 3),
        kv_pool_gb=round(sum(t.nbytes for t in (engine.runner.kv_cache, engine.runner.kv_scales) if t is not None)
                         / 1e9, 3),
        quantize_s=round(quantize_s, 4),
        **run["trend"],
        **args.telemetry.take(),
    )


def eos_ids(vocab_size: int, mean_len: int) -> list[int]:
    """vocab_size / mean_len ids spread evenly over the vocabulary (the EOS workload's stop set)."""
    m = max(1, round(vocab_size / mean_len))
    return [i * vocab_size // m for i in range(m)]


def measure_eos(name: str, args) -> dict:
    """The EOS workload (module docstring): variable lengths, more prompts than slots."""
    p, cap, slots = args.prompt_len, args.eos_max_tokens, args.eos_max_seqs
    engine = build_engine(name, slots, p + cap, args)
    prompts = random_prompts(args.eos_prompts, p, engine.args.vocab_size, seed=7)
    params = SamplingParams(temperature=1.0, max_tokens=cap, eos_token_id=eos_ids(engine.args.vocab_size,
                                                                                   args.eos_mean), seed=1)
    engine.generate(prompts, params)  # warm-up: compiles and captures every batch size the run visits
    first_capture = engine.last_stats
    runs = []
    for rep in range(args.repeats):
        engine.runner.step_events = []
        torch.cuda.synchronize()
        with args.telemetry.window():
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        gpu = step_seconds(engine.runner.step_events)
        engine.runner.step_events = None
        runs.append(dict(wall=wall, lens=sorted(len(o.token_ids) for o in outs), stats=engine.last_stats,
                         capped=sum(o.finish_reason == "length" for o in outs), gpu=gpu))
    run = median_run(runs)
    lens, st = run["lens"], run["stats"]
    rows = st["decode_batch_sizes"]

    def q(f):
        return lens[min(len(lens) - 1, int(f * len(lens)))]

    mean_rows = sum(rows) / len(rows)
    # Between PPO phases (free_cache_engine): what releasing gives back, and what the next
    # generate() pays to recapture its graphs.
    def memory():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    alloc0, res0 = memory()
    engine.free_cache()
    alloc1, res1 = memory()
    engine.free_weights()
    alloc2, res2 = memory()
    engine.free_graphs()  # free_weights() keeps them (replayed if the weights come back in place)
    alloc3, res3 = memory()
    random_weights(engine)  # through param_slots(), which re-allocates, as the resharder's call does
    engine.generate(prompts, params)
    again = engine.last_stats
    rec = emit(
        "rollout_eos", {"engine": "meshppo", "model": name, "prompts": args.eos_prompts, "max_num_seqs": slots,
                        "prompt_len": p, "max_tokens": cap, "eos_ids": len(params.eos_token_id),
                        "expected_mean_len": args.eos_mean, "temperature": 1.0, "tp": args.tp,
                        "cuda_graphs": not args.enforce_eager, "capture_sizes": engine.runner.capture_sizes,
                        "prefill_graph_tokens": engine.runner.prefill_graph_tokens,
                        "quantization": engine.config.quantization,
                        "kv_cache_dtype": engine.config.kv_cache_dtype, "tp_all_reduce": engine.tp_all_reduce},
        generated_tok_per_s=round(sum(lens) / run["wall"], 1),
        wall_s=round(run["wall"], 4),
        walls_s=[round(r["wall"], 4) for r in runs],
        generated_tokens=sum(lens),
        len_mean=round(sum(lens) / len(lens), 1), len_p50=q(0.5), len_p90=q(0.9), len_p99=q(0.99), len_max=lens[-1],
        frac_capped=round(run["capped"] / len(lens), 4),
        decode_steps=st["decode_steps"], prefill_steps=st["prefill_steps"],
        prefill_steps_decoding=st["prefill_steps_decoding"],
        prefill_s_gpu=round(run["gpu"][0], 4), decode_s_gpu=round(run["gpu"][1], 4),
        gpu_idle_s=round(run["wall"] - sum(run["gpu"]), 4),
        mean_decode_batch=round(mean_rows, 2),
        occupancy=round(mean_rows / slots, 4),
        frac_steps_full=round(sum(r == slots for r in rows) / len(rows), 4),
        graphs_captured=first_capture["graphs_captured"],
        graph_capture_s_first=round(first_capture["graph_capture_s"], 4),
        graph_capture_s_after_free=round(again["graph_capture_s"], 4),
        wall_s_after_free=round(again["wall_s"], 4),
        freed_kv_allocated_gb=round((alloc0 - alloc1) / 1e9, 3),
        freed_kv_reserved_gb=round((res0 - res1) / 1e9, 3),
        freed_weights_allocated_gb=round((alloc1 - alloc2) / 1e9, 3),
        freed_weights_reserved_gb=round((res1 - res2) / 1e9, 3),
        freed_graphs_allocated_gb=round((alloc2 - alloc3) / 1e9, 3),
        freed_graphs_reserved_gb=round((res2 - res3) / 1e9, 3),
        weights_gb=round(engine.model.weight_bytes / 1e9, 3),
        left_allocated_gb=round(alloc3 / 1e9, 3),
        **args.telemetry.take(),
    )
    del engine
    return rec


def turn_lengths(b: int, k: int, mean: int, kind: str, seed: int = 13) -> list[list[int]]:
    """New tokens of each turn j of each sample i, `[j][i]`: `mean` each (`fixed`), or drawn from
    1 + an exponential of mean `mean` - 1, capped at 4 `mean` (`exponential`: a long tail, as
    turns that end at EOS have)."""
    if kind == "fixed":
        return [[mean] * b for _ in range(k)]
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(k, b).exponential_(1.0 / max(mean - 1, 1e-9), generator=g) if mean > 1 else torch.zeros(k, b)
    return (1 + draws.floor()).clamp(max=4 * mean).long().tolist()


def measure_turns(name: str, args) -> dict:
    """The multi-turn workload (module docstring): `--turns` turns for each of `--turns-prompts`
    samples, of `--turn-tokens` tokens (`--turn-lengths`), `--tool-tokens` random tokens appended
    between turns (a tool's answer). Variants: `joined`, every turn in one call, each sample's
    next turn joining as soon as its turn ended (`generate(on_finish=...)` with its K/V kept, as
    `agent.loop` runs); `kept` and `recomputed`, one call per turn over every sample (the lockstep
    loop), the K/V kept between turns or recomputed; and, as the floor, one call that generates as
    many tokens per sample without the tool answers."""
    from rollout import Continuation

    p, b, k, t, u = args.prompt_len, args.turns_prompts, args.turns, args.turn_tokens, args.tool_tokens
    lens = turn_lengths(b, k, t, args.turn_lengths)
    engine = build_engine(name, b, p + k * u + sum(max(row) for row in lens), args)
    vocab = engine.args.vocab_size
    prompts = random_prompts(b, p, vocab, seed=11)
    g = torch.Generator().manual_seed(12)
    answers = [[torch.randint(0, vocab, (u,), generator=g).tolist() for _ in range(b)] for _ in range(k - 1)]
    keys = [(i, 0) for i in range(b)]
    turn = SamplingParams(temperature=1.0, max_tokens=t, ignore_eos=True, seed=1)

    def turns(keep: bool) -> dict:
        contexts, prefilled, prefill_s = [list(q) for q in prompts], 0, 0.0
        for j in range(k):
            engine.runner.step_events = []
            outs = engine.generate(contexts, turn, sample_keys=keys, max_tokens=lens[j], keep_kv=keep)
            prefill_s += step_seconds(engine.runner.step_events)[0]
            prefilled += sum(map(len, contexts)) - engine.last_stats["reused_kv_tokens"]
            contexts = [c + o.token_ids + (answers[j][i] if j < k - 1 else []) for i, (c, o) in
                        enumerate(zip(contexts, outs))]
        engine.drop_kept()
        return dict(prefilled=prefilled, prefill_s=prefill_s, mean_decode_batch=None)

    def joined() -> dict:
        done = [0] * b  # turns each sample has ended
        contexts = sum(map(len, prompts))

        def on_finish(outs, idle):
            nonlocal contexts
            more = []
            for o in outs:
                i, j = o.prompt_index, done[o.prompt_index]
                done[i] = j + 1
                if j + 1 < k:
                    more.append(Continuation(o.prompt_token_ids + o.token_ids + answers[j][i], (i, 0), lens[j + 1][i]))
                    contexts += len(more[-1].token_ids)
            return more

        engine.runner.step_events = []
        engine.generate(prompts, turn, sample_keys=keys, max_tokens=lens[0], keep_kv=True, on_finish=on_finish)
        engine.drop_kept()
        sizes = engine.last_stats["decode_batch_sizes"]
        return dict(prefilled=contexts - engine.last_stats["reused_kv_tokens"],
                    prefill_s=step_seconds(engine.runner.step_events)[0],
                    mean_decode_batch=round(statistics.fmean(sizes), 1) if sizes else None)

    def one_call() -> dict:
        engine.runner.step_events = []
        engine.generate(prompts, turn, sample_keys=keys, max_tokens=[sum(col) for col in zip(*lens)])
        return dict(prefilled=b * p, prefill_s=step_seconds(engine.runner.step_events)[0], mean_decode_batch=None)

    variants = {"joined": joined, "kept": lambda: turns(True), "recomputed": lambda: turns(False),
                "one_call": one_call}
    for run in variants.values():  # warm-up: compile and capture what every variant visits
        run()
    runs = {v: [] for v in variants}
    with args.telemetry.window():
        for rep in range(args.repeats):
            for v, run in variants.items():  # alternating, so that clock drift touches each alike
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                runs[v].append(dict(out, wall=time.perf_counter() - t0))
        engine.runner.step_events = None
    med = {v: median_run(r) for v, r in runs.items()}
    generated = sum(map(sum, lens))
    rec = emit(
        "rollout_turns", {"engine": "meshppo", "model": name, "prompts": b, "prompt_len": p, "turns": k,
                          "turn_tokens": t, "turn_lengths": args.turn_lengths, "tool_tokens": u, "temperature": 1.0,
                          "ignore_eos": True, "tp": args.tp, "cuda_graphs": not args.enforce_eager},
        generated_tokens=generated,
        **{f"{v}_tok_per_s": round(generated / m["wall"], 1) for v, m in med.items()},
        **{f"{v}_wall_s": round(m["wall"], 4) for v, m in med.items()},
        **{f"{v}_walls_s": [round(r["wall"], 4) for r in runs[v]] for v in variants},
        **{f"{v}_prefill_s_gpu": round(m["prefill_s"], 4) for v, m in med.items()},
        **{f"{v}_prefilled_tokens": m["prefilled"] for v, m in med.items()},
        joined_mean_decode_batch=med["joined"]["mean_decode_batch"],
        kept_speedup=round(med["recomputed"]["wall"] / med["kept"]["wall"], 4),
        joined_speedup=round(med["kept"]["wall"] / med["joined"]["wall"], 4),
        **args.telemetry.take(),
    )
    return rec  # the engine goes with this frame and its closures (`_release` then empties the cache)


def measure_hf(name: str, batch: int, args) -> dict:
    from transformers import AutoModelForCausalLM

    margs = model_args(name)
    cfg = margs.to_hf_config(architecture=hf_architecture(margs.model_type))
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    ids = torch.tensor(random_prompts(batch, args.prompt_len, margs.vocab_size, seed=batch), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    walls = []
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, **kw)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            assert out.shape[1] == args.prompt_len + args.new_tokens
    wall = statistics.median(walls)
    rec = emit("rollout", {"engine": "hf_generate", "model": name, "prompts": batch, "prompt_len": args.prompt_len,
                           "new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "attn": "sdpa"},
               generated_tok_per_s=round(batch * args.new_tokens / wall, 1), wall_s=round(wall, 3),
               walls_s=[round(w, 3) for w in walls], peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3))
    del model
    return rec


def profile_decode(name: str, batch: int, args, steps: int = 32) -> None:
    """Where a decode step's GPU time goes, kernel by kernel (torch.profiler on an eager engine).

    Profiles `generate` with 1 and with 1 + `steps` new tokens; the difference is `steps`
    decode steps without the prefill. Kernel durations are those of the graphed path; only
    the launch gaps that graphs remove are missing. Programmatic dependent launch is off here
    (`MESHPPO_PDL=off`): under it a kernel may start early and its duration would include its
    wait for the previous one.
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

    with mock.patch.dict(os.environ, {"MESHPPO_PDL": "off"}):
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--batch1-models", default="qwen2.5-0.5b,qwen2.5-7b",
                    help="models whose batch-1 decode step is measured (bandwidth target)")
    ap.add_argument("--hf-batches", default="256", help="batches run through HF generate")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (odd: figures of the median run)")
    ap.add_argument("--eos-models", default="", help="models run through the EOS workload")
    ap.add_argument("--eos-prompts", type=int, default=1024)
    ap.add_argument("--eos-max-seqs", type=int, default=256)
    ap.add_argument("--eos-max-tokens", type=int, default=1024)
    ap.add_argument("--eos-mean", type=int, default=256, help="V / this many ids end a sample (mean length)")
    ap.add_argument("--turns-models", default="", help="models run through the multi-turn workload")
    ap.add_argument("--turns-prompts", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4, help="model turns per sample (multi-turn workload)")
    ap.add_argument("--turn-lengths", default="fixed", choices=("fixed", "exponential"),
                    help="tokens a model turn generates: --turn-tokens each, or a long tail of that mean")
    ap.add_argument("--turn-tokens", type=int, default=64, help="tokens a model turn generates")
    ap.add_argument("--tool-tokens", type=int, default=64, help="tokens appended between turns (a tool's answer)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--capture-sizes", default="",
                    help="CUDA-graph batch sizes, e.g. 1,2,4,8,16,32,64,128,256 (default: the engine's ladder)")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="EngineConfig.prefill_graph_max_tokens (default: the engine's; 0: prefill always eager)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="EngineConfig.max_num_batched_tokens: the most tokens a step schedules (default: the engine's)")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="EngineConfig.quantization (default: none, every GEMM in bf16)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="EngineConfig.kv_cache_dtype (default auto: the cache in bf16)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="qwen2.5-0.5b at 256 prompts only, no HF")
    ap.add_argument("--profile", default="", help="MODEL:BATCH[,MODEL:BATCH]: print a decode kernel profile")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: run under torchrun with this many ranks")
    ap.add_argument("--tp-all-reduce", default="auto", choices=("auto", "nccl", "symm_mem"),
                    help="TP > 1: the engine's all-reduce (EngineConfig.tp_all_reduce)")
    ap.add_argument("--in-process", action="store_true",
                    help="measure everything in this process; by default (at TP 1) each engine, HF model and "
                         "profile runs in a fresh process of its own")
    ap.add_argument("--no-tables", action="store_true", help=argparse.SUPPRESS)  # a child: the parent tabulates
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.eos_prompts, args.eos_max_seqs, args.eos_max_tokens, args.eos_mean,
                               args.turns_prompts, args.turns, args.turn_tokens, args.tool_tokens) < 1:
        ap.error("--repeats, the --eos-* and the --turn* / --tool-tokens sizes must be >= 1")
    if args.repeats % 2 == 0:
        ap.error(f"--repeats {args.repeats}: give an odd count (the figures are the median run's)")
    if not torch.cuda.is_available():
        print("bench/rollout.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.tp == 1 and not args.in_process:
        return run_isolated(ap, args)
    args.capture_sizes = [int(x) for x in args.capture_sizes.split(",") if x] or None
    args.tp_mesh = None
    if args.tp > 1:
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
    with GpuTelemetry(torch.cuda.current_device()) as args.telemetry:
        return run(args)


def run(args) -> int:
    """The measurements `args` ask for, then their tables."""
    apply_quick(args)
    batches = [int(b) for b in args.batches.split(",") if b]
    records = []
    max_len = args.prompt_len + args.new_tokens
    for name in [m for m in args.models.split(",") if m and batches]:
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
    eos_records = []
    for name in [m for m in args.eos_models.split(",") if m]:
        eos_records.append(measure_eos(name, args))
        _release()
    for name in [m for m in args.turns_models.split(",") if m]:
        records.append(measure_turns(name, args))
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
    if not args.no_tables:
        print_tables(records, eos_records)
    return 0


def apply_quick(args) -> None:
    if args.quick:
        args.models, args.batches, args.batch1_models, args.skip_hf = "qwen2.5-0.5b", "256", "", True


# The options that choose what is measured; every other option is passed on to each child as given.
SELECTION = dict(models="", batches="", batch1_models="", eos_models="", turns_models="", profile="", skip_hf=True,
                 hf_batches="")


def isolated_jobs(args) -> list[dict]:
    """What `run()` measures, in its order, one entry per fresh process: the selection options of
    each child (a model at all `--batches`, a batch-1 model, an EOS model, a profile, an HF model
    at one batch)."""
    apply_quick(args)
    jobs = [dict(SELECTION, models=m, batches=args.batches) for m in args.models.split(",") if m and args.batches]
    jobs += [dict(SELECTION, batch1_models=m) for m in args.batch1_models.split(",") if m]
    jobs += [dict(SELECTION, eos_models=m) for m in args.eos_models.split(",") if m]
    jobs += [dict(SELECTION, turns_models=m) for m in args.turns_models.split(",") if m]
    jobs += [dict(SELECTION, profile=spec) for spec in args.profile.split(",") if spec]
    if not args.skip_hf:
        jobs += [dict(SELECTION, models=m, skip_hf=False, hf_batches=b)
                 for m in args.models.split(",") if m for b in args.hf_batches.split(",") if b]
    return jobs


def child_argv(ap: argparse.ArgumentParser, args, job: dict) -> list[str]:
    """This script's command line for one job: the job's selection, every other option as given."""
    argv = ["--in-process", "--no-tables"]
    for action in ap._actions:
        if not action.option_strings or action.dest in ("help", "in_process", "no_tables", "quick"):
            continue
        value = job.get(action.dest, getattr(args, action.dest))
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv.append(f"{action.option_strings[0]}={value}")
    return argv


def run_isolated(ap: argparse.ArgumentParser, args, launch=None) -> int:
    """Each job of `isolated_jobs` in a fresh process, its output passed through; then the tables
    of all their records. A decode step measured in a second engine of a process ran 6-7 % slower
    on some H200s (BENCHMARKS.md, "Twenty-second pass"), so no measurement shares a process.
    `launch(argv)` returns the child's output lines and a function that waits for its exit status
    (a test's stand-in)."""
    launch = launch or _launch
    records, eos_records, failed = [], [], []
    for job in isolated_jobs(args):
        argv = child_argv(ap, args, job)
        lines, wait = launch(argv)
        for line in lines:
            print(line, end="", flush=True)
            if line.startswith('{"benchmark"'):
                rec = json.loads(line)
                (eos_records if rec["benchmark"] == "rollout_eos" else records).append(rec)
        code = wait()
        if code != 0:
            failed.append(f"{' '.join(argv)} (exit {code})")
    print_tables(records, eos_records)
    for f in failed:
        print(f"bench/rollout.py: a measurement failed: {f}", file=sys.stderr)
    return 1 if failed else 0


def _launch(argv: list[str]):
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE, text=True)
    return proc.stdout, proc.wait


def print_tables(records: list[dict], eos_records: list[dict]) -> None:
    turns = [r for r in records if r["benchmark"] == "rollout_turns"]
    records = [r for r in records if r["benchmark"] != "rollout_turns"]
    print("\n| engine | model | prompts | tok/s | ms/step gpu | ms/step wall | bw util | floor ratio | peak GB | "
          "SM MHz / W |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        w = r["workload"]
        print(f"| {w['engine']} | {w['model']} | {w['prompts']} | {r['generated_tok_per_s']:,.0f} | "
              f"{r.get('decode_ms_per_step_gpu', '-')} | {r.get('decode_ms_per_step_wall', '-')} | "
              f"{r.get('bandwidth_util', '-')} | {r.get('ratio_to_floor', '-')} | {r['peak_memory_gb']} | "
              f"{r.get('gpu_clock_mhz', '-')} / {r.get('gpu_power_w', '-')} |")
    if eos_records:
        print("\n| model | prompts / slots | tok/s | len p50 / p90 / p99 / max | mean batch | occupancy | "
              "full steps | GPU s: prefill / decode / idle | capture s (first / after free) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in eos_records:
            w = r["workload"]
            print(f"| {w['model']} | {w['prompts']} / {w['max_num_seqs']} | {r['generated_tok_per_s']:,.0f} | "
                  f"{r['len_p50']} / {r['len_p90']} / {r['len_p99']} / {r['len_max']} | {r['mean_decode_batch']} | "
                  f"{r['occupancy']} | {r['frac_steps_full']} | {r['prefill_s_gpu']} / {r['decode_s_gpu']} / "
                  f"{r['gpu_idle_s']} | {r['graph_capture_s_first']} / "
                  f"{r['graph_capture_s_after_free']} |")
    if turns:
        print("\n| model | samples x turns x tokens (+ tool) | tok/s joined / kept / recomputed / one call | "
              "prefilled tokens joined / kept / recomputed | prefill GPU s joined / kept / recomputed | "
              "speed-up joined over kept / kept over recomputed |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in turns:
            w = r["workload"]
            print(f"| {w['model']} | {w['prompts']} x {w['turns']} x {w['turn_tokens']} {w['turn_lengths']} "
                  f"(+ {w['tool_tokens']}) | {r['joined_tok_per_s']:,.0f} / {r['kept_tok_per_s']:,.0f} / "
                  f"{r['recomputed_tok_per_s']:,.0f} / {r['one_call_tok_per_s']:,.0f} | "
                  f"{r['joined_prefilled_tokens']:,} / {r['kept_prefilled_tokens']:,} / "
                  f"{r['recomputed_prefilled_tokens']:,} | {r['joined_prefill_s_gpu']} / {r['kept_prefill_s_gpu']} / "
                  f"{r['recomputed_prefill_s_gpu']} | {r['joined_speedup']} / {r['kept_speedup']} |")


if __name__ == "__main__":
    sys.exit(main())
