"""The mixture-of-experts MLP (models/moe.py) on a CUDA GPU, bf16, at a Qwen3-30B-A3B-like width (hidden 1024, 32
experts of 256, top 4): the grouped-GEMM path against the loop path and float64 (forward and backward), no host sync
on the grouped path, and its capture in a CUDA graph replayed on new inputs (as the engine captures its decode).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models.moe import experts_forward, route, use_grouped_mm  # noqa: E402

DEV = torch.device("cuda", 0)
H, E, I, K = 1024, 32, 256, 4


def _weights(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    router = torch.randn(E, H, generator=g, device=DEV) * H ** -0.5
    gate_up = torch.randn(E, 2 * I, H, generator=g, device=DEV) * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device=DEV) * I ** -0.5
    return router, gate_up, down


def _inputs(tokens, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(tokens, H, generator=g, device=DEV), torch.randn(tokens, H, generator=g, device=DEV)


def _run(x, dy, router, gate_up, down, dtype, grouped):
    """Output and the gradients of x, gate_up, down (routing taken from the float64 router, the same for all)."""
    weights, experts = route(x.double(), router.double(), K, True)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_up, down)]
    out = experts_forward(leaves[0], weights.to(dtype), experts, leaves[1], leaves[2], grouped=grouped)
    out.backward(dy.to(dtype))
    return [out.double()] + [t.grad.double() for t in leaves]


def test_grouped_path_is_as_close_to_float64_as_the_loop_path():
    """bf16, 4096 tokens: the grouped path's output and gradients are within the loop path's error of float64 (twice
    it, plus a bf16 ulp of the values), and the auto choice takes the grouped path."""
    router, gate_up, down = _weights()
    x, dy = _inputs(4096)
    assert use_grouped_mm(x.bfloat16(), gate_up.bfloat16())
    ref = _run(x, dy, router, gate_up, down, torch.float64, grouped=False)
    loop = _run(x, dy, router, gate_up, down, torch.bfloat16, grouped=False)
    grouped = _run(x, dy, router, gate_up, down, torch.bfloat16, grouped=True)
    for r, a, b in zip(ref, loop, grouped):
        scale = r.abs().max().item()
        err_loop, err_grouped = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err_grouped <= 2 * err_loop + scale / 128, (err_loop, err_grouped, scale)


def test_the_grouped_path_syncs_no_host_and_replays_in_a_cuda_graph():
    """The grouped forward (routing included) runs under torch.cuda's sync debug mode "error" (no host sync), is
    captured in a CUDA graph over static buffers, and replayed on new tokens it gives the eager outputs bit for
    bit."""
    router, gate_up, down = (t.bfloat16() for t in _weights())
    static = torch.zeros(512, H, device=DEV, dtype=torch.bfloat16)

    def step():
        weights, experts = route(static, router, K, True)
        return experts_forward(static, weights, experts, gate_up, down)

    static.copy_(_inputs(512, seed=2)[0])
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step()
    for seed in (3, 4):
        static.copy_(_inputs(512, seed=seed)[0])
        graph.replay()
        with torch.no_grad():
            eager = step()
        assert eager.abs().max() > 0.1
        assert torch.equal(out, eager)
