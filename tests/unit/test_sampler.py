"""Sampling maths: counter-based noise, the exponential race, partial combination, top-k / top-p;
goodness of fit of the drawn tokens to softmax(logits / T); the noise at the hash's extremes.

The fit and extreme checks are shared: tests/multiproc/test_sampler_tp.py runs them at TP 2,
tests/unit/test_triton_kernels.py (extremes) and tests/gpu/test_engine_gpu.py on the Triton kernel.
"""

import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.attention import soft_cap
from rollout.ops import TorchOps
from rollout.parallel import TPGroup
from rollout.sampler import (RACE_GROUP, Sampler, combine_partials, group_uniforms, gumbel_noise, mix32_t,
                             race_group, sample_partials_ref, truncation_threshold, uniform_from_bits)
from rollout.sequence import mix32, sequence_key
from tests.unit import test_engine

aten = torch.ops.aten

# Goodness of fit. 12 tokens with geometric probabilities (ratio e^-0.65 per rank; shuffled, so
# that rank and token id differ); one sample key, one draw per position, as the engine draws a
# sample's tokens. With 2**18 draws, a sampler that draws 1 time in 110 a uniform token of the
# allowed set (issue 14) has a chi-square noncentrality of 189 or more in every case, against a
# critical value below 49 at P_REJECT: it passes with probability below 1e-13. The draws are
# counter-based hashes, the same integers on every machine, so each p-value is fixed; a last-bit
# difference of log / exp could only flip a near-tie, moving the statistic negligibly. A correct
# sampler falls below P_REJECT by chance with probability 1e-6 per case.
LOGITS = -0.65 * torch.tensor([8, 0, 5, 9, 7, 4, 2, 10, 3, 1, 11, 6], dtype=torch.float32)
# (temperature, top_k, top_p). The first ignores every option: its draws serve as a biased sampler
# for the others. Each top-p is at least 8e-4 away from every cumulative mass, so float32 and
# float64 agree on the nucleus.
CASES = [(1.0, -1, 1.0), (0.7, 10, 1.0), (1.3, -1, 1.0), (1.0, -1, 0.996), (1.1, 11, 0.998)]
# The same checks over 32 tokens (ratio e^-0.2), raced in two groups of 16 (LOGITS: groups of 1);
# each top-p is at least 3e-3 away from every cumulative mass.
LOGITS32 = -0.2 * torch.tensor([12, 31, 25, 28, 19, 29, 9, 10, 6, 27, 4, 2, 3, 20, 24, 22, 14, 13, 15, 26, 18, 16, 23,
                                11, 21, 5, 8, 1, 17, 0, 7, 30], dtype=torch.float32)
CASES32 = [(1.0, -1, 1.0), (0.7, 20, 1.0), (1.3, -1, 1.0), (1.0, -1, 0.9), (1.1, 24, 0.95)]
FITS = [(LOGITS, c) for c in CASES] + [(LOGITS32, c) for c in CASES32]
FIT_IDS = [f"V{len(v)}-T{c[0]}-k{c[1]}-p{c[2]}" for v, c in FITS]
N_DRAWS = 1 << 18
DRAW_KEY = sequence_key(14, 0, 0)
P_REJECT = 1e-6

_one_thread = test_engine._one_thread  # autouse fixture: the hash's int64 ops run faster on one thread

# The hash's outermost bins, found by a search over keys at position 7: token 10 of TOP_KEY hashes to
# 4294967142 >= 2**32 - 256, which the former 24-bit uniform rounded to exactly 1 (infinite noise,
# NaN in greedy); token 0 of LOW_KEY hashes to 66 < 2**9.
EXTREME_POS = 7
TOP_KEY, TOP_TOKEN, TOP_HASH = 730101, 10, 4294967142
LOW_KEY, LOW_TOKEN, LOW_HASH = 1775441, 0, 66
# Groups of 16: the race hashes the group index where single tokens hash their id, so TOP_KEY's
# largest race noise falls on group 10 and LOW_KEY's smallest on group 0. The pick's top bin, from a
# search as above: group 7 of PICK_KEY at position 7 hashes to 4294966900 >= 2**32 - 512.
PICK_KEY, PICK_GROUP, PICK_HASH = 383321, 7, 4294966900


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


