"""What the Triton capped attention costs and saves: forward + backward time and peak memory of one packed attention
layer with Gemma 2's soft cap, per path, at several packed lengths.

    python bench/attention.py [--tokens 2048,8192,16384] [--sequences 4] [--window 0] [--repeats 5]
    TRITON_INTERPRET=1 python bench/attention.py --smoke   # CPU, tiny (tests/unit/test_bench_attention.py)

Gemma-2-2b's attention shape (8 query heads, 4 K/V heads, head_dim 256, scale 256^-0.5, cap 50) in bf16, `--tokens`
packed into `--sequences` equal sequences (`--window`: a sliding layer's window, 4096 on Gemma 2; 0: a global layer).
Paths: `triton` (`models/attention_triton.py`, the default for a capped model on CUDA), `explicit` (the capped scores
written out segment by segment, `MESHPPO_CAPPED_ATTENTION=torch`) and `flash` (the same attention uncapped through
`attention_packed`'s FlashAttention: the floor a capped kernel can reach). One JSON line per path and length: the
median wall time of `--repeats` (odd) forward + backward passes after a warm-up (CUDA events), the peak memory
allocated above the inputs during one pass (`peak_memory_gib`; None on CPU), the explicit scores' bytes that pass
would keep (`explicit_score_gib`: [sequences, heads, longest, longest] scores and probabilities in float32), and
the largest difference of the Triton path's output from the explicit path's (`max_abs_diff_vs_explicit`). A path
that runs out of memory writes `oom: true`."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402

PATHS = ("triton", "explicit", "flash")
# Gemma-2-2b: num_attention_heads, num_key_value_heads, head_dim, query_pre_attn_scalar, attn_logit_softcapping
GEMMA2_2B = dict(heads=8, kv_heads=4, head_dim=256, scale=256 ** -0.5, cap=50.0)
SMOKE = dict(heads=4, kv_heads=2, head_dim=32, scale=32 ** -0.5, cap=50.0)


def path_fn(path: str, cu: torch.Tensor, max_len: int, shape: dict, window: int | None):
    """The attention of `path` as a function of (q, k, v)."""
    from models.attention import attention_packed

    os.environ["MESHPPO_CAPPED_ATTENTION"] = "torch" if path == "explicit" else "triton"
    cap = None if path == "flash" else shape["cap"]
    return lambda q, k, v: attention_packed(q, k, v, cu, max_len, shape["scale"], window=window, softcap=cap)


def one_pass(fn, q, k, v, dout) -> torch.Tensor:
    """Forward and backward of `fn`; its output."""
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach()


def measure(fn, q, k, v, dout, repeats: int, cuda: bool) -> tuple[float, float | None, torch.Tensor]:
    """(median seconds of `repeats` passes after a warm-up, peak bytes above the inputs of one pass or None, output)."""
    out = one_pass(fn, q, k, v, dout)
    peak = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        one_pass(fn, q, k, v, dout)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    walls = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_pass(fn, q, k, v, dout)
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            one_pass(fn, q, k, v, dout)
            walls.append(time.perf_counter() - t0)
    return statistics.median(walls), peak, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=None,
                   help="packed lengths, comma-separated (default 2048,8192,16384; --smoke: 64)")
    p.add_argument("--sequences", type=int, default=4, help="equal sequences each length is packed into")
    p.add_argument("--window", type=int, default=0, help="sliding window (Gemma 2's sliding layers: 4096); 0: none")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--repeats", type=int, default=5, help="timed passes after the warm-up (odd: the median's)")
    p.add_argument("--smoke", action="store_true",
                   help="on CPU in float32, 4 / 2 heads of 32, the Triton kernels under the interpreter")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.repeats % 2 == 0:
        p.error(f"--repeats {a.repeats}: give an odd count >= 1 (the time is the median pass's)")
    paths = a.paths.split(",")
    if not paths or set(paths) - set(PATHS):
        p.error(f"--paths {a.paths}: give some of {', '.join(PATHS)}")
    a.tokens = a.tokens or ("64" if a.smoke else "2048,8192,16384")
    try:
        lengths = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens}: give comma-separated token counts")
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs the Triton kernels on CPU under Triton's interpreter: set TRITON_INTERPRET=1 "
                    "(before triton is imported, which importing torch.distributed does)")
        device, dtype, shape = torch.device("cpu"), torch.float32, SMOKE
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (--smoke runs a tiny CPU pass)")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, GEMMA2_2B
    if any(t < a.sequences or t % a.sequences for t in lengths):
        p.error(f"--tokens {a.tokens}: each a positive multiple of --sequences {a.sequences}")
    from models.transformer import cu_seqlens_from_lengths

    window = a.window or None
    cuda = device.type == "cuda"
    for tokens in lengths:
        per = tokens // a.sequences
        cu = cu_seqlens_from_lengths([per] * a.sequences, device=device)
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*size):
            return torch.randn(*size, generator=g, device=device).to(dtype)

        q = randn(tokens, shape["heads"], shape["head_dim"]).requires_grad_()
        k = randn(tokens, shape["kv_heads"], shape["head_dim"]).requires_grad_()
        v = randn(tokens, shape["kv_heads"], shape["head_dim"]).requires_grad_()
        dout = randn(tokens, shape["heads"], shape["head_dim"])
        workload = dict(tokens=tokens, sequences=a.sequences, window=window, dtype=str(dtype).removeprefix("torch."),
                        smoke=a.smoke, **shape)
        explicit_bytes = 2 * 4 * a.sequences * shape["heads"] * per * per
        ref = None
        if "explicit" in paths:  # first: the outputs of the others are compared with its
            paths = ["explicit"] + [x for x in paths if x != "explicit"]
        for path in paths:
            record = dict(path=path, explicit_score_gib=explicit_bytes / 2 ** 30)
            try:
                seconds, peak, out = measure(path_fn(path, cu, per, shape, window), q, k, v, dout, a.repeats, cuda)
            except torch.OutOfMemoryError:
                emit("attention", workload, **record, oom=True)
                torch.cuda.empty_cache()
                continue
            if path == "explicit":
                ref = out.float()
            diff = None if ref is None or path != "triton" else (out.float() - ref).abs().max().item()
            emit("attention", workload, **record, oom=False, seconds=seconds, peak_memory_gib=None if peak is None else peak / 2 ** 30,
                 max_abs_diff_vs_explicit=diff)
            del out
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
