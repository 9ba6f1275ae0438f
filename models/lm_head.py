"""Token log-probabilities (and entropy, and the sum of squared probabilities) straight from
hidden states, chunked over tokens.

`logits = hidden @ W.T / temperature` for `T` tokens and a 150k vocabulary is a `[T, V]`
float32 tensor of several GB, kept alive for backward by the naive
`log_softmax(...).gather(...)`. Here the forward computes logits one chunk of tokens at a
time and keeps only the per-token log-sum-exp; the backward recomputes each chunk's logits
and turns them into gradients for the hidden states and the weight, one chunk of logits alive
at a time. On CUDA, Triton kernels (`models/lm_head_triton.py`) read a chunk's logits once in
the matmul dtype and write its gradient over them: the extra memory is that one `[chunk, V]`
block. The PyTorch path (CPU, or `MESHPPO_LM_HEAD=torch`; the reference) makes a few float32
copies of it.

Gradients, with z = logits / temperature, p = softmax(z), y the label:
  d logp_y / dz = onehot(y) - p
  d H / dz      = -p * (log p + H)          (H = -sum p log p)
With a soft cap (`softcap`, Gemma 2's final_logit_softcapping) the logits are capped before the temperature,
z = cap·tanh(logits / cap) / temperature, as transformers' model caps its logits and verl divides them by the
temperature; the gradients above then take the factor d cap·tanh(l / cap) / dl = 1 - tanh²(l / cap).
The sum of squared probabilities sum p^2 = exp(logsumexp(2z) - 2 logsumexp(z)) (the
optimal-token-baseline estimators' input) is forward-only: no gradient flows through it.
"""

from __future__ import annotations

import torch

from models.attention import soft_cap
from models.triton_support import path_choice, triton_usable


def _use_triton(t: torch.Tensor) -> bool:
    """The Triton kernels for CUDA tensors when triton is importable. `MESHPPO_LM_HEAD=torch`
    forces the PyTorch path; `=triton` forces the kernels, on CPU tensors too (tests run them
    there under `TRITON_INTERPRET=1`)."""
    choice = path_choice("MESHPPO_LM_HEAD")
    if choice != "auto":
        return choice == "triton"
    return triton_usable(t.device)


def _fp32_scaled(logits, inv_temp: float, softcap: float | None = None):
    x = soft_cap(logits.float(), softcap)
    return x if inv_temp == 1.0 else x * inv_temp


def torch_logit_stats(logits, labels, inv_temp: float, lse, logp, ent=None, sps=None, softcap: float | None = None):
    """The PyTorch reference of `lm_head_triton.logit_stats` (same arguments and outputs)."""
    x = _fp32_scaled(logits, inv_temp, softcap)
    lse.copy_(torch.logsumexp(x, dim=-1))
    logp.copy_(x.gather(-1, labels[:, None]).squeeze(-1) - lse)
    if ent is not None:
        ent.copy_(lse - (torch.softmax(x, dim=-1) * x).sum(-1))
    if sps is not None:
        sps.copy_(torch.exp(torch.logsumexp(2 * x, dim=-1) - 2 * lse))


def torch_logit_grad(logits, labels, inv_temp: float, lse, grad_logp, ent=None, grad_ent=None,
                     softcap: float | None = None):
    """The PyTorch reference of `lm_head_triton.logit_grad_`; returns the gradient in the
    logits' dtype, a new tensor (the kernel writes it over `logits`)."""
    log_p = _fp32_scaled(logits, inv_temp, softcap) - lse[:, None]
    p = log_p.exp()
    # d/dz of (g_logp * logp_y): g * (onehot - p)
    dx = -p * grad_logp[:, None]
    dx.scatter_add_(-1, labels[:, None], grad_logp[:, None])
    if grad_ent is not None:
        dx -= p * (log_p + ent[:, None]) * grad_ent[:, None]
    if softcap:
        dx *= 1 - torch.tanh(logits.float() / softcap) ** 2
    return (dx if inv_temp == 1.0 else dx * inv_temp).to(logits.dtype)


def _row_ops(use_triton: bool):
    """(logit_stats, logit_grad) of the chosen path."""
    if use_triton:
        from models import lm_head_triton

        return lm_head_triton.logit_stats, lm_head_triton.logit_grad_
    return torch_logit_stats, torch_logit_grad


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, with_entropy, with_sum_pi_squared, out_shape,
                softcap):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        sps = torch.empty(n if with_sum_pi_squared else 0, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        use_triton = _use_triton(hidden)
        logit_stats, _ = _row_ops(use_triton)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            # The matmul runs in the weights' dtype (bf16 under mixed precision: tensor cores,
            # fp32 accumulation); everything after it in fp32.
            z = hidden[s:e].to(weight.dtype) @ weight.t()
            logit_stats(z, labels[s:e], 1.0 / temperature, lse[s:e], logp[s:e], ent[s:e] if with_entropy else None,
                        sps[s:e] if with_sum_pi_squared else None, softcap)
            del z  # before the next chunk's logits are allocated: one [chunk, V] block at a time
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.use_triton, ctx.softcap = use_triton, softcap
        # Outputs are fresh tensors in their final shape, not views: FSDP2 hooks a module's
        # outputs for backward, and a view would bypass that hook. The copy is [tokens] floats.
        sps = sps.reshape(out_shape).clone() if with_sum_pi_squared else sps
        ctx.mark_non_differentiable(sps)
        return logp.reshape(out_shape).clone(), (ent.reshape(out_shape).clone() if with_entropy else ent), sps

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, _grad_sps):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        grad_logp = grad_logp.reshape(-1)
        grad_ent = grad_ent.reshape(-1) if ctx.with_entropy and grad_ent is not None else None
        _, logit_grad = _row_ops(ctx.use_triton)
        cs = ctx.chunk_size
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        mm = weight.dtype  # matmuls in the weights' dtype, as in forward; accumulation in fp32
        for s in range(0, hidden.shape[0], cs):
            e = min(s + cs, hidden.shape[0])
            hc = hidden[s:e].to(mm)
            dz = logit_grad(hc @ weight.t(), labels[s:e], 1.0 / ctx.temperature, lse[s:e], grad_logp[s:e],
                            *((ent[s:e], grad_ent[s:e]) if grad_ent is not None else (None, None)), ctx.softcap)
            if grad_h is not None:
                grad_h[s:e] = (dz @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (dz.t() @ hc).float()
            del dz  # as in forward
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 2048, with_entropy: bool = False,
                           with_sum_pi_squared: bool = False, softcap: float | None = None):
    """log p(labels) and optionally entropy, per token, float32.

    hidden `[..., H]`, weight `[V, H]`, labels `[...]` (int64, valid ids everywhere: mask
    afterwards) -> (logprobs `[...]`, entropy `[...]` or None), and with `with_sum_pi_squared` a
    third output, sum_v p_v^2 `[...]` of the same softmax (forward-only: not differentiable).
    `temperature == 0` means greedy decoding, whose tokens are scored at temperature 1, as the
    engine reports them. `softcap` (None: none): the logits are cap·tanh(logits / cap) before the
    temperature (Gemma 2's final_logit_softcapping).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        temperature = 1.0
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent, sps = _ChunkedLogprob.apply(h, weight, labels.reshape(-1).long(), float(temperature), int(chunk_size),
                                           bool(with_entropy), bool(with_sum_pi_squared), tuple(labels.shape),
                                           None if softcap is None else float(softcap))
    if with_sum_pi_squared:
        return logp, (ent if with_entropy else None), sps
    return logp, (ent if with_entropy else None)
