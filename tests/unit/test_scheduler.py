"""Scheduler: continuous batching, chunked prefill, forks, preemption, stops - driven without a model.

A fake model makes each token a hash of the sequence's previous tokens, so a scheduler that
fed a wrong prefix (a lost token, a mix-up after preemption) produces a different sequence
than the reference run.
"""

import random

import pytest

from rollout.block_manager import BlockManager
from rollout.scheduler import Scheduler
from rollout.sequence import PLACEHOLDER, Sequence, SeqStatus, mix32

VOCAB = 50


def _next_token(tokens, sample_index):
    h = sample_index
    for t in tokens:
        h = mix32(h * 31 + t)
    return h % VOCAB


class FakeRunner:
    """Stands in for the GPU: a per-slot 'KV cache' of resolved tokens and a per-slot last token.

    Like the real runner, a decode step's input is the slot's last sampled token (never a
    host value), and forked rows inherit their parent's cache.
    """

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}
        self.steps = []
        self.overlapped_prefills = 0  # prefill steps launched before the previous step's results were processed
        self.overlapped_recomputes = 0  # ... that recompute a preempted sequence

    def execute(self, batch):
        s = self.sched
        assert len(batch.seqs) <= s.max_num_seqs
        assert len(set(batch.slots)) == len(batch.slots), "two sequences share a slot"
        if batch.is_prefill:
            assert batch.num_tokens <= s.max_num_batched_tokens
        else:
            assert all(n == 1 for n in batch.chunk_lens) and batch.num_decode_rows == len(batch.seqs)
        decode_from = len(batch.seqs) - batch.num_decode_rows
        self.steps.append((batch.is_prefill, len(batch.seqs), batch.num_tokens, batch.num_decode_rows))
        for i, (seq, slot, start, n) in enumerate(zip(batch.seqs, batch.slots, batch.starts, batch.chunk_lens)):
            if start == 0:
                self.kv[slot] = []
            cache = self.kv[slot]
            assert len(cache) == start, "step does not continue where the cache ends"
            if i >= decode_from:  # a decoding row: its input is the slot's last sampled token, on the device
                assert n == 1 and start == len(seq.token_ids) - 2, "a decoding row that is not the latest token"
                assert seq.token_ids[start] in (PLACEHOLDER, self.last[slot])
                cache.append(self.last[slot])
            else:
                assert batch.is_prefill
                chunk = seq.token_ids[start:start + n]
                assert PLACEHOLDER not in chunk, "prefill of a token whose value is unknown"
                cache.extend(chunk)
        tokens = []
        for seq, src, pos in zip(batch.sample_seqs, batch.sample_src, batch.sample_positions):
            ctx = self.kv[batch.slots[src]]
            assert len(ctx) == pos
            tokens.append(_next_token(ctx, seq.sample_index))
        for slot, src, tok in zip(batch.sample_slots, batch.sample_src, tokens):
            self.last[slot] = tok
            if slot != batch.slots[src]:
                self.kv[slot] = list(self.kv[batch.slots[src]])
        return batch, tokens, [-0.5] * len(tokens)


def drive(sched: Scheduler, lag: bool = True, check_every_step: bool = True):
    """The engine's loop: schedule, launch, then process the previous step's results (one step late,
    prefill steps included); `lag=False` processes every step before scheduling the next."""
    runner = FakeRunner(sched)
    pending = None
    guard = 0
    while sched.has_unfinished():
        guard += 1
        assert guard < 10_000, "no progress"
        if pending is not None and not lag:
            sched.postprocess(*pending)
            pending = None
        preemptions = sched.num_preemptions
        batch = sched.schedule()
        if batch.is_prefill:
            assert sched.num_preemptions == preemptions, "a prefill step preempted"
        chunks = batch.seqs[:len(batch.seqs) - batch.num_decode_rows]
        if pending is not None and batch.is_prefill:
            runner.overlapped_prefills += 1
            runner.overlapped_recomputes += any(s.num_tokens > s.num_prompt_tokens + 1 for s in chunks)
        launched = runner.execute(batch)
        if pending is not None:
            sched.postprocess(*pending)
        pending = launched
        if check_every_step:
            live = sched.running + [s for s in sched.waiting if s.block_table]
            sched.block_manager.check_invariants(live)
            used = [s.slot for s in sched.running] + [x for s in sched.running for x in s.reserved_slots]
            assert len(used) == len(set(used)) and len(used) + len(sched.free_slots) == sched.max_num_seqs
    if pending is not None:
        sched.postprocess(*pending)
    return runner


