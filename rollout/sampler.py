"""Sampling on the device, over a vocab-parallel LM head, without a full-vocabulary softmax.

Sampling is an exponential race (Gumbel-max): with `s_i = logit_i / T` and independent
uniforms `u_i`, `argmax_i s_i - log(-log u_i)` is distributed as `softmax(s)`. Each rank
races over its vocabulary shard and reports `[best score, its token, its s, max s, sum exp(s - max)]`
per vocabulary chunk ("partials", `[R, P, 5]` float32 with the token id bit-cast); the ranks
exchange only these, and `combine_partials` picks the winner and the log-normaliser.
Greedy (T = 0) is the same race over `s = logit` (T = 1) with no noise term at all: the
score is selected as `s` itself, not computed as `s + 0 * noise`, so it is an exact argmax.

The uniforms are counter-based: `u = hash(key of the sample, position of the token,
global vocabulary index)`, so a token does not depend on the batch it was computed in, on
preemption, or on the TP degree. `uniform_from_bits` maps the hash into (0, 1) exactly
(never 0 or 1, so the noise is always finite); `gumbel_noise` is the PyTorch definition, and
the Triton kernel computes the same integers and the same uniforms. On CUDA the kernel takes
the noise's outer log, `-log(E)` with `E = -log(u)`, through the hardware approximation (an
error of ~1e-7 absolute: a token can differ from the reference's only at a near-tie of the
race); `E` itself is exact, as it must be near u = 1.

top-k / top-p become one threshold per row on `s` (the k-th largest value; the smallest
value inside the nucleus); tokens below it are left out of the race. Ties at the threshold
are all kept. The log-probability returned is always that of the untruncated `softmax(s)`
(see `rollout.config`).
"""

from __future__ import annotations

import torch

from rollout.parallel import TPGroup

_M32 = 0xFFFFFFFF
NUM_PARTIAL_FIELDS = 5


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`x * c mod 2**32` for int64 `x` in [0, 2**32), without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32_t(x: torch.Tensor) -> torch.Tensor:
    """`rollout.sequence.mix32` on an int64 tensor of 32-bit values."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row hash keys `[R]` from the sample keys (int32 bit patterns) and token positions."""
    keys = keys.long() & _M32
    k1 = mix32_t(keys ^ mix32_t((positions.long() + 0x68E31DA4) & _M32))
    k2 = mix32_t((k1 + 0x1B56C4E9) & _M32)
    return k1, k2


def uniform_from_bits(h: torch.Tensor) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), float32, from 32-bit hashes `h` (int64 tensor): `(k + 1/2) 2**-23`
    with `k = h >> 9`, the midpoints of 2**23 equal bins.

    Every step is exact in float32, so `2**-24 <= u <= 1 - 2**-24` holds by construction: `k < 2**23`
    converts exactly; `k + 1/2 < 2**23` needs 24 significant bits, which float32 has; the scale is a
    power of two. Hence `-log(-log u)` lies in [-2.81, 16.64]. (With 24 bits, `k + 1/2` needs 25: for
    `k = 2**24 - 1` the sum rounds up to `2**24`, `u` to 1 and the noise to +inf.)
    """
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def uniform_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), `[R, len(vocab_ids)]` float32, from the hash of (key, position, vocabulary id)."""
    k1, k2 = row_keys(keys, positions)
    return uniform_from_bits(mix32_t(mix32_t(vocab_ids.long()[None, :] ^ k1[:, None]) + k2[:, None]))


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise `-log(-log u)`, `[R, V]` float32; always finite."""
    return -torch.log(-torch.log(uniform_noise(keys, positions, vocab_ids)))


def sample_partials_ref(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                        inv_temp: torch.Tensor, noise_scale: torch.Tensor, thresh: torch.Tensor | None,
                        vocab_start: int) -> torch.Tensor:
    """Partials `[R, 1, 5]` of local logits `[R, Vl]` (reference; the Triton kernel splits Vl).

    `noise_scale` 0 (greedy) races `s` itself: the noise is left out, not multiplied by zero.
    """
    s = logits.float() * inv_temp
    vocab_ids = torch.arange(vocab_start, vocab_start + logits.shape[1], device=logits.device)
    score = torch.where(noise_scale > 0, s + gumbel_noise(keys, positions, vocab_ids) * noise_scale, s)
    if thresh is not None:
        score = torch.where(s >= thresh[:, None], score, float("-inf"))
    best, idx = score.max(-1)
    m = s.max(-1).values
    parts = torch.stack([best, torch.zeros_like(best), s.gather(1, idx[:, None]).squeeze(1), m,
                         torch.exp(s - m[:, None]).sum(-1)], dim=-1)
    parts.view(torch.int32)[:, 1] = (idx + vocab_start).int()
    return parts[:, None, :]


def combine_partials(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, P, 5]` partials (P = TP ranks x vocab chunks, in vocabulary order) -> tokens `[R]` int64, log-probs `[R]`.

    Ties in the race go to the lowest vocabulary index, like `torch.argmax`.
    """
    j = parts[..., 0].argmax(-1, keepdim=True)
    tokens = parts.view(torch.int32)[..., 1].gather(-1, j).squeeze(-1).long()
    s_tok = parts[..., 2].gather(-1, j).squeeze(-1)
    m, z = parts[..., 3], parts[..., 4]
    mmax = m.max(-1, keepdim=True).values
    lse = mmax.squeeze(-1) + torch.log((z * torch.exp(m - mmax)).sum(-1))
    return tokens, s_tok - lse


