"""The chunked LM head on a CUDA GPU at a real size: the Triton path against the PyTorch path
(bf16 logits from the same matmul in both), and its forward's memory. Skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models.lm_head import _use_triton, chunked_token_logprobs  # noqa: E402

DEV = "cuda"
T, H, V, CHUNK = 3000, 896, 151936, 2048  # Qwen2.5-0.5B's head; a last chunk shorter than the others


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    w = (0.1 * torch.randn(V, H, device=DEV, generator=g)).bfloat16()  # logits of std ~3: peaked rows
    labels = torch.randint(0, V, (T,), device=DEV, generator=g)
    labels[:4] = torch.tensor([0, V - 1, V - 2, 1], device=DEV)  # both ends of the vocabulary
    return h, w, labels


def _run(h, w, labels, temperature, with_entropy, g1, g2):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = chunked_token_logprobs(h, w, labels, temperature, CHUNK, with_entropy)
    loss = (logp * g1).sum() + ((ent * g2).sum() if with_entropy else 0)
    loss.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad


@pytest.mark.parametrize("temperature,with_entropy", [(1.0, False), (0.8, True)])
def test_triton_path_matches_torch_path_bf16(monkeypatch, temperature, with_entropy):
    pytest.importorskip("triton")
    h, w, labels = _inputs()
    g1, g2 = torch.randn(T, device=DEV), torch.randn(T, device=DEV)
    monkeypatch.setenv("MESHPPO_LM_HEAD", "torch")
    ref = _run(h, w, labels, temperature, with_entropy, g1, g2)
    monkeypatch.delenv("MESHPPO_LM_HEAD")
    assert _use_triton(h), "CUDA tensors with triton installed take the Triton path"
    got = _run(h, w, labels, temperature, with_entropy, g1, g2)

    # Same bf16 logits on both paths, fp32 after: values differ by summation order only.
    assert torch.isfinite(got[0]).all()
    assert (got[0] - ref[0]).abs().max().item() < 2e-3
    if with_entropy:
        assert (got[1] - ref[1]).abs().max().item() < 2e-3
    # The logits' gradient is rounded to bf16 on both paths: a few ulps apart, here and there.
    for name, a, b in (("hidden", got[2], ref[2]), ("weight", got[3], ref[3])):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


def test_triton_forward_holds_one_bf16_logits_block(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("MESHPPO_LM_HEAD", raising=False)
    h, w, labels = _inputs()
    assert _use_triton(h)
    block = CHUNK * V * w.element_size()
    for _ in range(2):  # the first call compiles the kernels and allocates cuBLAS's workspace
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        chunked_token_logprobs(h, w, labels, 0.8, CHUNK, with_entropy=True)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    # One block, not two at the chunk boundary, nor float32 copies; the rest is [T] floats.
    assert extra < 1.1 * block, (extra / block)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_triton_sum_pi_squared_matches_float64(monkeypatch, temperature):
    """sum p^2 of the old-log-prob pass at Qwen's vocabulary, against float64 over the same bf16
    logits (the matmul is the kernel's input on both sides: what is compared is the reduction)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("MESHPPO_LM_HEAD", raising=False)
    h, w, labels = _inputs()
    assert _use_triton(h)
    with torch.no_grad():
        logp, _, sps = chunked_token_logprobs(h, w, labels, temperature, CHUNK, with_sum_pi_squared=True)
        ref = torch.cat([torch.softmax((h[s:s + 256] @ w.t()).double() / temperature, -1).pow(2).sum(-1)
                         for s in range(0, T, 256)])
        logp0, _ = chunked_token_logprobs(h, w, labels, temperature, CHUNK)
    assert torch.equal(logp, logp0), "asking for sum p^2 leaves the log-probs as they were"
    assert ref.min() < 0.02 and ref.max() > 0.1, "flat and peaked rows"
    assert ((sps.double() - ref).abs() / ref).max().item() < 1e-4
