"""Chunked log-prob / entropy / sum p^2 against a float64 full-logits reference, values and gradients."""

import pytest
import torch

from models import ModelArgs, Transformer
from models.lm_head import chunked_token_logprobs

F32_REL = 5e-5


def _reference(h, w, labels, t, softcap=None):
    z = h.double() @ w.double().t()
    z = (z if softcap is None else torch.tanh(z / softcap) * softcap) / t
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@pytest.mark.parametrize("temperature,chunk,softcap", [(1.0, 3, None), (0.7, 64, None), (1.3, 5, None),
                                                       (0.7, 5, 2.0), (1.0, 64, 1.5)])
def test_values_and_gradients_match_float64(temperature, chunk, softcap):
    """Log-probs, entropies and their gradients of the PyTorch path against float64 full logits; with a soft cap
    (Gemma 2's final_logit_softcapping, capped before the temperature) well inside the logits' range (here up to
    ~20), which the uncapped values are far from."""
    torch.manual_seed(0)
    n, hdim, vocab = 13, 16, 37
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    g1, g2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    logp, ent = chunked_token_logprobs(h, w, labels, temperature, chunk, with_entropy=True, softcap=softcap)
    ((logp * g1).sum() + (ent * g2).sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None

    rl, re = _reference(h, w, labels, temperature, softcap)
    if softcap is not None:
        assert (_reference(h, w, labels, temperature)[0] - rl).abs().max() > 1
    ((rl * g1).sum() + (re * g2).sum()).backward()
    for name, got, want in (("logp", logp.double(), rl), ("entropy", ent.double(), re), ("grad h", gh, h.grad),
                            ("grad w", gw, w.grad)):
        _assert_close_to_scale(got, want, name)


def _assert_close_to_scale(got, want, name):
    """Within F32_REL of `want`'s largest magnitude. The head rounds the logits (here up to ~20) to
    float32 and works on in float32: errors up to 4.6e-6 of the largest value (gradients near 10)
    over 200 seeds of each case; a dropped chunk or a wrong temperature is off by a good part of it."""
    err = (got - want).abs().max().item()
    assert err <= F32_REL * want.abs().max().item(), (name, err, want.abs().max().item())


@pytest.mark.parametrize("temperature,chunk", [(1.0, 3), (0.6, 64), (1.3, 5)])
def test_sum_pi_squared_matches_float64_and_leaves_the_rest_unchanged(temperature, chunk):
    torch.manual_seed(0)
    n, hdim, vocab = 13, 16, 37
    h = (torch.randn(n, hdim) * torch.linspace(0.02, 3, n)[:, None]).requires_grad_()  # flat to peaked rows
    w = torch.randn(vocab, hdim).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    logp, ent, sps = chunked_token_logprobs(h, w, labels, temperature, chunk, with_entropy=True,
                                            with_sum_pi_squared=True)
    p = torch.softmax((h.detach().double() @ w.detach().double().t()) / temperature, -1)
    ref = (p ** 2).sum(-1)
    assert sps.dtype == torch.float32 and not sps.requires_grad
    assert ((sps.double() - ref).abs() / ref).max() < 1e-5
    assert ref.min() < 0.2 and ref.max() > 0.8, "the case covers flat and peaked distributions"
    # the log-probs and entropy, and their gradients, are those of the call without it
    logp0, ent0 = chunked_token_logprobs(h, w, labels, temperature, chunk, with_entropy=True)
    assert torch.equal(logp, logp0) and torch.equal(ent, ent0)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    _, none, sps_only = chunked_token_logprobs(h, w, labels, temperature, chunk, with_sum_pi_squared=True)
    assert none is None and torch.equal(sps_only, sps)


@pytest.mark.parametrize("tied", [True, False])
def test_model_labels_path_equals_log_softmax_of_logits(tied):
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    m = Transformer.build(args, seed=0)
    ids = torch.randint(0, 41, (2, 9))
    labels = torch.roll(ids, -1, dims=1)
    logp, ent = m(ids, labels=labels, temperature=0.9, with_entropy=True, chunk_size=4)
    ref = torch.log_softmax(m(ids) / 0.9, -1)
    assert torch.allclose(logp, ref.gather(-1, labels[..., None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
    _, _, sps = m(ids, labels=labels, temperature=0.9, chunk_size=4, with_sum_pi_squared=True)
    assert torch.allclose(sps, (ref.exp() ** 2).sum(-1), rtol=1e-5)


def test_label_index_scores_only_those_positions_with_the_same_values_and_grads():
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    m = Transformer.build(args, seed=0)
    ids = torch.randint(0, 41, (2, 9))
    labels = torch.roll(ids, -1, dims=1)
    index = torch.tensor([3, 4, 5, 12, 16, 17])
    weights = torch.randn(len(index))
    full, _ = m(ids, labels=labels)
    (full.reshape(-1)[index] * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="one token per entry: 18 labels for 6 positions"):
        m(ids, labels=labels, label_index=index)
    part, _ = m(ids, labels=labels.reshape(-1)[index], label_index=index)
    assert part.shape == (len(index),)
    assert torch.allclose(part, full.reshape(-1)[index].detach(), atol=1e-6)
    (part * weights).sum().backward()
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-6), n
