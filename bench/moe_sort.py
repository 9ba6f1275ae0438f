"""What the mixture-of-experts layer's sort by expert costs, per path: torch's (a stable radix sort, a scatter for the
inverse, a scatter-add and a cumsum for the groups' ends) against `models/moe_triton.py`'s counting-sort kernel.

    python bench/moe_sort.py [--pairs 2048,16384,65536,131072] [--experts 128] [--tokens 256] [--repeats 21]
    TRITON_INTERPRET=1 python bench/moe_sort.py --smoke   # CPU, tiny (tests/unit/test_bench_moe_sort.py)

Two measurements a path (`MESHPPO_MOE_SORT`, `models.moe.sort_by_expert`), each a CUDA graph replayed `--repeats`
(odd) times after a warm-up, its median replay timed by CUDA events:

* `sort`: `sort_by_expert` alone on `--pairs` random expert ids of `--experts`, 48 launches a graph (a
  qwen3-30b-a3b decode step's layers, on different ids); `us_per_sort` is the replay's time / 48.
* `layer`: qwen3-30b-a3b's sparse block (hidden 2048, 128 experts of 768, 8 a token; the router's top-k and the
  grouped GEMMs of `models.moe.experts_forward`) on `--tokens` tokens in bf16, as the engine's decode step runs it;
  `us_per_layer`, and the two paths' outputs compared (`same_output`: bitwise, the sort's permutation is the same).

On CPU (`--smoke`: float32, the kernel under Triton's interpreter, 8 experts, a 64-wide layer) the times are wall
times of eager calls and mean nothing; the records' fields are the GPU run's."""

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

PATHS = ("torch", "triton")
LAYERS = 48  # qwen3-30b-a3b's: sorts a decode step makes
QWEN3_30B_A3B = dict(hidden=2048, experts=128, inter=768, top_k=8)
SMOKE = dict(hidden=64, experts=8, inter=32, top_k=2)


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of one call of `fn` (CUDA: replays of a graph of it, after a warm-up on a side stream)."""
    if not cuda:
        fn()
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
        return statistics.median(walls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    walls = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        walls.append(start.elapsed_time(end) / 1e3)
    return statistics.median(walls)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=None, help="(token, slot) pairs of the sort alone, comma-separated "
                                                 "(default 2048,16384,65536,131072; --smoke: 40,300)")
    p.add_argument("--experts", type=int, default=None, help="experts of the sort alone (default 128; --smoke: 8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the layer (default 256; --smoke: 20)")
    p.add_argument("--repeats", type=int, default=21, help="timed replays (odd: the median's)")
    p.add_argument("--smoke", action="store_true", help="on CPU, tiny, the kernel under Triton's interpreter")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.repeats % 2 == 0:
        p.error(f"--repeats {a.repeats}: give an odd count >= 1 (the time is the median replay's)")
    try:
        pairs = [int(x) for x in (a.pairs or ("40,300" if a.smoke else "2048,16384,65536,131072")).split(",")]
    except ValueError:
        p.error(f"--pairs {a.pairs}: give comma-separated pair counts")
    shape = SMOKE if a.smoke else QWEN3_30B_A3B
    experts = shape["experts"] if a.experts is None else a.experts
    tokens = (20 if a.smoke else 256) if a.tokens is None else a.tokens
    if min(pairs) < 1 or experts < 1 or tokens < 1:
        p.error("--pairs, --experts and --tokens must be positive")
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs the kernel on CPU under Triton's interpreter: set TRITON_INTERPRET=1")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (--smoke runs a tiny CPU pass)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    from models.moe import experts_forward, route, sort_by_expert

    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    for n in pairs:
        ids = torch.randint(0, experts, (LAYERS, n), generator=g, device=device)
        for path in PATHS:
            os.environ["MESHPPO_MOE_SORT"] = path

            def sorts():
                for row in ids:
                    sort_by_expert(row, experts)

            seconds = timed(sorts, a.repeats, cuda)
            emit("moe_sort", dict(kind="sort", pairs=n, experts=experts, smoke=a.smoke), path=path,
                 us_per_sort=seconds / LAYERS * 1e6)
    h, e, inter, k = shape["hidden"], shape["experts"], shape["inter"], shape["top_k"]
    x = torch.randn(tokens, h, generator=g, device=device).to(dtype)
    router = (torch.randn(e, h, generator=g, device=device) * h ** -0.5).to(dtype)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g, device=device) * h ** -0.5).to(dtype)
    down = (torch.randn(e, h, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
    outputs = {}
    for path in PATHS:
        os.environ["MESHPPO_MOE_SORT"] = path
        out = torch.empty(tokens, h, device=device, dtype=dtype)

        def layer():
            with torch.no_grad():
                weights, chosen = route(x, router, k, True)
                out.copy_(experts_forward(x, weights, chosen, gate_up, down))

        seconds = timed(layer, a.repeats, cuda)
        outputs[path] = out.clone()
        emit("moe_sort", dict(kind="layer", tokens=tokens, dtype=str(dtype).removeprefix("torch."), smoke=a.smoke,
                              **shape), path=path, us_per_layer=seconds * 1e6,
             same_output=None if path == PATHS[0] else bool(torch.equal(outputs[PATHS[0]], out)))


if __name__ == "__main__":
    main()