def reference_tokens(prompt, sample_index, max_new, stops):
    toks = list(prompt)
    out = []
    while len(out) < max_new:
        t = _next_token(toks, sample_index)
        toks.append(t)
        out.append(t)
        if t in stops:
            break
    return out


def make_seqs(prompts, n, max_new, stops=frozenset(), max_model_len=10_000):
    return [Sequence(seq_id=i * n, prompt_index=i, sample_index=0, token_ids=list(p), num_prompt_tokens=len(p),
                     max_len=min(len(p) + max_new, max_model_len), num_samples=n, stop_token_ids=frozenset(stops))
            for i, p in enumerate(prompts)]


def run_all(prompts, n, max_new, num_blocks, block_size=4, max_num_seqs=64, budget=64, chunked=True,
            stops=frozenset(), lag=True):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget, chunked)
    seqs = make_seqs(prompts, n, max_new, stops)
    for s in seqs:
        sched.add(s)
    all_seqs = {}
    orig = sched.postprocess

    def post(batch, toks, lps):
        for s in batch.sample_seqs:
            all_seqs[(s.prompt_index, s.sample_index)] = s
        orig(batch, toks, lps)

    sched.postprocess = post
    runner = drive(sched, lag=lag)
    assert bm.num_free_blocks == num_blocks, "leaked KV blocks"
    assert sorted(sched.free_slots) == list(range(max_num_seqs)), "leaked slots"
    assert len(all_seqs) == len(prompts) * n
    for (i, k), s in all_seqs.items():
        assert s.status is SeqStatus.FINISHED
        ref = reference_tokens(prompts[i], k, max_new, stops)
        assert s.output_token_ids == ref, (i, k)
        assert s.finish_reason == ("stop" if ref[-1] in stops else "length")
        assert len(s.logprobs) == len(ref)
    return sched, runner


def _prompts(rng, count, lo, hi):
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_all_sequences_finish_with_right_tokens_and_nothing_leaks():
    rng = random.Random(0)
    sched, runner = run_all(_prompts(rng, 6, 1, 20), n=1, max_new=9, num_blocks=100)
    assert sched.num_preemptions == 0
    assert runner.steps[0][0] and not runner.steps[-1][0]


def test_chunked_prefill_respects_token_budget():
    rng = random.Random(1)
    prompts = _prompts(rng, 3, 30, 45)
    sched, runner = run_all(prompts, n=1, max_new=4, num_blocks=100, budget=16)
    prefill = [s for s in runner.steps if s[0]]
    assert all(tokens <= 16 for _, _, tokens, _ in prefill)
    assert sum(tokens - decoding for _, _, tokens, decoding in prefill) == sum(map(len, prompts))
    assert len(prefill) >= 6


def test_without_chunking_whole_prompts_only():
    rng = random.Random(2)
    prompts = _prompts(rng, 5, 5, 12)
    sched, runner = run_all(prompts, n=1, max_new=3, num_blocks=100, budget=24, chunked=False)
    # Every prefill step holds whole prompts: their lengths sum to the step's tokens.
    assert sum(t - decoding for p, _, t, decoding in runner.steps if p) == sum(map(len, prompts))


def test_max_num_seqs_limits_the_batch():
    rng = random.Random(3)
    sched, runner = run_all(_prompts(rng, 10, 2, 6), n=1, max_new=5, num_blocks=200, max_num_seqs=3)
    assert max(n for _, n, _, _ in runner.steps) <= 3


def test_decoding_sequences_ride_along_with_prefill_chunks():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seqs([[1] * 5, [2] * 6], n=1, max_new=8)
    sched.add(a)
    sched.schedule()  # a's prompt; its first token is not back on the host yet
    sched.add(b)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [b, a] and batch.num_decode_rows == 1
    assert batch.starts == [0, 5] and batch.chunk_lens == [6, 1] and batch.num_tokens == 7
    assert batch.sample_seqs == [b, a] and batch.sample_src == [0, 1] and batch.sample_positions == [6, 6]
    assert a.token_ids[5:] == [PLACEHOLDER, PLACEHOLDER]  # its input comes from the device


