"""`attention_packed` off the FlashAttention path (CPU, float32/64): segment by segment, padded to
the longest, or the block-diagonal mask over the whole row when that costs fewer scores. Both
against a loop over the segments written here (float64, values and gradients), with and without a soft cap of the
scores (Gemma 2's attn_logit_softcapping; 1.0 here, well inside the scores' range), which takes these explicit paths
on every device (on the GPU: tests/gpu/test_gemma2_gpu.py)."""

import pytest
import torch

from models.attention import _segment_layouts, attention_packed


def _by_loop(q, k, v, cu, cu_k, scale, window=None, softcap=None):
    """Each segment's causal attention on its own, queries aligned with its last keys; the
    positions past `cu[-1]` (and past `cu_k[-1]`) form one more segment. `window`: a query sees
    the keys fewer than `window` positions back; `softcap`: the scaled scores capped, cap·tanh(s / cap)."""
    tq, tk = q.shape[0], k.shape[0]
    bounds_q = cu.tolist() + ([tq] if tq > cu[-1] else [])
    bounds_k = cu_k.tolist() + ([tk] if tk > cu_k[-1] else [])
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(bounds_q) - 1):
        a, b, c, d = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        qs = q[a:b].transpose(0, 1)
        ks, vs = (t[c:d].repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i, j = torch.arange(b - a)[:, None], torch.arange(d - c)[None, :]
        scores = scores.masked_fill(j > i + (d - c) - (b - a), float("-inf"))
        if window:
            scores = scores.masked_fill(j <= i + (d - c) - (b - a) - window, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _values_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


CASES = {  # name: (query lengths, trailing query padding, key lengths or None for keys = queries)
    "equal lengths": ([5, 5, 5, 5], 0, None),
    "mixed lengths and trailing padding": ([3, 7, 1, 4], 3, None),
    "keys longer than queries (a shared prefix)": ([2, 3, 4], 0, [2, 6, 9]),
}


def _case(case):
    """(q, k, v, dout, cu, cu_k, shared) of a CASES entry, float64: 4 query heads, 2 KV heads of 8; `shared` the
    keys apart from the queries (`PrefixSharing`, the identity gather) or None."""
    from models.attention import PrefixSharing

    lengths, trailing, key_lengths = CASES[case]
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tq = int(cu[-1]) + trailing
    if key_lengths is None:
        cu_k, tk = cu, tq
    else:
        cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32)
        tk = int(cu_k[-1])
    assert _segment_layouts(cu.long(), tq, cu_k.long(), tk) is not None  # the padded path runs
    q = 3 * torch.randn(tq, 4, 8, generator=g, dtype=torch.float64)  # scores of several units: a cap of 1 acts
    k, v = (torch.randn(tk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(tq, 4, 8, generator=g, dtype=torch.float64)
    shared = None if key_lengths is None else PrefixSharing(torch.arange(tk), cu_k, max(key_lengths))
    return q, k, v, dout, cu, cu_k, shared


@pytest.mark.parametrize("softcap", [None, 1.0])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", CASES)
def test_segments_padded_equal_a_loop_over_segments(case, window, softcap):
    """Values and gradients, with and without a sliding window of 3 (shorter than most segments; with a shared
    prefix a query's window reaches back into the keys before its own), with and without a soft cap."""
    q, k, v, dout, cu, cu_k, shared = _case(case)
    max_len = int((cu[1:] - cu[:-1]).max())
    ours = _values_and_grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, 0.3, shared, window, softcap),
                             q, k, v, dout)
    ref = _values_and_grads(lambda a, b, c: _by_loop(a, b, c, cu, cu_k, 0.3, window, softcap), q, k, v, dout)
    for name, x, y in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=name)
    if softcap:  # the cap acts
        assert (ref[0] - _by_loop(q, k, v, cu, cu_k, 0.3, window)).abs().max() > 1e-2


@pytest.mark.parametrize("softcap", [None, 1.0])
@pytest.mark.parametrize("window", [None, 5])
def test_one_long_segment_among_many_short_takes_the_mask(window, softcap):
    """Padding 40 one-token segments to a 40-token one would cost 41 x 40 x 40 scores against the
    whole row's 80 x 80: the block-diagonal mask runs, with the same result (with a window of 5 too; with a soft
    cap, its explicit scores)."""
    lengths = [40] + [1] * 40
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert _segment_layouts(cu.long(), 80, cu.long(), 80) is None
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(80, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(80, 2, 8, generator=g, dtype=torch.float64)
    ours = _values_and_grads(lambda a, b, c: attention_packed(a, b, c, cu, 40, 0.3, window=window, softcap=softcap),
                             3 * q, k, v, dout)
    ref = _values_and_grads(lambda a, b, c: _by_loop(a, b, c, cu, cu, 0.3, window, softcap), 3 * q, k, v, dout)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_backward_follows_torchs_deterministic_mode(monkeypatch, deterministic):
    """With flash-attn installed `attention_packed` calls its varlen kernel, whose backward is
    deterministic only when asked (`deterministic=True`; torch's switch does not reach it):
    fsdp_config.full_determinism (`torch.use_deterministic_algorithms`) must ask. The kernel is
    stood in for by a recorder of its arguments (no GPU here)."""
    import models.attention as attention

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "_flash_varlen", fake_varlen)
    monkeypatch.setattr(attention, "flash_varlen_usable", lambda q: True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
        attention.attention_packed(q, k, v, torch.tensor([0, 2, 6], dtype=torch.int32), 4, 0.35)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(calls) == 1
    assert calls[0].get("deterministic", False) is deterministic
    assert calls[0]["causal"] is True and calls[0]["softmax_scale"] == 0.35


@pytest.mark.parametrize("window, size", [(None, (-1, -1)), (5, (4, 0)), (1, (0, 0))])
def test_flash_attn_varlen_gets_the_window_as_transformers_passes_it(monkeypatch, window, size):
    """flash-attn's varlen kernel takes a sliding window as `window_size = (window - 1, 0)`: a query sees itself
    and the window - 1 keys before it (transformers' flash path passes the same left size); (-1, -1) is none.
    The kernel is stood in for by a recorder of its arguments (no GPU here)."""
    import models.attention as attention

    calls = []
    monkeypatch.setattr(attention, "_flash_varlen", lambda *a, **kwargs: calls.append(kwargs) or torch.zeros_like(a[0]))
    monkeypatch.setattr(attention, "flash_varlen_usable", lambda q: True)
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    attention.attention_packed(q, k, v, torch.tensor([0, 2, 6], dtype=torch.int32), 4, 0.35, window=window)
    assert calls[0]["window_size"] == size
