"""Block manager: reference counts, forks with copy-on-write, no leaks (pure Python)."""

import random

import pytest

from rollout.block_manager import BlockManager
from rollout.sequence import Sequence


def _seq(i, n_tokens, slot=0):
    return Sequence(seq_id=i, prompt_index=i, sample_index=0, token_ids=[1] * n_tokens,
                    num_prompt_tokens=n_tokens, max_len=10_000, slot=slot)


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(0, 9, slot=3)
    updates = bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert updates == [(3, c, b) for c, b in enumerate(s.block_table)]
    bm.check_invariants([s])
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_watermark_limits_admission_only():
    bm = BlockManager(num_blocks=8, block_size=4, watermark_blocks=2)
    assert bm.can_allocate(24) and not bm.can_allocate(25)  # 6 blocks ok, 7 would eat the watermark
    s = _seq(0, 24)
    bm.allocate(s, 24)
    s.num_computed_tokens = 24
    assert bm.can_append(s)  # decode growth may use the watermark


def test_fork_shares_blocks_and_copy_on_write_of_partial_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = _seq(0, 10, slot=0)  # blocks: [0..3] [4..7] [8, 9 | partial]
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    children = []
    for k in range(1, 4):
        c = _seq(k, 10, slot=k)
        c.num_computed_tokens = 10
        upd = bm.fork(parent, c)
        assert [b for _, _, b in upd] == parent.block_table and all(sl == k for sl, _, _ in upd)
        children.append(c)
    assert all(bm.ref_counts[b] == 4 for b in parent.block_table)
    family = [parent] + children
    bm.check_invariants(family)
    # Every writer but the last copies the shared partial block; full blocks stay shared.
    copies = []
    for s in family:
        assert bm.append_cost(s) == (1 if bm.ref_counts[s.block_table[-1]] > 1 else 0)
        update, copy = bm.append_slot(s)
        if copy is not None:
            copies.append(copy)
            assert update == (s.slot, 2, copy[1]) and s.block_table[-1] == copy[1]
        bm.check_invariants(family)
    assert len(copies) == 3 and len({dst for _, dst in copies}) == 3
    assert all(bm.ref_counts[b] == 4 for b in parent.block_table[:2])
    assert len({s.block_table[-1] for s in family}) == 4
    for s in family:
        bm.free(s)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_append_at_block_boundary_takes_a_new_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = _seq(0, 8)
    bm.allocate(s, 8)
    s.num_computed_tokens = 8
    assert bm.append_cost(s) == 1
    update, copy = bm.append_slot(s)
    assert copy is None and update[1] == 2 and len(s.block_table) == 3


def test_allocate_more_than_free_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError):
        bm.allocate(_seq(0, 9), 9)


@pytest.mark.parametrize("seed", range(5))
def test_randomized_operations_keep_invariants(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    bm = BlockManager(num_blocks=rng.randint(8, 40), block_size=bs)
    live: list[Sequence] = []
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(1, 3 * bs + 1)
            if bm.can_allocate(n):
                s = _seq(next_id, n, slot=next_id)
                next_id += 1
                bm.allocate(s, n)
                s.num_computed_tokens = n
                live.append(s)
        elif op < 0.45 and live:
            p = rng.choice(live)
            c = _seq(next_id, p.num_tokens, slot=next_id)
            next_id += 1
            c.num_computed_tokens = p.num_computed_tokens
            bm.fork(p, c)
            live.append(c)
        elif op < 0.85 and live:
            s = rng.choice(live)
            if bm.can_append(s):
                before = list(s.block_table)
                update, copy = bm.append_slot(s)
                col = s.num_computed_tokens // bs
                assert s.block_table[:col] == before[:col]  # earlier blocks never change
                if copy is not None:
                    assert copy[0] == before[col] and bm.ref_counts[copy[1]] == 1
                s.num_computed_tokens += 1
                assert bm.ref_counts[s.block_table[-1]] == 1  # the block just written is private
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        bm.check_invariants(live)
    for s in live:
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