def test_a_prefill_step_leaves_behind_a_decoding_sequence_it_has_no_block_for():
    sched = Scheduler(BlockManager(5, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seqs([[1] * 4, [2] * 13], n=1, max_new=2)
    sched.add(a)
    sched.schedule()  # a fills its block: its next token needs a new one
    sched.add(b)
    batch = sched.schedule()  # b takes the 4 blocks left
    assert batch.is_prefill and batch.seqs == [b] and batch.num_decode_rows == 0
    assert sched.num_preemptions == 0 and a.status is SeqStatus.RUNNING


def test_samples_share_prompt_blocks():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 16, 64)
    (seq,) = make_seqs([[1] * 10], n=4, max_new=5)
    sched.add(seq)
    batch = sched.schedule()
    assert batch.is_prefill and len(batch.sample_seqs) == 4 and batch.sample_src == [0, 0, 0, 0]
    family = sched.running
    assert len(family) == 4 and len({s.slot for s in family}) == 4
    assert all(s.block_table == seq.block_table for s in family)
    assert all(bm.ref_counts[b] == 4 for b in seq.block_table)
    assert bm.num_free_blocks == 64 - 3
    sched.postprocess(batch, [5, 6, 7, 8], [0.0] * 4)
    batch = sched.schedule()  # first decode: the shared partial last block is copied 3 times
    assert not batch.is_prefill and len(batch.copies) == 3
    assert all(bm.ref_counts[b] == 4 for b in seq.block_table[:2])
    assert len({s.block_table[-1] for s in family}) == 4


@pytest.mark.parametrize("lag", [True, False])
def test_preemption_recomputes_and_gives_same_tokens(lag):
    rng = random.Random(4)
    prompts = _prompts(rng, 6, 3, 14)
    sched, runner = run_all(prompts, n=3, max_new=20, num_blocks=14, block_size=4, budget=32, lag=lag)
    assert sched.num_preemptions > 0
    # One step late, recomputes too are launched before the last step's results are processed:
    # FakeRunner would have rejected a prefill of a token those results had not filled in yet.
    assert runner.overlapped_recomputes > 0 if lag else runner.overlapped_prefills == 0


def test_stop_tokens_end_samples_early():
    rng = random.Random(5)
    stops = frozenset(range(0, VOCAB, 4))
    sched, _ = run_all(_prompts(rng, 8, 2, 9), n=2, max_new=30, num_blocks=60, stops=stops)


def test_refills_do_not_wait_for_the_last_step():
    # More prompts than slots, samples ending early: fresh prompts refill freed slots in prefill
    # steps launched while the previous step's results are still pending.
    rng = random.Random(6)
    stops = frozenset(range(0, VOCAB, 5))
    sched, runner = run_all(_prompts(rng, 12, 2, 9), n=1, max_new=12, num_blocks=200, max_num_seqs=3, stops=stops)
    assert sched.num_preemptions == 0
    assert runner.overlapped_prefills >= 5
    # and the sequences decoding at a refill advance in it
    assert sum(1 for prefill, _, _, decoding in runner.steps if prefill and decoding) >= 5


def test_add_rejects_what_cannot_fit():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(make_seqs([[1] * 10], n=1, max_new=10)[0])
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add(make_seqs([[1] * 2], n=3, max_new=2)[0])


@pytest.mark.parametrize("seed", range(6))
def test_randomized_workloads(seed):
    rng = random.Random(100 + seed)
    bs = rng.choice([1, 2, 4, 8])
    n = rng.choice([1, 1, 2, 4])
    max_new = rng.randint(1, 25)
    prompts = _prompts(rng, rng.randint(1, 8), 1, 30)
    need = max(len(p) for p in prompts) + max_new
    num_blocks = rng.randint(-(-need // bs) + 1, 3 * (-(-need // bs)) + 8)
    stops = frozenset(rng.sample(range(VOCAB), rng.choice([0, 2, 6])))
    run_all(prompts, n=n, max_new=max_new, num_blocks=num_blocks, block_size=bs,
            max_num_seqs=rng.choice([n, 2 * n, 16]), budget=rng.choice([8, 16, 64]), stops=stops,
            lag=rng.random() < 0.7)
