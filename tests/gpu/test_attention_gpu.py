"""Packed (varlen) causal attention on a CUDA GPU: `models.attention._FlashVarlen` (the aten
FlashAttention ops called directly) against PyTorch's public `varlen_attn`, which runs the same
kernels (outputs and gradients bitwise equal), and against the float32 SDPA reference with a
block-diagonal causal mask (within bf16 error). Skipped without CUDA."""

import pytest
import torch

from models.attention import attention_packed, block_causal_mask, flash_varlen_usable
from models.transformer import cu_seqlens_from_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
LENGTHS = [57, 1, 130, 64, 33, 200, 7]  # packed sequences of uneven lengths, one of a single token


def _inputs(hq: int, hkv: int, d: int = 64, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t, h, d, device=DEV, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    cu = cu_seqlens_from_lengths(LENGTHS, device=DEV)
    return q, k, v, cu, max(LENGTHS), d ** -0.5


def _grads(fn, q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _torch_varlen(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn
    import inspect

    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **kw)


def _sdpa_reference(q, k, v, cu, scale):
    """float32, K/V heads repeated, SDPA with the block-diagonal causal mask."""
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    mask = block_causal_mask(cu.long(), q.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[None, None], scale=scale)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(12, 2), (8, 8)])
def test_flash_varlen_equals_torch_varlen_attn(hq, hkv):
    from models import attention

    if attention._flash_varlen is not None:
        pytest.skip("flash-attn is installed: attention_packed takes its kernel, not PyTorch's")
    q, k, v, cu, max_len, scale = _inputs(hq, hkv)
    assert flash_varlen_usable(q)
    dout = torch.randn_like(q)
    ours = _grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, scale), q, k, v, dout)
    theirs = _grads(lambda a, b, c: _torch_varlen(a, b, c, cu, max_len, scale), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("hq,hkv", [(12, 2)])
def test_flash_varlen_matches_the_float32_reference(hq, hkv):
    q, k, v, cu, max_len, scale = _inputs(hq, hkv, seed=1)
    dout = torch.randn_like(q)
    out, dq, dk, dv = _grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, scale), q, k, v, dout)
    ref = _grads(lambda a, b, c: _sdpa_reference(a, b, c, cu, scale), q.float(), k.float(), v.float(), dout.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        err = (a.float() - b).abs().max().item()
        # bf16 inputs and outputs: a few units of bf16 rounding (2**-8) of values of order 1
        assert err < 0.05 * max(1.0, b.abs().max().item()), f"{name}: max |diff| {err}"


def test_flash_varlen_under_torch_compile():
    q, k, v, cu, max_len, scale = _inputs(12, 2, seed=2)
    dout = torch.randn_like(q)
    eager = _grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, scale), q, k, v, dout)
    compiled_fn = torch.compile(lambda a, b, c: attention_packed(a, b, c, cu, max_len, scale), fullgraph=True)
    compiled = _grads(compiled_fn, q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("hq,hkv", [(12, 2)])
def test_shared_prefix_keys_match_the_reference(hq, hkv):
    """Prefix sharing (`PrefixSharing`): responses whose keys are their prompt's then their own, with
    queries only for their own tokens. FlashAttention must align those queries with the last keys
    (bottom-right); the float32 mask reference on the same layout is checked against the plain
    `prompt + response` layout in float64 (tests/unit/test_prefix_sharing.py). Aligned top-left, a
    response's first query would see one key."""
    from trainer.forward import build_micro_batch

    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(1, 100, (n,), generator=g).tolist()  # noqa: E731
    p1, p2 = tok(90), tok(37)
    prompts = [p1, p1, p2, p1, tok(5), p2]
    responses = [tok(40), tok(130), tok(1), tok(64), tok(20), tok(77)]
    mb = build_micro_batch(prompts, responses, DEV, packed=True, share_prefix=True)
    assert mb.shared is not None
    t, d = mb.input_ids.shape[1], 64
    gd = torch.Generator(device=DEV).manual_seed(4)
    q, k, v = (torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16, generator=gd) for h in (hq, hkv, hkv))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    out, dq, dk, dv = _grads(lambda a, b, c: attention_packed(a, b, c, mb.cu_seqlens, mb.max_seqlen, scale, mb.shared),
                             q, k, v, dout)
    cpu = mb.shared._replace(kv_index=mb.shared.kv_index.cpu(), cu_seqlens_k=mb.shared.cu_seqlens_k.cpu())
    ref = _grads(lambda a, b, c: attention_packed(a, b, c, mb.cu_seqlens.cpu(), mb.max_seqlen, scale, cpu),
                 *(x.float().cpu() for x in (q, k, v)), dout.float().cpu())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        err = (a.float().cpu() - b).abs().max().item()
        assert err < 0.05 * max(1.0, b.abs().max().item()), f"{name}: max |diff| {err}"


