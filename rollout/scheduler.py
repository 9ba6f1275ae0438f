"""Continuous batching with chunked prefill and preemption by recompute (pure Python).

Each step is either a prefill step or a decode step:

* prefill (taken whenever there is prefill work that fits): continue the prompts already
  being prefilled, then admit waiting sequences first-come first-served while there are
  slots (`max_num_seqs`, counting the `n` samples of a prompt), KV blocks for the whole
  prompt (above a small watermark) and token budget (`max_num_batched_tokens`; a prompt
  longer than what is left is split into chunks when `enable_chunked_prefill`). The
  sequences already decoding ride along with one token each, in admission order, while
  budget is left and their next token's block is at hand (a prefill step never preempts):
  refilling a freed slot then costs the decoding sequences no step of their own.
* decode: one token for every running sequence, in admission order. A sequence that needs
  a block when none is free preempts the most recently admitted running sequence (possibly
  itself): its blocks are freed and it goes back to the front of the queue, to be
  recomputed later as a prompt made of its prompt and the tokens it has generated.

Keeping decode steps apart keeps every one of them a pure, fixed-shape batch that a CUDA
graph can replay. The scheduler never needs the previous step's token *values*: a decoding
sequence's input is the token sampled on the device (in a prefill step too: until the host
has read it back, its row's token id is `PLACEHOLDER`, which the runner replaces on the
device), and a prefill chunk reads only
known tokens (a fresh prompt's, or a preempted sequence's, whose last sample came from a step
processed before the one that preempted it could be). So `schedule()` can run before the
previous step's tokens are back on the host; `postprocess()` fills them in later and ends
sequences on a stop token, at most one step late (the extra token is dropped).
"""

from __future__ import annotations

from collections import deque