def test_group_uniforms_are_uniform_independent_and_deterministic():
    keys = torch.tensor([sequence_key(0, i, 0) for i in range(64)], dtype=torch.int64)
    pos = torch.arange(64)
    groups = torch.arange(2048)
    race, pick = group_uniforms(keys, pos, groups)
    for u in (race, pick):
        assert u.min() > 0 and u.max() < 1
        assert abs(u.mean().item() - 0.5) < 0.003
        hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
        assert (hist - 1 / 16).abs().max() < 0.003
    assert torch.equal(race, group_uniforms(keys, pos, groups)[0])
    # The pick is not a function of the race's bin, and another position or key gives unrelated noise.
    other = group_uniforms(keys, pos + 1, groups)[0]
    for a, b in ((race, pick), (race, other)):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01
    joint = torch.histc((race * 4).floor() * 4 + (pick * 4).floor(), bins=16, min=0, max=16) / race.numel()
    assert (joint - 1 / 16).abs().max() < 0.003


def test_race_group_divides_the_shard():
    assert race_group(151936) == race_group(151936 // 8) == RACE_GROUP
    assert race_group(96) == 16 and race_group(48) == 16 and race_group(12) == 1 and race_group(211) == 1


def _grouped_race_f64(s, keys, positions, thresh, group):
    """`sample_partials_ref`'s tokens, row by row in float64 loops: the independent check of the grouped race."""
    race, pick = group_uniforms(keys, positions, torch.arange(s.shape[1] // group))
    tokens = []
    for r in range(s.shape[0]):
        best, token = -float("inf"), None
        for g in range(s.shape[1] // group):
            vals = s[r, g * group:(g + 1) * group].double().tolist()
            top = max(vals)
            w = [math.exp(x - top) if thresh is None or x >= thresh[r] else 0.0 for x in vals]
            if sum(w) == 0:
                continue
            score = top + math.log(sum(w)) - math.log(-math.log(race[r, g].item()))
            if score > best:
                acc, target = 0.0, pick[r, g].item() * sum(w)
                choice = next(i for i, wi in enumerate(w) if (acc := acc + wi) > target)
                best, token = score, g * group + choice
        tokens.append(token)
    return torch.tensor(tokens)


@pytest.mark.parametrize("group", [1, 16])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("top_k", [-1, 9])
def test_partials_over_chunks_equal_one_chunk(temperature, group, top_k):
    """Splitting the vocabulary (TP ranks, kernel splits) changes nothing; the race equals its
    definition (per-token Gumbel-max for groups of 1, a float64 loop for groups of 16)."""
    torch.manual_seed(1)
    r, v = 7, 96
    logits = torch.randn(r, v) * 3
    logits[0, 5] = logits[0, 70] = logits[0].max() + 1  # a tie: lowest index wins, like argmax
    keys = torch.tensor([sequence_key(1, i, 0) for i in range(r)], dtype=torch.int64)
    pos = torch.arange(r) + 10
    inv_t, noise = _scalars(temperature)
    s = logits * inv_t
    th = truncation_threshold(s, top_k, 1.0) if top_k > 0 else None
    whole = combine_partials(sample_partials_ref(logits, keys, pos, inv_t, noise, th, 0, group))
    chunks = [sample_partials_ref(logits[:, a:a + 32], keys, pos, inv_t, noise, th, a, group) for a in (0, 32, 64)]
    split = combine_partials(torch.cat(chunks, dim=1))
    assert torch.equal(whole[0], split[0])
    assert torch.allclose(whole[1], split[1], atol=1e-6)
    assert torch.allclose(whole[1], torch.log_softmax(s, -1).gather(1, whole[0][:, None]).squeeze(1), atol=1e-6)
    if temperature == 0:
        assert torch.equal(whole[0], logits.argmax(-1))
        assert whole[0][0].item() == 5
    elif group == 1:
        score = s + gumbel_noise(keys, pos, torch.arange(v))
        if th is not None:
            score = torch.where(s >= th[:, None], score, float("-inf"))
        assert torch.equal(whole[0], score.argmax(-1))
    else:
        assert torch.equal(whole[0], _grouped_race_f64(s, keys, pos, th, group))
    if th is not None:
        assert (s.gather(1, whole[0][:, None]).squeeze(1) >= th).all()


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


def key_rows(key: int, n: int, device="cpu") -> torch.Tensor:
    """`[n]` copies of a 32-bit sample key as the engine passes it: int32 bit patterns."""
    return torch.full((n,), key - (1 << 32) if key >= 1 << 31 else key, dtype=torch.int32, device=device)


def expected_probs(temperature: float, top_k: int, top_p: float, logits: torch.Tensor = LOGITS,
                   softcap: float | None = None) -> torch.Tensor:
    """float64 softmax(logits / T) (of the logits soft-capped by `softcap`) restricted to the top-k / top-p set
    (brute-force threshold)."""
    s = soft_cap(logits, softcap).double() / temperature
    return torch.softmax(s.masked_fill(s < _brute_threshold(s, top_k, top_p), float("-inf")), -1)


def draw_tokens(temperature: float, top_k: int, top_p: float, n: int = N_DRAWS, tp: TPGroup | None = None,
                ops=TorchOps, device="cpu", num_splits: int = 1, logits: torch.Tensor = LOGITS,
                softcap: float | None = None):
    """Tokens and log-probs `[n]` drawn by `Sampler` (soft-capping the logits by `softcap`) from `logits`, over this
    rank's vocabulary shard."""
    tp = tp or TPGroup(None)
    sampler = Sampler(tp, len(logits), device, softcap=softcap)
    assert sampler.group == (16 if len(logits) == 32 else 1)
    sampler.set_params(temperature, top_k, top_p)
    shard = logits.to(device).chunk(tp.size)[tp.rank].expand(n, -1)
    keys = key_rows(DRAW_KEY, n, device)
    positions = torch.arange(n, dtype=torch.int32, device=device)
    return sampler(shard, keys, positions, ops, sampler.threshold(shard), num_splits)


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `tokens` as draws from `probs [V]`; 0 if a token of
    probability 0 was drawn."""
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    support = probs > 0
    if counts[~support].any():
        return 0.0
    expected = probs[support] * len(tokens)
    assert expected.min() >= 20, "too few expected draws of a token for the chi-square approximation"
    x2 = ((counts[support] - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64), x2 / 2).item()


def _extreme_race(ops, tp: TPGroup | None, device, num_splits: int, vocab: int):
    """A sampler over `vocab` tokens and `race(logits [R, vocab], keys [R], temperature)`: the tokens it
    draws at position EXTREME_POS, over this rank's shard."""
    tp = tp or TPGroup(None)
    sampler = Sampler(tp, vocab, device)

    def race(logits, keys, temperature):
        sampler.set_params(temperature, -1, 1.0)
        shard = logits.to(device).chunk(tp.size, dim=1)[tp.rank]
        keys = torch.tensor(keys, dtype=torch.int32, device=device)
        pos = torch.full_like(keys, EXTREME_POS)
        return sampler(shard, keys, pos, ops, None, num_splits)[0].tolist()

    return sampler, race


def check_extremes(ops, tp: TPGroup | None = None, device="cpu", num_splits: int = 1) -> None:
    """Greedy and sampling over 12 tokens where the noise is at its extremes: infinite or NaN noise
    at TOP_TOKEN would make it win, greedy or buried 40 below the others; LOW_TOKEN, at the
    smallest noise, must lose a flat race."""
    _, race = _extreme_race(ops, tp, device, num_splits, 12)

    peaked = torch.zeros(12)
    peaked[3] = 1.0
    assert race(peaked.expand(2, -1), [TOP_KEY, LOW_KEY], 0.0) == [3, 3]  # greedy: the argmax, whatever the noise
    flat, buried = torch.zeros(12), torch.zeros(12)
    buried[TOP_TOKEN] = -40.0  # finite noise (at most 16.64) cannot lift it past the others
    tokens = race(torch.stack([flat, buried, flat]), [TOP_KEY, TOP_KEY, LOW_KEY], 1.0)
    assert tokens[0] == TOP_TOKEN  # the largest noise of all wins a flat race
    assert tokens[1] != TOP_TOKEN and tokens[2] != LOW_TOKEN, tokens


def check_group_extremes(ops, tp: TPGroup | None = None, device="cpu", num_splits: int = 1) -> None:
    """The race in groups of 16 (192 tokens) at the hashes' extremes: greedy stays the argmax; TOP_KEY's
    largest race noise (group 10) wins a flat race unless buried, LOW_KEY's smallest (group 0) loses
    one; PICK_KEY's pick uniform of 1 - 2**-24 in group 7, whose last token has no mass (exp(-200)
    is 0 in float32), draws the group's last token with mass, never that one or the next group's."""
    sampler, race = _extreme_race(ops, tp, device, num_splits, 192)
    assert sampler.group == 16

    peaked = torch.zeros(192)
    peaked[3] = 1.0
    assert race(peaked.expand(2, -1), [TOP_KEY, LOW_KEY], 0.0) == [3, 3]
    flat, buried, last = torch.zeros(192), torch.zeros(192), torch.full((192,), -40.0)
    buried[160:176] = -40.0
    last[16 * PICK_GROUP:16 * PICK_GROUP + 15] = 0.0
    last[16 * PICK_GROUP + 15] = -200.0
    tokens = race(torch.stack([flat, buried, flat, last]), [TOP_KEY, TOP_KEY, LOW_KEY, PICK_KEY], 1.0)
    assert tokens[0] // 16 == 10 and tokens[1] // 16 != 10 and tokens[2] // 16 != 0, tokens
    assert tokens[3] == 16 * PICK_GROUP + 14, tokens


def _host_hash(key: int, position: int, vocab_id: int) -> int:
    """The race's hash in plain Python integers (`rollout.sampler.row_keys` / `group_uniforms`)."""
    k1 = mix32(key ^ mix32(position + 0x68E31DA4))
    k2 = mix32(k1 + 0x1B56C4E9)
    return mix32(mix32(vocab_id ^ k1) + k2)


def test_uniform_from_bits_is_exact_and_inside_the_unit_interval():
    h = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_bits(h)
    assert u.dtype == torch.float32 and ((u > 0) & (u < 1)).all(), u
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()
    assert torch.equal(u.double(), ((h >> 9).double() + 0.5) / 2**23)  # no rounding anywhere
    assert u.min().item() == 2**-24 and u.max().item() == 1 - 2**-24
    torch.testing.assert_close(g.double(), -torch.log(-torch.log(u.double())), atol=1e-4, rtol=0)
    assert abs(g.max().item() - 16.6355) < 1e-3 and abs(g.min().item() + 2.8116) < 1e-3


def test_noise_at_the_hash_extremes():
    assert _host_hash(TOP_KEY, EXTREME_POS, TOP_TOKEN) == TOP_HASH and TOP_HASH >> 9 == 2**23 - 1
    assert _host_hash(LOW_KEY, EXTREME_POS, LOW_TOKEN) == LOW_HASH and LOW_HASH >> 9 == 0
    keys = torch.tensor([TOP_KEY, LOW_KEY])
    pos = torch.full((2,), EXTREME_POS)
    assert torch.isfinite(gumbel_noise(keys, pos, torch.arange(12))).all()
    u = group_uniforms(keys, pos, torch.arange(12))[0]
    assert u[0, TOP_TOKEN].item() == 1 - 2**-24 and u[1, LOW_TOKEN].item() == 2**-24
    pick = group_uniforms(torch.tensor([PICK_KEY]), pos[:1], torch.arange(12))[1]
    assert pick[0, PICK_GROUP].item() == 1 - 2**-24 and PICK_HASH >> 9 == 2**23 - 1


def test_greedy_and_sampling_at_the_hash_extremes():
    check_extremes(TorchOps)
    check_group_extremes(TorchOps)


@functools.cache
def _draws(case, vocab: int):
    return draw_tokens(*case, logits=LOGITS32 if vocab == 32 else LOGITS)


@pytest.mark.parametrize("logits,case", FITS, ids=FIT_IDS)
def test_sampled_tokens_fit_the_truncated_softmax(logits, case):
    temperature, top_k, top_p = case
    probs = expected_probs(*case, logits=logits)
    tokens, logprobs = _draws(case, len(logits))
    assert chi_square_pvalue(tokens, probs) > P_REJECT
    assert torch.allclose(logprobs, torch.log_softmax(logits / temperature, -1)[tokens], atol=1e-6)


@pytest.mark.parametrize("logits,case", FITS, ids=FIT_IDS)
def test_chi_square_check_rejects_biased_samplers(logits, case):
    probs = expected_probs(*case, logits=logits)
    tokens = _draws(case, len(logits))[0].clone()
    g = torch.Generator().manual_seed(1)
    if len(logits) == len(LOGITS):
        # Issue 14's sampler: 1 draw in 110 a uniformly random token of the allowed set.
        support = probs.nonzero().squeeze(1)
        hit = torch.rand(len(tokens), generator=g) < 1 / 110
        tokens[hit] = support[torch.randint(len(support), (int(hit.sum()),), generator=g)]
    else:
        # A grouped race whose pick ignores the weights: a uniform allowed token of the winning group.
        for group in (0, 1):
            support = probs[16 * group:16 * (group + 1)].nonzero().squeeze(1) + 16 * group
            hit = tokens // 16 == group
            tokens[hit] = support[torch.randint(len(support), (int(hit.sum()),), generator=g)]
    assert chi_square_pvalue(tokens, probs) < P_REJECT
    # A sampler ignoring the temperature, top-k and top-p: the draws of the first case.
    if case != (1.0, -1, 1.0):
        assert chi_square_pvalue(_draws((1.0, -1, 1.0), len(logits))[0], probs) < P_REJECT


# A soft cap that flattens LOGITS (0 to -7.15) to 0 to -2.95 (Gemma 2's is 30, on logits of tens). Each top-p is at
# least 4e-3 away from every cumulative mass of the capped softmax.
CAP = 3.0
CAPPED_CASES = [(1.0, -1, 1.0), (0.7, 10, 1.0), (1.0, -1, 0.9), (0.7, 9, 0.95)]


@pytest.mark.parametrize("case", CAPPED_CASES)
def test_capped_draws_fit_the_softmax_of_the_capped_logits(case):
    """A sampler built with a soft cap and given the uncapped logits (as `EngineModel.logits` returns them) draws
    from softmax(cap·tanh(logits / cap) / T), truncated on those capped scores, and returns its log-probs; the draws
    reject the uncapped softmax."""
    temperature = case[0]
    tokens, logprobs = draw_tokens(*case, softcap=CAP)
    assert chi_square_pvalue(tokens, expected_probs(*case, softcap=CAP)) > P_REJECT
    assert chi_square_pvalue(tokens, expected_probs(*case)) < P_REJECT
    assert torch.allclose(logprobs, torch.log_softmax(soft_cap(LOGITS, CAP) / temperature, -1)[tokens], atol=1e-6)


@pytest.mark.parametrize("cap", [30.0, 5.0])
def test_a_capped_sampler_races_the_capped_logits(cap):
    """bf16 logits of a few caps, the cap in the sampler: through `sample` (the runner's call: the cap inside the
    race, or with top-k / top-p once before the threshold) and through a call with `threshold`, the tokens and
    log-probs of an uncapped sampler given `soft_cap(logits)` on the same keys, for greedy, sampling, top-k and top-p.
    Greedy is the argmax of the capped logits: row 0's 8 and 12 caps both cap to the cap, and the first id wins where
    the uncapped argmax is the second. The threshold is top-k / top-p on the capped scores: top-1 keeps both."""
    torch.manual_seed(5)
    r, v = 6, 96
    raw = torch.randn(r, v) * cap
    raw[0, 4], raw[0, 50] = 8 * cap, 12 * cap
    x = raw.bfloat16()
    capped = soft_cap(x, cap)
    keys = torch.tensor([sequence_key(3, i, 0) for i in range(r)], dtype=torch.int64)
    pos = torch.arange(r) + 4
    sampler, plain = Sampler(TPGroup(None), v, "cpu", softcap=cap), Sampler(TPGroup(None), v, "cpu")
    for temperature, top_k, top_p in ((0.0, -1, 1.0), (0.8, -1, 1.0), (0.8, 1, 1.0), (0.8, 9, 1.0), (1.2, -1, 0.7)):
        sampler.set_params(temperature, top_k, top_p)
        plain.set_params(temperature, top_k, top_p)
        s = capped.float() * sampler.inv_temp
        th = sampler.threshold(x)
        if sampler.truncates:
            assert torch.equal(th, truncation_threshold(s, top_k, top_p))
            if top_k == 1:
                assert (s[0] >= th[0]).nonzero().flatten().tolist() == [4, 50]
        else:
            assert th is None
        want = plain(capped, keys, pos, TorchOps, plain.threshold(capped))
        for got in (sampler.sample(x, keys, pos, TorchOps), sampler(x, keys, pos, TorchOps, th)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (temperature, top_k, top_p)
        assert torch.allclose(want[1], torch.log_softmax(s, -1).gather(1, want[0][:, None]).squeeze(1), atol=1e-6)
        if temperature == 0:
            assert torch.equal(want[0], s.argmax(-1)) and want[0][0] == 4 and x[0].argmax() == 50
        uncapped = plain(x, keys, pos, TorchOps, plain.threshold(x))
        assert (uncapped[1] - want[1]).abs().max() > 0.1


class NoHostSync(TorchDispatchMode):
    """Fails on what a CUDA graph cannot capture: a read of a device value by the host (`.item()`,
    `bool(t)`, `torch.equal`) or an output whose shape depends on values (`nonzero`, a boolean index)."""

    FORBIDDEN = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                 aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                 aten.unique_consecutive.default, aten.unique_dim.default, aten.repeat_interleave.Tensor}
    INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"{func} synchronises with the host or has a value-dependent shape")
        if func in self.INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            raise AssertionError(f"{func} with a boolean index has a value-dependent shape")
        return func(*args, **(kwargs or {}))


def test_no_host_sync_check_catches_syncs():
    x = torch.arange(6.0)
    for bad in (lambda: x.sum().item(), lambda: bool(x[0] > 1), lambda: x[x > 2], lambda: x.nonzero()):
        with pytest.raises(AssertionError, match="synchronises|value-dependent"), NoHostSync():
            bad()


def constant_logit_engine(rows: int, device="cpu"):
    """An engine whose every decode row has the logits LOGITS exactly: one layer whose attention and
    MLP add zeros, embedding rows of ones (RMSNorm with eps 0 keeps them ones) and an LM head
    `[LOGITS | 0]`, so the decode step's sampling can be checked against softmax(LOGITS / T). head_dim
    is 16, the smallest a Triton `tl.dot` takes."""
    from models import ModelArgs
    from rollout import EngineConfig, LLMEngine

    args = ModelArgs(vocab_size=len(LOGITS), hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8, rms_norm_eps=0.0,
                     model_type="llama", tie_word_embeddings=False)
    engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=4, max_num_seqs=rows),
                       device=device)
    with torch.no_grad():
        for name, slot in engine.param_slots().items():
            slot.view.fill_(1.0 if "norm" in name or "embed" in name else 0.0)
        engine.param_slots()["lm_head.weight"].view[:, 0] = LOGITS.to(device)
    engine.init_cache()
    return engine


def load_decode_inputs(runner, rows: int, offset: int = 0) -> None:
    """Decode inputs for `rows` rows at position 0 with distinct keys (`offset` picks another set):
    all in the dummy slot, whose scratch page takes the (identical) K/V writes. Where an eager step
    reads them (`dec_in`) and where a captured one does (pinned half 0, the device's parity set to it)."""
    keys = mix32_t(torch.arange(offset, offset + rows, device=runner.dec_in.device) + 0x5EED)
    runner.dec_in[0, :rows].fill_(runner.dummy_slot)
    runner.dec_in[1, :rows].zero_()
    runner.dec_in[2, :rows] = (keys - (keys >= 2**31).long() * 2**32).int()
    runner._in_host[0, :, :rows].copy_(runner.dec_in[:, :rows])
    runner._parity.fill_(0)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 0 or c[2] < 1])
def test_decode_step_with_truncation_is_graph_safe_and_fits_the_softmax(case):
    """The function a CUDA graph captures for a decode step (`ModelRunner._decode_body`: forward, top-k /
    top-p threshold, race, write-back), with truncation: no host synchronisation, no value-dependent
    shape, and its draws fit the truncated softmax (2**18 rows, one key each, all in one step)."""
    engine = constant_logit_engine(N_DRAWS)
    runner = engine.runner
    runner.begin_generate(*case)
    assert runner.sampler.truncation == case[1:]
    load_decode_inputs(runner, N_DRAWS)
    with NoHostSync():
        runner._decode_body(N_DRAWS, 1)
    tokens, logprobs = runner.dec_tokens[:N_DRAWS], runner.dec_logprobs[:N_DRAWS]
    assert chi_square_pvalue(tokens, expected_probs(*case)) > P_REJECT
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / case[0], -1)[tokens], atol=1e-6)
