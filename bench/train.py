"""Training-side throughput: the actor update and the forward log-prob pass, packed sequences.

    python bench/train.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--tokens 16384] [--seq-len 512]

Runs the trainer's own code (`trainer.roles.Actor` on an FSDP2 actor, world size 1) on
random weights and random token ids: one mini-batch of `--tokens` tokens in sequences of
`--seq-len` (a quarter prompt, the rest response), packed into micro-batches of at most
`--tokens` tokens. Prints one JSON object per measurement: tokens/s, MFU (`ModelArgs.flops`' FLOP
count over 989 TFLOP/s), peak memory in GiB (`peak_memory_gib`), the floors, and the GPU's SM clock and power over the timed
runs (`gpu_clock_mhz`, `gpu_power_w`, ...: `bench.common.GpuTelemetry`; at its power limit an
H200 lowers its clock, and the MFU with it). Variants (`--variants`) switch one
lever at a time: `compile` (torch.compile of each block), `keep_gathered` (no reshard after forward), `ac` (activation checkpointing),
`offload` (saved activations kept on CPU), `ac_offload` (both: the checkpointed block inputs on CPU),
`full_logits` (the naive [tokens, vocab] log-softmax, to show what chunking saves).
`--tiled-mlp 0,4,16` measures each variant again with each block's MLP in that many token tiles
(`models/tiled_mlp.py`, verl's `model.tiled_mlp`; 0: untiled): peak memory against step time. A
tiled record's workload carries `tiled_mlp`.
`--profile` adds, per measurement, the device time by kernel class from `torch.profiler`.
`--layers N` builds each model with its first N decoder layers (a shape too large for one GPU's optimizer
states, as qwen3-30b-a3b's 48 mixture-of-experts layers: every layer is alike, so tokens/s scales by the layer
count and the MFU holds); the records' workload carries `layers`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import H200_BF16_FLOPS, GpuTelemetry, emit, kernel_breakdown, model_args  # noqa: E402
from models import PEAK_BF16_FLOPS  # noqa: E402
from models.tiled_mlp import apply_tiled_mlp  # noqa: E402
from trainer.config import OptimConfig, PolicyLossConfig  # noqa: E402
from trainer.launch import init_distributed  # noqa: E402
from trainer.setup import make_optimizer  # noqa: E402
from trainer.rollout_batch import RolloutBatch  # noqa: E402
from trainer.roles import Actor, MicroBatching  # noqa: E402
from sharding.fsdp import FSDPConfig, build_fsdp_model  # noqa: E402
from sharding.mesh import ParallelDims  # noqa: E402

PEAK = PEAK_BF16_FLOPS["H200"]  # the MFU denominator


def run_flops(args, ro, backward: bool) -> float:
    """FLOPs that run over the rollouts `ro` (`ModelArgs.flops`): the LM head on response positions."""
    lengths = ro.lengths()
    return args.flops(sum(lengths), sum(len(r) for r in ro.responses), sum(s * s / 2 for s in lengths), backward)


def make_rollouts(args, n_seqs, seq_len, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_len = seq_len // 4
    prompts = torch.randint(0, args.vocab_size, (n_seqs, p_len), generator=g).tolist()
    responses = torch.randint(0, args.vocab_size, (n_seqs, seq_len - p_len), generator=g).tolist()
    r = seq_len - p_len
    ro = RolloutBatch(prompts, responses, list(range(n_seqs)), [None] * n_seqs, [None] * n_seqs, [{}] * n_seqs,
                      ["length"] * n_seqs, [[]] * n_seqs, r, device)
    mask = ro.response_mask
    ro.advantages = torch.randn(n_seqs, r, generator=g).to(device) * mask
    ro.old_log_probs = (-torch.rand(n_seqs, r, generator=g).to(device) * 5) * mask
    ro.ref_log_probs = ro.old_log_probs + 0.01 * mask
    return ro


def actor_cfg(tokens):
    return SimpleNamespace(ppo_epochs=1, shuffle=False, loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=None,
                           use_dynamic_bsz=True, ppo_max_token_len_per_gpu=tokens, entropy_coeff=0.0,
                           use_kl_loss=True, kl_loss_type="low_var_kl", clip_ratio=0.2, clip_ratio_low=None,
                           clip_ratio_high=None, clip_ratio_c=3.0, grad_clip=1.0, loss_scale_factor=None,
                           policy_loss=PolicyLossConfig(), tau_pos=1.0, tau_neg=1.05, calculate_entropy=False)


def timed(fn, repeats, telemetry: GpuTelemetry):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with telemetry.window():
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def profiled(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return kernel_breakdown(prof, wall)


VARIANTS = ("base", "compile", "ac", "offload", "ac_offload", "keep_gathered", "full_logits", "lm_head")


def bench_one(name, variant, tokens, seq_len, repeats, ctx, telemetry: GpuTelemetry, profile=False,
              tiled_mlp: int = 0, layers: int | None = None):
    args = model_args(name) if layers is None else model_args(name, num_hidden_layers=layers)
    n_seqs = tokens // seq_len
    ro = make_rollouts(args, n_seqs, seq_len, ctx.device)
    lengths = ro.lengths()
    workload = {"model": name, "variant": variant, "tokens": sum(lengths), "seq_len": seq_len}
    if tiled_mlp:
        workload["tiled_mlp"] = tiled_mlp
    if layers is not None:
        workload["layers"] = layers

    if variant == "lm_head":
        # The LM head alone (log-probs of every position), forward and forward + backward.
        from models.lm_head import chunked_token_logprobs

        g = torch.Generator(device=ctx.device).manual_seed(0)
        n = sum(lengths)
        hid = torch.randn(n, args.hidden_size, device=ctx.device, generator=g, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(args.vocab_size, args.hidden_size, device=ctx.device, generator=g) * 0.02).to(torch.bfloat16)
        w.requires_grad_(True)
        lab = torch.randint(0, args.vocab_size, (n,), device=ctx.device, generator=g)
        flops = args.flops(0, n, 0)  # the LM head alone

        def head_fwd():
            with torch.no_grad():
                chunked_token_logprobs(hid, w, lab)

        def head_upd():
            logp, _ = chunked_token_logprobs(hid, w, lab)
            logp.sum().backward()

        for phase, fn, fl in (("lm_head_forward", head_fwd, flops), ("lm_head_fwd_bwd", head_upd, 3 * flops)):
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # this phase's peak, not an earlier variant's
            med, times = timed(fn, repeats, telemetry)
            emit("train", {**workload, "phase": phase}, seconds=med, tflops=fl / med / 1e12,
                 floor_s=fl / H200_BF16_FLOPS, ratio_to_floor=med / (fl / H200_BF16_FLOPS), times=times,
                 peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30, profile=profiled(fn) if profile else None,
                 **telemetry.take())
        return

    dims = ParallelDims(world_size=1)
    meshes = dims.build_meshes("cuda")
    cfg = FSDPConfig(model_dtype="fp32", reshard_after_forward=(variant != "keep_gathered"))
    model = build_fsdp_model(args, meshes.train, cfg, device=ctx.device, trainable=True, seed=0,
                             enable_gradient_checkpointing=variant in ("ac", "ac_offload"),
                             enable_activation_offload=variant in ("offload", "ac_offload"))
    if tiled_mlp:
        apply_tiled_mlp(model, tiled_mlp)  # before compile, as trainer.setup orders it
    if variant == "compile":
        from sharding.compile import apply_compile

        apply_compile(model)
    optim, _ = make_optimizer(model, OptimConfig(lr=1e-6), 1, ctx.device)
    worker = Actor(model, optim, None, packed=True, temperature=1.0, pad_token_id=0, device=ctx.device,
                   world_size=1, response_length=seq_len, batching=MicroBatching(None, True, tokens))

    if variant == "full_logits":
        # What chunking avoids: logits [tokens, vocab] in fp32 and their log-softmax, kept for backward.
        from trainer.forward import build_micro_batch

        mb = build_micro_batch(ro.prompts, ro.responses, ctx.device, True)

        def fwd_full():
            with torch.no_grad():
                logits = model(mb.input_ids, **mb.model_kwargs()).float()
                torch.log_softmax(logits, -1).gather(-1, mb.labels[..., None])

        fwd_full()
        torch.cuda.reset_peak_memory_stats()
        med, _ = timed(fwd_full, repeats, telemetry)
        emit("train", {**workload, "phase": "forward_logprob"}, seconds=med,
             peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30, **telemetry.take())
        return

    def fwd():
        worker.log_probs(ro)

    def upd():
        worker.update(ro, actor_cfg(tokens), num_mini_batches=1, kl_loss_coef=0.001, seed=0)

    for phase, fn, flops in (("forward_logprob", fwd, run_flops(args, ro, backward=False)),
                             ("actor_update", upd, run_flops(args, ro, backward=True))):
        fn()  # warm-up (and compile)
        fn()
        torch.cuda.reset_peak_memory_stats()
        med, times = timed(fn, repeats, telemetry)
        emit("train", {**workload, "phase": phase}, seconds=med, tokens_per_s=sum(lengths) / med,
             mfu=flops / med / PEAK, tflops=flops / med / 1e12,
             floor_s=flops / H200_BF16_FLOPS, ratio_to_floor=med / (flops / H200_BF16_FLOPS),
             peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
             peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, times=times,
             profile=profiled(fn) if profile else None, **telemetry.take())


def measurement_argvs(a: argparse.Namespace) -> list[list[str]]:
    """One command line per model, variant and tile count (`--tiled-mlp`; 0: untiled,
    no option), every other option as given. Each runs in a process of its own, so each peak starts
    from an empty allocator. (A model built earlier in the process used to keep its fp32 masters
    allocated, 5.8 GiB at 1.5b, and every later variant's peak counted them; `sharding.replicate` no
    longer leaks them.) The `lm_head` variant has no MLP: it runs once, untiled."""
    rest = ([f"--tokens={a.tokens}", f"--seq-len={a.seq_len}", f"--repeats={a.repeats}"] + ["--profile"] * a.profile
            + [f"--layers={a.layers}"] * (a.layers is not None))
    return [[f"--models={m}", f"--variants={v}", *[f"--tiled-mlp={t}"] * bool(t), *rest]
            for m in a.models.split(",") for v in a.variants.split(",")
            for t in (a.tiled_mlp if v != "lm_head" else (0,))]


def tile_counts(text: str) -> list[int]:
    """`--tiled-mlp`'s comma list: distinct counts >= 0 in the order given."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a comma list of integers, got {text!r}") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"tile counts must be >= 0 (0: untiled), got {text!r}")
    return list(dict.fromkeys(counts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--variants", default="base", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="add a torch.profiler kernel breakdown per measurement")
    p.add_argument("--tiled-mlp", type=tile_counts, default=[0],
                   help="comma list of MLP token-tile counts to measure each variant with (0: untiled)")
    p.add_argument("--layers", type=int, default=None,
                   help="build each model with its first N decoder layers (default: all)")
    a = p.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers: give at least 1, got {a.layers}")
    if unknown := [v for v in a.variants.split(",") if v not in VARIANTS]:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        print("bench/train.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if len(argvs := measurement_argvs(a)) > 1:
        return max(subprocess.call([sys.executable, os.path.abspath(__file__), *argv]) for argv in argvs)
    ctx = init_distributed("cuda")
    with GpuTelemetry(torch.cuda.current_device()) as telemetry:  # one model, one variant
        bench_one(a.models, a.variants, a.tokens, a.seq_len, a.repeats, ctx, telemetry, a.profile, a.tiled_mlp[0],
                  a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