from rollout.block_manager import BlockManager
from rollout.sequence import PLACEHOLDER, ScheduledBatch, Sequence, SeqStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, keep_kv: bool = False, record_routing: bool = False):
        self.block_manager = block_manager
        # (record_routing) (sequence, its blocks, tokens recorded in them) of the sequences that gave their blocks
        # back: preempted ones in the step being scheduled (their experts read before it runs, which may reuse the
        # blocks), released ones (read after the step that computed their last token)
        self.record_routing = record_routing
        self.preempted_routing: list[tuple[Sequence, list[int], int]] = []
        self.released_routing: list[tuple[Sequence, list[int], int]] = []
        # finished sequences keep their blocks for the engine to continue them (`kept`, oldest first),
        # until blocks are short: then the oldest give theirs back (`_reclaim`) before anyone is preempted
        self.keep_kv = keep_kv
        self.kept: deque[Sequence] = deque()
        self.continues = False  # some queued sequence holds K/V of its own (a continuation)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out 0 first
        self.num_preemptions = 0
        self.num_prefilling = 0  # running sequences whose last prefill chunk is not scheduled yet

    # ----------------------------------------------------------------- intake
    def add(self, seq: Sequence) -> None:
        """Queue a fresh prompt (`seq.num_samples` samples will fork from it), or a continued sample
        that holds the K/V of its first `num_computed_tokens` positions (`seq.block_table`)."""
        bm = self.block_manager
        if seq.num_samples > self.max_num_seqs:
            raise ValueError(f"n={seq.num_samples} samples exceed max_num_seqs={self.max_num_seqs}")
        # A preempted sequence is recomputed from up to max_len - 1 tokens; that must fit alone.
        need = bm.blocks_for(seq.max_len - 1)
        if need > bm.num_blocks - bm.watermark_blocks:
            raise ValueError(
                f"a sequence of {seq.max_len} tokens needs {need} KV blocks but the pool has "
                f"{bm.num_blocks} (watermark {bm.watermark_blocks}): raise num_kv_blocks / "
                f"gpu_memory_utilization or lower max_tokens")
        if not self.enable_chunked_prefill and seq.max_len - 1 > self.max_num_batched_tokens:
            raise ValueError(
                f"a sequence of {seq.max_len} tokens cannot be prefilled in one step of "
                f"max_num_batched_tokens={self.max_num_batched_tokens} without chunked prefill")
        seq.status = SeqStatus.WAITING
        self.continues |= bool(seq.block_table)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admissible(self, seq: Sequence, budget: int) -> bool:
        if len(self.free_slots) < seq.num_samples:
            return False
        if not self.enable_chunked_prefill and seq.num_tokens - seq.num_computed_tokens > budget:
            return False
        bm = self.block_manager
        fits = (lambda: bm.can_extend(seq, seq.num_tokens)) if seq.block_table else (
            lambda: bm.can_allocate(seq.num_tokens))  # a continued sample needs only the positions past its K/V
        while not fits() and self.kept:
            self._reclaim(self.kept.popleft())
        # then the K/V of continued sequences still queued behind this one (they will recompute it):
        # blocks held by sequences that cannot run would otherwise block the queue for good. Only
        # where continuations were queued: a plain generation does not walk its queue per step.
        if self.continues and not fits():
            for other in reversed(self.waiting):
                if other is not seq and other.block_table:
                    self._reclaim(other)
                    if fits():
                        break
        return fits()

    def _reclaim(self, seq: Sequence) -> None:
        """A kept or queued sequence's blocks back to the pool (it is recomputed if continued)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _next_is_prefill(self) -> bool:
        """Whether `schedule()` now returns a prefill step: prompt chunks pending, or a waiting one admissible."""
        if self.num_prefilling:
            return True
        return bool(self.waiting) and self._admissible(self.waiting[0], self.max_num_batched_tokens)

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> ScheduledBatch:
        if self._next_is_prefill():
            batch = self._schedule_prefill()
        else:
            batch = self._schedule_decode()
        if not batch.seqs and self.has_unfinished():
            raise RuntimeError("scheduler made no progress: nothing running and the next prompt does not fit")
        return batch

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=True)
        budget = self.max_num_batched_tokens
        finished: list[Sequence] = []
        decoding = [s for s in self.running if not s.prefilling]  # before this step admits or forks any
        for seq in self.running:
            if not seq.prefilling or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= n
            self._add_chunk(batch, seq, n, finished)
        bm = self.block_manager
        while self.waiting and budget > 0 and self._admissible(self.waiting[0], budget):
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.reserved_slots = [self.free_slots.pop() for _ in range(seq.num_samples - 1)]
            if seq.block_table:  # continued from its kept K/V
                updates, copies = bm.extend(seq, seq.num_tokens)
                batch.block_table_updates += updates
                batch.copies += copies
            else:
                batch.block_table_updates += bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = 0
            seq.status = SeqStatus.RUNNING
            seq.prefilling = True
            self.num_prefilling += 1
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= n
            self._add_chunk(batch, seq, n, finished)
        # The decoding sequences take what the prompts left: budget, and blocks without preempting.
        # As in a decode step: block work only where the next token starts a block or the last
        # block is shared, then one token for each of them (`_add_decode_rows`).
        bs, refs = bm.block_size, bm.ref_counts
        riders: list[Sequence] = []
        for seq in decoding:
            if len(riders) == budget:
                break
            if seq.num_computed_tokens % bs == 0 or refs[seq.block_table[-1]] > 1:
                if not bm.can_append(seq):
                    continue  # waits for a decode step, which may preempt for it
                self._append_block(batch, seq)
            riders.append(seq)
        self._add_decode_rows(batch, riders, finished)
        # Freed only now: a block or slot released mid-step must not be handed to another
        # sequence of the same step, whose writes would race with this one's.
        for seq in finished:
            self._release(seq)
        return batch

    def _add_chunk(self, batch: ScheduledBatch, seq: Sequence, n: int, finished: list[Sequence]) -> None:
        idx = len(batch.seqs)
        batch.seqs.append(seq)
        batch.slots.append(seq.slot)
        batch.starts.append(seq.num_computed_tokens)
        batch.chunk_lens.append(n)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens < seq.num_tokens:
            return  # more chunks to come
        if not seq.prefilling:  # a decoding sequence's token
            self._add_sample(batch, seq, idx, finished)
            return
        seq.prefilling = False
        self.num_prefilling -= 1
        rows = [seq]
        for k in range(1, seq.num_samples):
            child = Sequence(
                seq_id=seq.seq_id + k, prompt_index=seq.prompt_index, sample_index=seq.sample_index + k,
                token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens, max_len=seq.max_len,
                seed=seq.seed, stop_token_ids=seq.stop_token_ids, status=SeqStatus.RUNNING,
                num_computed_tokens=seq.num_computed_tokens, slot=seq.reserved_slots[k - 1])
            batch.block_table_updates += self.block_manager.fork(seq, child)
            self.running.append(child)
            rows.append(child)
        seq.num_samples, seq.reserved_slots = 1, []
        for s in rows:
            self._add_sample(batch, s, idx, finished)

    def _add_sample(self, batch: ScheduledBatch, seq: Sequence, src: int, finished: list[Sequence]) -> None:
        batch.sample_seqs.append(seq)
        batch.sample_slots.append(seq.slot)
        batch.sample_src.append(src)
        batch.sample_positions.append(len(seq.token_ids))
        seq.token_ids.append(PLACEHOLDER)
        if len(seq.token_ids) >= seq.max_len:
            finished.append(seq)  # its last token is scheduled: no further step needs it

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=False)
        bm = self.block_manager
        bs, refs = bm.block_size, bm.ref_counts
        running = self.running
        # This runs once per sequence per token, so in two passes. First the block work, in
        # admission order: a sequence whose next token starts a block, or whose last block is
        # shared, gets a block (copy-on-write), preempting the most recently admitted sequences
        # while none is free (possibly itself: then it was the last one). Most sequences need
        # nothing: the pass only tests them.
        for seq in [s for s in running if s.num_computed_tokens % bs == 0 or refs[s.block_table[-1]] > 1]:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted for an earlier sequence's block
            while not bm.can_append(seq) and self.kept:
                self._reclaim(self.kept.popleft())
            while not bm.can_append(seq):
                victim = running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # preempted itself: every later sequence went before it
            self._append_block(batch, seq)
        # Then one token for every sequence still running.
        finished: list[Sequence] = []
        self._add_decode_rows(batch, running, finished)
        for seq in finished:
            self._release(seq)
        return batch

    @staticmethod
    def _add_decode_rows(batch: ScheduledBatch, seqs: list[Sequence], finished: list[Sequence]) -> None:
        """Append one decoding row (one token, sampled) for each of `seqs`, their lists built whole
        (this runs once per sequence per token); a sequence whose last token this is goes to `finished`."""
        first = len(batch.seqs)
        slots = [seq.slot for seq in seqs]
        batch.seqs += seqs
        batch.sample_seqs += seqs
        batch.slots += slots
        batch.sample_slots += slots
        batch.starts += [seq.num_computed_tokens for seq in seqs]
        batch.chunk_lens += [1] * len(seqs)
        batch.sample_src += range(first, first + len(seqs))
        batch.sample_positions += [len(seq.token_ids) for seq in seqs]
        batch.num_decode_rows += len(seqs)
        for seq in seqs:
            seq.num_computed_tokens += 1
            tokens = seq.token_ids
            tokens.append(PLACEHOLDER)
            if len(tokens) >= seq.max_len:
                finished.append(seq)  # its last token is scheduled: no further step needs it

    def _append_block(self, batch: ScheduledBatch, seq: Sequence) -> None:
        """Room for `seq`'s next token (a new block, or a private copy of a shared last block)."""
        update, copy = self.block_manager.append_slot(seq)
        if update is not None:
            batch.block_table_updates.append(update)
        if copy is not None:
            batch.copies.append(copy)

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it is recomputed from its tokens when readmitted."""
        if self.record_routing:
            self.preempted_routing.append((seq, list(seq.block_table), seq.num_computed_tokens))
        self.block_manager.free(seq)
        self.free_slots.append(seq.slot)
        seq.slot = -1
        seq.num_computed_tokens = 0
        assert not seq.prefilling, "prefilling sequences are never preempted (decode steps only)"
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Give back everything a sequence holds (idempotent)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            if seq.prefilling:
                seq.prefilling = False
                self.num_prefilling -= 1
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.record_routing and seq.block_table:  # every token but the last (sampled, not fed) was run
            self.released_routing.append((seq, list(seq.block_table), len(seq.token_ids) - 1))
        if self.keep_kv and seq.block_table:
            self.kept.append(seq)
        else:
            self.block_manager.free(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
        self.free_slots.extend(seq.reserved_slots)
        seq.slot, seq.reserved_slots = -1, []
        seq.status = SeqStatus.FINISHED

    # ----------------------------------------------------------------- results
    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float]) -> None:
        """Record the sampled tokens of `batch` (one per sample row) and end stopped sequences."""
        for seq, pos, tok, lp in zip(batch.sample_seqs, batch.sample_positions, token_ids, logprobs):
            if seq.finish_reason is not None:
                continue  # stopped at an earlier token; this one was computed before we knew
            assert len(seq.logprobs) == pos - seq.num_prompt_tokens, "results processed out of order"
            seq.token_ids[pos] = tok
            seq.logprobs.append(lp)
            if tok in seq.stop_token_ids:
                seq.finish_reason = "stop"
                del seq.token_ids[pos + 1:]
                self._release(seq)
            elif pos + 1 >= seq.max_len:
                seq.finish_reason = "length"