def truncation_threshold(s: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row threshold `[R]` on full-vocabulary scaled logits `s [R, V]` for top-k then top-p."""
    v = s.shape[-1]
    k = min(top_k, v) if top_k > 0 else v
    if top_p >= 1.0:
        return torch.topk(s, k, dim=-1).values[:, -1].contiguous()
    srt = torch.sort(s, dim=-1, descending=True).values
    if k < v:
        srt = srt.clone()
        srt[:, k:] = float("-inf")
    probs = torch.softmax(srt, dim=-1)
    exclusive = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    count = (exclusive < top_p).sum(-1).clamp(min=1, max=k)
    return srt.gather(1, (count - 1)[:, None]).squeeze(1).contiguous()


class Sampler:
    """TP-aware sampling of local logits `[R, V/tp]` into tokens `[R]` and log-probs `[R]`.

    `inv_temp` and `noise_scale` are 0-d device tensors (1/T and 1, or 1 and 0 for greedy)
    so that a captured CUDA graph serves every temperature; greedy selects the noise-free
    score on the device (`torch.where`), so no host branch is baked into a graph.
    """

    def __init__(self, tp: TPGroup, vocab_size: int, device):
        self.tp = tp
        self.vocab_local = vocab_size // tp.size
        self.vocab_start = tp.rank * self.vocab_local
        self.inv_temp = torch.ones((), dtype=torch.float32, device=device)
        self.noise_scale = torch.zeros((), dtype=torch.float32, device=device)
        self.top_k, self.top_p = -1, 1.0

    def set_params(self, temperature: float, top_k: int, top_p: float) -> None:
        greedy = temperature == 0.0
        self.inv_temp.fill_(1.0 if greedy else 1.0 / temperature)
        self.noise_scale.fill_(0.0 if greedy else 1.0)
        self.top_k, self.top_p = (-1, 1.0) if greedy else (top_k, top_p)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def truncation(self) -> tuple[int, float] | None:
        """The static part of the sampling parameters, (top_k, top_p), or None without truncation.

        The threshold's shapes (top-k's k) and constants (top-p's p) are baked into a captured
        decode step, so the runner keeps one graph per batch size and value of this key.
        """
        return (self.top_k, self.top_p) if self.truncates else None

    def threshold(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The top-k / top-p threshold `[R]`, identical on every rank; None without truncation."""
        if not self.truncates:
            return None
        s = logits.float() * self.inv_temp
        if self.tp.size > 1:
            if self.top_p >= 1.0:  # top-k alone: the global top-k is among the ranks' local top-k
                k = min(self.top_k, s.shape[1])
                s = self.tp.all_gather(torch.topk(s, k, dim=-1).values)  # [tp, R, k]
                s = s.permute(1, 0, 2).reshape(s.shape[1], -1)
            else:
                s = self.tp.all_gather(s).permute(1, 0, 2).reshape(s.shape[0], -1)  # full vocabulary
        return truncation_threshold(s, self.top_k, self.top_p)

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ops,
                 thresh: torch.Tensor | None = None, num_splits: int = 1, out=None):
        """logits `[R, Vl]`, keys `[R]` int32, positions `[R]` (index of the token being sampled)
        -> tokens `[R]` int64 and log-probs `[R]` float32 (written into `out`, a pair, when given)."""
        parts = ops.sample_partials(logits, keys, positions, self.inv_temp, self.noise_scale, thresh,
                                    self.vocab_start, num_splits)
        if self.tp.size > 1:
            parts = self.tp.all_gather(parts)  # [tp, R, S, 5]
            parts = parts.permute(1, 0, 2, 3).reshape(parts.shape[1], -1, NUM_PARTIAL_FIELDS)
        return ops.combine_partials(parts, out)
