"""Token log-probabilities (and entropy) straight from hidden states, chunked over tokens.

`logits = hidden @ W.T / temperature` for `T` tokens and a 150k vocabulary is a `[T, V]`
float32 tensor of several GB, kept alive for backward by the naive
`log_softmax(...).gather(...)`. Here the forward computes logits one chunk of tokens at a
time and keeps only the per-token log-sum-exp; the backward recomputes each chunk's logits
and turns them into gradients for the hidden states and the weight. Peak extra memory is one
`[chunk, V]` float32 block in both passes.

Gradients, with z = logits / temperature, p = softmax(z), y the label:
  d logp_y / dz = onehot(y) - p
  d H / dz      = -p * (log p + H)          (H = -sum p log p)
"""

from __future__ import annotations

import torch


def _chunk_stats(h, w, labels, temperature):
    # The matmul runs in the weights' dtype (bf16 under mixed precision: tensor cores, fp32
    # accumulation); everything after it in fp32.
    z = (h.to(w.dtype) @ w.t()).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp_y = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    return z, lse, logp_y


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, with_entropy, out_shape):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z, lse, logp_y = _chunk_stats(hidden[s:e], weight, labels[s:e], temperature)
            logp[s:e], lse_all[s:e] = logp_y, lse
            if with_entropy:
                p = torch.softmax(z, dim=-1)
                ent[s:e] = lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, lse_all, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        # Outputs are fresh tensors in their final shape, not views: FSDP2 hooks a module's
        # outputs for backward, and a view would bypass that hook. The copy is [tokens] floats.
        return logp.reshape(out_shape).clone(), (ent.reshape(out_shape).clone() if with_entropy else ent)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels, lse_all, ent = ctx.saved_tensors
        grad_logp = grad_logp.reshape(-1)
        grad_ent = grad_ent.reshape(-1) if grad_ent is not None and grad_ent.numel() else None
        t, cs = ctx.temperature, ctx.chunk_size
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        mm = weight.dtype  # matmuls in the weights' dtype, as in forward; accumulation in fp32
        for s in range(0, hidden.shape[0], cs):
            e = min(s + cs, hidden.shape[0])
            hc = hidden[s:e].to(mm)
            z = (hc @ weight.t()).float() / t
            logp_all = z - lse_all[s:e, None]
            p = logp_all.exp()
            # d/dz of (g_logp * logp_y): g * (onehot - p)
            dz = -p * grad_logp[s:e, None]
            dz.scatter_add_(-1, labels[s:e, None], grad_logp[s:e, None])
            if ctx.with_entropy and grad_ent is not None:
                dz -= p * (logp_all + ent[s:e, None]) * grad_ent[s:e, None]
            dz = (dz / t).to(mm)
            if grad_h is not None:
                grad_h[s:e] = (dz @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (dz.t() @ hc).float()
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 2048, with_entropy: bool = False):
    """log p(labels) and optionally entropy, per token, float32.

    hidden `[..., H]`, weight `[V, H]`, labels `[...]` (int64, valid ids everywhere: mask
    afterwards) -> (logprobs `[...]`, entropy `[...]` or None).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _ChunkedLogprob.apply(h, weight, labels.reshape(-1).long(), float(temperature),
                                      int(chunk_size), bool(with_entropy), tuple(labels.shape))
    return logp, (ent if with_entropy else None)
