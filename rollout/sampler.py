"""Sampling on the device, over a vocab-parallel LM head, without a full-vocabulary softmax.

Sampling is an exponential race (Gumbel-max): with `s_i = logit_i / T` and independent
uniforms `u_g`, `argmax_g log(sum_{i in g} exp(s_i)) - log(-log u_g)` picks a group g of
tokens with probability proportional to its softmax mass. The vocabulary is raced in groups
of `race_group(V/tp)` consecutive ids (16 where the shard allows, else 1), and the token
inside the winning group is drawn by inverse CDF with a second uniform: together, token i
with probability `softmax(s)_i`. Groups cost one pair of hashes and three logarithms per 16
tokens, where a race of single tokens costs them per token; with groups of 1 the race is
the classic per-token Gumbel-max.

Each rank races over its vocabulary shard and reports `[best score, its token, its s, max s,
sum exp(s - max)]` per vocabulary chunk ("partials", `[R, P, 5]` float32 with the token id
bit-cast); the ranks exchange only these, and `combine_partials` picks the winner and the
log-normaliser. Greedy (T = 0) races `s = logit` (T = 1) with no noise term at all: a group's
score is its largest `s`, its token the first that reaches it, so the result is an exact argmax.

The uniforms are counter-based: `u = hash(key of the sample, position of the token, global
group index)`, so a token does not depend on the batch it was computed in, on preemption,
or on the TP degree (among the degrees whose shards give the same group size).
`uniform_from_bits` maps the hash into (0, 1) exactly (never 0 or 1, so the noise is always
finite and the inverse CDF's target is below the group's mass); `group_uniforms` is the
PyTorch definition, and the Triton kernel computes the same integers and the same uniforms.
On CUDA the kernel takes the noise's outer log, `-log(E)` with `E = -log(u)`, through the
hardware approximation (an error of ~1e-7 absolute: a token can differ from the reference's
only at a near-tie of the race); `E` itself is exact, as it must be near u = 1.

top-k / top-p become one threshold per row on `s` (the k-th largest value; the smallest
value inside the nucleus); tokens below it have no mass in the race (a group without such
tokens cannot win). Ties at the threshold are all kept. The log-probability returned is
always that of the untruncated `softmax(s)` (see `rollout.config`).

A soft-capped model's (Gemma 2's final_logit_softcapping) `s` is `cap·tanh(logit / cap) / T`, the cap rounded in
the logits' dtype as `models.attention.soft_cap` rounds it: the engine's LM head returns the logits uncapped, and the
race caps each logit where it reads it (`sample_partials_ref`; the Triton kernel's `SOFTCAP`), so the cap costs no
pass over `[R, V]` of its own. With top-k / top-p the threshold and the race must compare the very same values (a
capped value one ulp off the threshold's would drop a token from the set, the only token of a set of one), so
`Sampler.sample` caps the logits once in PyTorch, takes the threshold on them and races them uncapped (the
threshold's own top-k or sort over the vocabulary costs more than that pass).
"""

from __future__ import annotations

import math

import torch

from models.attention import soft_cap
from models.scan import cumsum
from rollout.parallel import TPGroup, vocab_shard

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


RACE_GROUP = 16  # tokens per group of the race (`race_group`)
_PICK_SALT = 0x9E3779B9  # the pick's hash input: group ids (< 2**31) never reach it, so it hashes apart from every race input


def race_group(vocab_local: int) -> int:
    """Tokens per group of the race over a vocabulary shard of `vocab_local` ids: RACE_GROUP when it
    divides the shard (groups never straddle two ranks), else 1."""
    return RACE_GROUP if vocab_local % RACE_GROUP == 0 else 1