def _windowed_reference(q, k, v, cu, scale, window, cu_k=None):
    """float32, K/V heads repeated, SDPA with the block-diagonal causal mask cut to the last `window` keys."""
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    if cu_k is None:
        mask = block_causal_mask(cu.long(), q.shape[0], window=window)
    else:
        mask = block_causal_mask(cu.long(), q.shape[0], cu_k.long(), k.shape[0], window)
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[None, None], scale=scale)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("window", [1, 17, 64, 150])
@pytest.mark.parametrize("via", ["aten", "attention_packed"])
def test_flash_varlen_with_a_window_matches_the_float32_reference(window, via):
    """A sliding window (`window_size_left = window - 1`, right 0) through PyTorch's FlashAttention kernels
    (`_FlashVarlen`, forward and backward) and through `attention_packed` (flash-attn's kernel where installed):
    outputs and gradients against the float32 masked SDPA reference, within bf16 error; the full-context
    reference is further off than that (the window is applied)."""
    from models.attention import _FlashVarlen

    q, k, v, cu, max_len, scale = _inputs(12, 2, seed=5)
    dout = torch.randn_like(q)
    if via == "aten":
        fn = lambda a, b, c: _FlashVarlen.apply(a, b, c, cu, cu, max_len, max_len, scale, window)  # noqa: E731
    else:
        fn = lambda a, b, c: attention_packed(a, b, c, cu, max_len, scale, window=window)  # noqa: E731
    got = _grads(fn, q, k, v, dout)
    ref = _grads(lambda a, b, c: _windowed_reference(a, b, c, cu, scale, window), q.float(), k.float(), v.float(),
                 dout.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = (a.float() - b).abs().max().item()
        assert err < 0.05 * max(1.0, b.abs().max().item()), f"{name}: max |diff| {err}"
    full = _sdpa_reference(q.float(), k.float(), v.float(), cu, scale)
    assert (full - ref[0]).abs().max().item() > 0.2


@pytest.mark.parametrize("window", [5, 60])
def test_shared_prefix_keys_with_a_window_match_the_reference(window):
    """Prefix sharing with a window: a response's window reaches back into its prompt's keys (FlashAttention's
    window aligned bottom-right with the queries), against the float32 mask reference on the same layout."""
    from trainer.forward import build_micro_batch

    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(1, 100, (n,), generator=g).tolist()  # noqa: E731
    p1, p2 = tok(90), tok(37)
    prompts, responses = [p1, p1, p2, p1, p2], [tok(40), tok(130), tok(1), tok(64), tok(77)]
    mb = build_micro_batch(prompts, responses, DEV, packed=True, share_prefix=True)
    t, d = mb.input_ids.shape[1], 64
    gd = torch.Generator(device=DEV).manual_seed(6)
    q, k, v = (torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16, generator=gd) for h in (12, 2, 2))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    got = _grads(lambda a, b, c: attention_packed(a, b, c, mb.cu_seqlens, mb.max_seqlen, scale, mb.shared, window),
                 q, k, v, dout)
    idx = mb.shared.kv_index
    ref = _grads(lambda a, b, c: _windowed_reference(a, b[idx], c[idx], mb.cu_seqlens, scale, window,
                                                     mb.shared.cu_seqlens_k), q.float(), k.float(), v.float(),
                 dout.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = (a.float() - b).abs().max().item()
        assert err < 0.05 * max(1.0, b.abs().max().item()), f"{name}: max |diff| {err}"
