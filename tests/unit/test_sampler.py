"""Sampling maths: counter-based noise, the exponential race, partial combination, top-k / top-p."""

import math

import pytest
import torch

from rollout.sampler import (combine_partials, gumbel_noise, mix32_t, sample_partials_ref, truncation_threshold,
                             uniform_noise)
from rollout.sequence import mix32, sequence_key


def _scalars(temperature):
    greedy = temperature == 0
    return (torch.tensor(1.0 if greedy else 1.0 / temperature), torch.tensor(0.0 if greedy else 1.0))


def test_device_hash_equals_host_hash():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B9]
    got = mix32_t(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32(x) for x in xs]


def test_sequence_keys_differ_per_sample_and_seed():
    keys = {sequence_key(s, p, k) for s in (0, 1, 2**40 + 3) for p in range(20) for k in range(4)}
    assert len(keys) == 3 * 20 * 4
    assert all(0 <= k < 2**32 for k in keys)


def test_uniform_noise_is_uniform_and_deterministic():
    keys = torch.tensor([sequence_key(0, i, 0) for i in range(64)], dtype=torch.int64)
    pos = torch.arange(64)
    vocab = torch.arange(2048)
    u = uniform_noise(keys, pos, vocab)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.003
    assert torch.equal(u, uniform_noise(keys, pos, vocab))
    # A different position or key gives unrelated noise.
    other = uniform_noise(keys, pos + 1, vocab)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1].item()) < 0.01


def test_exponential_race_samples_softmax():
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    temperature = 0.7
    rows = 20_000
    keys = torch.full((rows,), sequence_key(3, 0, 0), dtype=torch.int64)
    pos = torch.arange(rows)
    inv_t, noise = _scalars(temperature)
    parts = sample_partials_ref(logits.expand(rows, -1), keys, pos, inv_t, noise, None, 0)
    tokens, logprobs = combine_partials(parts)
    freq = torch.bincount(tokens, minlength=12).float() / rows
    p = torch.softmax(logits / temperature, -1)
    assert (freq - p).abs().max() < 4 * math.sqrt(p.max() / rows) + 1e-3
    assert torch.allclose(logprobs, torch.log_softmax(logits / temperature, -1)[tokens], atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_partials_over_chunks_equal_one_chunk(temperature):
    """Splitting the vocabulary (TP ranks, kernel splits) changes nothing."""
    torch.manual_seed(1)
    r, v = 7, 96
    logits = torch.randn(r, v) * 3
    logits[0, 5] = logits[0, 70] = logits[0].max() + 1  # a tie: lowest index wins, like argmax
    keys = torch.tensor([sequence_key(1, i, 0) for i in range(r)], dtype=torch.int64)
    pos = torch.arange(r) + 10
    inv_t, noise = _scalars(temperature)
    whole = combine_partials(sample_partials_ref(logits, keys, pos, inv_t, noise, None, 0))
    chunks = [sample_partials_ref(logits[:, a:a + 32], keys, pos, inv_t, noise, None, a) for a in (0, 32, 64)]
    split = combine_partials(torch.cat(chunks, dim=1))
    assert torch.equal(whole[0], split[0])
    assert torch.allclose(whole[1], split[1], atol=1e-6)
    s = logits * inv_t
    assert torch.allclose(whole[1], torch.log_softmax(s, -1).gather(1, whole[0][:, None]).squeeze(1), atol=1e-6)
    if temperature == 0:
        assert torch.equal(whole[0], logits.argmax(-1))
        assert whole[0][0].item() == 5
    else:
        g = gumbel_noise(keys, pos, torch.arange(v))
        assert torch.equal(whole[0], (s + g).argmax(-1))


def _brute_threshold(s_row, top_k, top_p):
    vals, idx = torch.sort(s_row, descending=True)
    keep = len(vals) if top_k <= 0 else min(top_k, len(vals))
    vals = vals[:keep]
    probs = torch.softmax(vals.double(), -1)
    acc, n = 0.0, 0
    for pr in probs.tolist():
        if n > 0 and acc >= top_p:
            break
        acc += pr
        n += 1
    return vals[n - 1].item()


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (-1, 0.5), (-1, 0.95), (8, 0.7), (200, 0.3)])
def test_truncation_threshold_matches_brute_force(top_k, top_p):
    torch.manual_seed(2)
    s = torch.randn(6, 40) * 2
    th = truncation_threshold(s, top_k, top_p)
    for i in range(6):
        assert th[i].item() == pytest.approx(_brute_threshold(s[i], top_k, top_p))
    if top_p == 1.0:
        assert ((s >= th[:, None]).sum(-1) == min(top_k, 40)).all()


def test_truncated_race_stays_inside_the_set_but_reports_full_logprob():
    torch.manual_seed(3)
    r, v = 2000, 30
    logits = torch.randn(v).expand(r, -1)
    inv_t, noise = _scalars(1.0)
    keys = torch.full((r,), 7, dtype=torch.int64)
    pos = torch.arange(r)
    th = truncation_threshold(logits * inv_t, 3, 1.0)
    tokens, lp = combine_partials(sample_partials_ref(logits, keys, pos, inv_t, noise, th, 0))
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    assert set(tokens.tolist()) == top3
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1), atol=1e-6)
