"""What Ulysses sequence parallelism saves: one rank's peak memory for the forward and backward of
one long packed micro-batch, whole on one rank (`--sp 1`) against split over a group (`--sp 2`).

    python bench/ulysses_memory.py --sp 1 [--model qwen2.5-1.5b] [--tokens 32768]
    torchrun --nproc_per_node=2 bench/ulysses_memory.py --sp 2 [--backend nccl|gloo]

The actor's own forward path (`trainer.forward.response_logprobs`: the packed layout, the LM head on
the response positions only) in bf16, unsharded weights (every rank holds them and their
gradients: what the split saves is activations), one micro-batch of `--tokens` tokens in
`--sequences` equal sequences, each half prompt and half response. Prints one JSON line per rank:
the peak allocated memory above the weights and gradients, and the median wall time of `--repeats`
(odd) passes after an untimed warm-up pass. With
`--backend gloo` the two ranks may share one GPU (CUDA_VISIBLE_DEVICES=0 for both): the memory per
rank is what two GPUs would hold; the time is not (the all-to-alls cross the host)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, model_args  # noqa: E402


def timed_passes(one_pass, repeats: int, sync) -> list[float]:
    """Wall seconds of `repeats` calls of `one_pass` after one untimed warm-up call, whose own
    costs (the caching allocator growing to the peak, kernel selection, the first collectives'
    set-up) are no pass's. `sync` waits for the device's work."""
    one_pass()
    sync()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        sync()
        walls.append(time.perf_counter() - start)
    return walls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--sp", type=int, default=1, choices=(1, 2, 4, 8))
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up (odd: the median's)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.repeats % 2 == 0:
        p.error(f"--repeats {a.repeats}: give an odd count >= 1 (the wall time is the median pass's)")
    from models import Transformer
    from sharding.ulysses import apply_sequence_parallel, build_sequence_parallel, check_sequence_parallel
    from trainer.forward import build_micro_batch, response_logprobs

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != a.sp:
        p.error(f"--sp {a.sp} runs on {a.sp} ranks (torchrun --nproc_per_node={a.sp}); this launch has {world}")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    args = model_args(a.model)
    check_sequence_parallel("--sp", a.sp, world, None, args.num_attention_heads, args.num_key_value_heads)
    sp = None
    if a.sp > 1:
        dist.init_process_group(a.backend)
        sp = build_sequence_parallel(a.sp, world, "cuda" if a.backend == "nccl" else "cpu")
    model = Transformer.build(args, device=dev, dtype=torch.bfloat16, seed=0)
    apply_sequence_parallel(model, sp)
    per = a.tokens // a.sequences
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab_size, (per // 2,), generator=g).tolist() for _ in range(a.sequences)]
    responses = [torch.randint(1, args.vocab_size, (per - per // 2,), generator=g).tolist() for _ in range(a.sequences)]
    width = max(map(len, responses))
    for p_ in model.parameters():
        p_.grad = torch.zeros_like(p_)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def one_pass():
        torch.cuda.reset_peak_memory_stats()  # the peak read after the last pass is that pass's
        mb = build_micro_batch(prompts, responses, dev, packed=True, sp=sp)
        logp, ent = response_logprobs(model, mb, width, 1.0, True)
        (logp.sum() + 0.01 * ent.sum()).backward()

    walls = timed_passes(one_pass, a.repeats, torch.cuda.synchronize)
    peak = torch.cuda.max_memory_allocated() - base
    rank = dist.get_rank() if dist.is_initialized() else 0
    emit("ulysses_memory", {"model": a.model, "tokens": a.tokens, "sequences": a.sequences, "sp": a.sp,
                            "backend": a.backend if a.sp > 1 else None, "rank": rank},
         activation_peak_gib=round(peak / 2**30, 3), weights_and_grads_gib=round(base / 2**30, 3),
         tokens_on_rank=-(-a.tokens // a.sp), wall_s_median=round(statistics.median(walls), 3))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
