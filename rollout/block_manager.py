"""Reference-counted KV-cache blocks (pure Python).

A block holds `block_size` consecutive positions of one sequence's K/V. Blocks are shared
by reference count: the `n` samples of a prompt fork from one prefilled sequence and share
its blocks; the first write into a shared, partially filled last block copies it first
(copy-on-write). Full shared blocks are never written again, so they stay shared.
"""

from __future__ import annotations

from collections import deque

from rollout.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns blocks `0 .. num_blocks-1`; every change to a sequence's block table goes through here.

    Mutating methods return the device-side consequences for the caller to replay:
    `(slot, column, block)` block-table updates and `(src, dst)` block copies.
    `watermark_blocks` are kept free at admission so that running sequences can grow a while
    before anyone must be preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        assert self.ref_counts[block] == 0, f"free block {block} has references"
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    # ----------------------------------------------------------------- admission
    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks - self.watermark_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int, int]]:
        """Fresh blocks for positions [0, num_tokens) of a sequence that holds none."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        need = self.blocks_for(num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {need} blocks, {self.num_free_blocks} free")
        seq.block_table = [self._take() for _ in range(need)]
        return [(seq.slot, col, b) for col, b in enumerate(seq.block_table)]

    def blocks_to_extend(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `extend` takes for `seq`: the private copies of shared blocks from its first
        uncomputed position on, and fresh blocks up to `num_tokens`."""
        table, first = seq.block_table, seq.num_computed_tokens // self.block_size
        shared = sum(self.ref_counts[b] > 1 for b in table[first:])
        return shared + max(self.blocks_for(num_tokens) - len(table), 0)

    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_to_extend(seq, num_tokens) <= self.num_free_blocks - self.watermark_blocks

    def extend(self, seq: Sequence, num_tokens: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """Blocks for positions [0, num_tokens) of a sequence that holds the K/V of its first
        `num_computed_tokens` positions (a continued sample, `LLMEngine.generate(keep_kv=...)`):
        every shared block that a new position falls in becomes a private copy (its siblings keep
        theirs), fresh blocks follow. Returns the block-table updates of every column (the
        sequence writes them into its new slot) and the `(src, dst)` copies."""
        table, first = seq.block_table, seq.num_computed_tokens // self.block_size
        need = self.blocks_to_extend(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"extend: need {need} blocks, {self.num_free_blocks} free")
        copies = []
        for col in range(first, len(table)):
            if self.ref_counts[table[col]] > 1:
                new = self._take()
                self._release(table[col])
                copies.append((table[col], new))
                table[col] = new
        table += [self._take() for _ in range(self.blocks_for(num_tokens) - len(table))]
        return [(seq.slot, col, b) for col, b in enumerate(table)], copies

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int, int]]:
        """`child` shares every block of `parent` (reference counts + 1)."""
        assert not child.block_table
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        return [(child.slot, col, b) for col, b in enumerate(child.block_table)]

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self._release(b)
        seq.block_table = []

    # ----------------------------------------------------------------- decode growth
    def append_cost(self, seq: Sequence) -> int:
        """Blocks needed to write the K/V of position `seq.num_computed_tokens` (0 or 1)."""
        pos = seq.num_computed_tokens
        table = seq.block_table
        if pos // self.block_size == len(table):
            return 1  # first position of a new block
        return 1 if self.ref_counts[table[-1]] > 1 else 0  # shared partial block: copy-on-write

    def can_append(self, seq: Sequence) -> bool:
        return self.append_cost(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence):
        """Make position `seq.num_computed_tokens` writable.

        Returns `(update, copy)`: a `(slot, column, block)` block-table update or None, and a
        `(src, dst)` block copy or None (copy-on-write of a shared last block).
        """
        pos = seq.num_computed_tokens
        table = seq.block_table
        col = pos // self.block_size
        assert col <= len(table), f"sequence {seq.seq_id}: position {pos} skips a block"
        if col == len(table):
            block = self._take()
            table.append(block)
            return (seq.slot, col, block), None
        assert col == len(table) - 1, f"sequence {seq.seq_id}: position {pos} is not in the last block"
        last = table[-1]
        if self.ref_counts[last] == 1:
            return None, None
        new = self._take()
        self._release(last)
        table[-1] = new
        return (seq.slot, col, new), (last, new)

    # ----------------------------------------------------------------- checks
    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal table memberships; free list = blocks without references."""
        counts = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts disagree with the block tables"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list disagrees with references"