def group_uniforms(keys: torch.Tensor, positions: torch.Tensor,
                   group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The race's and the pick's uniforms in (0, 1), `[R, len(group_ids)]` float32 each, from two
    hashes of (key, position, global group index)."""
    k1, k2 = row_keys(keys, positions)
    x = group_ids.long()[None, :] ^ k1[:, None]
    race = mix32_t(mix32_t(x) + k2[:, None])
    pick = mix32_t(mix32_t(x ^ _PICK_SALT) + k2[:, None])
    return uniform_from_bits(race), uniform_from_bits(pick)


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise `-log(-log u)` of the race, `[R, len(group_ids)]` float32; always finite."""
    return -torch.log(-torch.log(group_uniforms(keys, positions, group_ids)[0]))


def sample_partials_ref(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                        inv_temp: torch.Tensor, noise_scale: torch.Tensor, thresh: torch.Tensor | None,
                        vocab_start: int, group: int = 1, softcap: float | None = None) -> torch.Tensor:
    """Partials `[R, 1, 5]` of local logits `[R, Vl]` raced in groups of `group` ids (reference; the
    Triton kernel splits Vl). `vocab_start` and Vl are multiples of `group`. `softcap`: the logits'
    soft cap (`models.attention.soft_cap`, in their dtype; None: none), taken before the temperature;
    `thresh` is on the capped `s`.

    `noise_scale` 0 (greedy) races each group's largest `s` itself: no noise term, not one times zero.
    """
    s = soft_cap(logits, softcap).float() * inv_temp
    r, v = s.shape
    sg = s.view(r, v // group, group)
    mg = sg.max(-1).values  # [R, groups]
    w = torch.exp(sg - mg[..., None])
    if thresh is not None:
        w = torch.where(sg >= thresh[:, None, None], w, 0.0)
    cw = cumsum(w, -1)
    mass = cw[..., -1]  # in units of exp(mg); 0 for a group without an allowed token
    first = vocab_start // group
    u_race, u_pick = group_uniforms(keys, positions, torch.arange(first, first + v // group, device=s.device))
    j = torch.arange(group, device=s.device)
    # Inverse CDF: the first token whose cumulative mass exceeds u * mass (u < 1, so one does but
    # for rounding; then the last allowed token; 0 in a group with none, which cannot win).
    pick = torch.minimum((cw <= (u_pick * mass)[..., None]).sum(-1),
                         torch.where(w > 0, j, 0).max(-1).values)
    noisy = mg + torch.log(mass) - torch.log(-torch.log(u_race)) * noise_scale
    allowed = mg if thresh is None else torch.where(mg >= thresh[:, None], mg, float("-inf"))
    score = torch.where(noise_scale > 0, noisy, allowed)
    within = torch.where(noise_scale > 0, pick, (sg == mg[..., None]).int().argmax(-1))  # greedy: first max
    best, g = score.max(-1)
    idx = g * group + within.gather(1, g[:, None]).squeeze(1)
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
    exclusive = cumsum(probs, -1) - probs  # mass strictly before each token
    count = (exclusive < top_p).sum(-1).clamp(min=1, max=k)
    return srt.gather(1, (count - 1)[:, None]).squeeze(1).contiguous()


class Sampler:
    """TP-aware sampling of local logits `[R, ceil(V/tp)]` into tokens `[R]` and log-probs `[R]`.

    A shard padded past the vocabulary (`vocab_shard`) races, and sums the log-normaliser over, its real
    ids alone, and its padding is below every threshold: a padded id is never drawn and holds no mass.
    The race groups divide both the shard and the vocabulary, so that they never hold padding.

    `inv_temp` and `noise_scale` are 0-d device tensors (1/T and 1, or 1 and 0 for greedy; `inv_temp` also divided
    by `logits_scaling`, Granite's, which divides its logits before the temperature)
    so that a captured CUDA graph serves every temperature; greedy selects the noise-free
    score on the device (`torch.where`), so no host branch is baked into a graph.

    `softcap` (Gemma 2's final_logit_softcapping; None: none) caps the logits it is given (uncapped, as
    `EngineModel.logits` returns them) before the temperature, for the race, the threshold and the log-probs alike.
    """

    def __init__(self, tp: TPGroup, vocab_size: int, device, logits_scaling: float = 1.0,
                 softcap: float | None = None):
        self.tp, self.logits_scaling, self.softcap = tp, logits_scaling, softcap
        self.vocab_start, self.vocab_local, self.vocab_real = vocab_shard(vocab_size, tp.rank, tp.size)
        self.group = race_group(math.gcd(self.vocab_local, vocab_size))
        self.inv_temp = torch.ones((), dtype=torch.float32, device=device)
        self.noise_scale = torch.zeros((), dtype=torch.float32, device=device)
        self.top_k, self.top_p = -1, 1.0

    def set_params(self, temperature: float, top_k: int, top_p: float) -> None:
        greedy = temperature == 0.0
        self.inv_temp.fill_((1.0 if greedy else 1.0 / temperature) / self.logits_scaling)
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
        """The top-k / top-p threshold `[R]` on the capped, scaled scores `s` of uncapped `logits`, identical on
        every rank; None without truncation."""
        if not self.truncates:
            return None
        return self._threshold(soft_cap(logits, self.softcap))

    def _threshold(self, capped: torch.Tensor) -> torch.Tensor:
        """`threshold` of logits `capped` already."""
        s = capped.float() * self.inv_temp
        if self.vocab_real < self.vocab_local:  # a padded shard (`s` is a new tensor: the logits stay)
            s[:, self.vocab_real:] = float("-inf")
        if self.tp.size > 1:
            if self.top_p >= 1.0:  # top-k alone: the global top-k is among the ranks' local top-k
                k = min(self.top_k, s.shape[1])
                s = self.tp.all_gather(torch.topk(s, k, dim=-1).values)  # [tp, R, k]
                s = s.permute(1, 0, 2).reshape(s.shape[1], -1)
            else:
                s = self.tp.all_gather(s).permute(1, 0, 2).reshape(s.shape[0], -1)  # full vocabulary
        return truncation_threshold(s, self.top_k, self.top_p)

    def sample(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ops, num_splits: int = 1,
               out=None):
        """`self(logits, ..., self.threshold(logits), ...)` with the cap taken once: in the race where nothing
        truncates, else in PyTorch before the threshold, whose values the race then reads (the module docstring)."""
        if not self.truncates:
            return self._race(logits, keys, positions, ops, None, self.softcap, num_splits, out)
        capped = soft_cap(logits, self.softcap)
        return self._race(capped, keys, positions, ops, self._threshold(capped), None, num_splits, out)

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ops,
                 thresh: torch.Tensor | None = None, num_splits: int = 1, out=None):
        """logits `[R, Vl]` (uncapped), keys `[R]` int32, positions `[R]` (index of the token being sampled),
        `thresh` a threshold on the capped `s` (`threshold(logits)`) or None -> tokens `[R]` int64 and log-probs
        `[R]` float32 (written into `out`, a pair, when given)."""
        if thresh is not None and self.softcap:  # the race compares the values the threshold was taken on
            return self._race(soft_cap(logits, self.softcap), keys, positions, ops, thresh, None, num_splits, out)
        return self._race(logits, keys, positions, ops, thresh, self.softcap, num_splits, out)

    def _race(self, logits, keys, positions, ops, thresh, softcap, num_splits, out):
        parts = ops.sample_partials(logits[:, :self.vocab_real], keys, positions, self.inv_temp, self.noise_scale, thresh,
                                    self.vocab_start, num_splits, self.group, softcap)
        if self.tp.size > 1:
            parts = self.tp.all_gather(parts)  # [tp, R, S, 5]
            parts = parts.permute(1, 0, 2, 3).reshape(parts.shape[1], -1, NUM_PARTIAL_FIELDS)
        return ops.combine_partials(parts, out)
