"""StateSlots (the linear-attention state slots' bookkeeping, plain Python) and its eviction
hook on the BlockManager."""

from __future__ import annotations

import pytest

from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.state_slots import StateSlots


def test_slot_zero_is_never_handed_out() -> None:
    slots = StateSlots(4)
    got = [slots.take() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and slots.take() is None
    assert slots.num_used == 3 and slots.num_available == 0
    for s in got:
        slots.release(s)
    assert slots.num_used == 0 and slots.num_available == 3
    with pytest.raises(AssertionError):
        slots.release(got[0])  # double release


def test_idle_snapshots_are_evicted_least_recently_used() -> None:
    slots = StateSlots(4)
    a, b, c = slots.take(), slots.take(), slots.take()
    assert slots.bind(a, block=10) and slots.bind(b, block=11)
    slots.release(a)  # idle first
    slots.release(b)
    assert slots.num_snapshots == 2 and slots.num_available == 2
    slots.acquire(a)  # read again: most recently used, and held meanwhile
    slots.release(a)
    d = slots.take()  # no free slot: the least recently used idle snapshot (b's) goes
    assert d == b and slots.snapshot(11) is None and slots.snapshot(10) == a
    assert slots.num_snapshots == 1
    slots.acquire(a)
    assert slots.take() is None  # held snapshots and working slots are never evicted
    slots.release(c)
    assert slots.take() == c


def test_bind_refuses_a_second_snapshot_of_a_block() -> None:
    slots = StateSlots(3)
    a, b = slots.take(), slots.take()
    assert slots.bind(a, block=5)
    assert not slots.bind(b, block=5)  # b stays an ordinary held slot
    slots.release(b)
    slots.release(a)
    assert slots.snapshot(5) == a and slots.num_used == 1 and slots.num_snapshots == 1


def test_dropping_a_block_frees_its_snapshot_after_its_last_reader() -> None:
    slots = StateSlots(3)
    a, b = slots.take(), slots.take()
    slots.bind(a, block=1)
    slots.bind(b, block=2)
    slots.release(a)
    slots.drop_block(1)  # idle: freed at once
    assert slots.snapshot(1) is None and slots.num_used == 1
    slots.drop_block(2)  # still read by its sequence: freed at its release
    assert slots.snapshot(2) is None and slots.num_used == 1 and slots.num_snapshots == 0
    slots.release(b)
    assert slots.num_used == 0 and slots.num_available == 2
    slots.drop_block(7)  # a block without a snapshot: nothing happens


def test_block_eviction_and_reset_free_bound_snapshots() -> None:
    bm = BlockManager(3, 2)
    slots = StateSlots(4)
    bm.on_evict = slots.drop_block
    blocks = bm.allocate(2)
    bm.register(blocks[0], b"h0")
    bm.register(blocks[1], b"h1")
    s0, s1 = slots.take(), slots.take()
    slots.bind(s0, blocks[0])
    slots.bind(s1, blocks[1])
    slots.release(s0)
    slots.release(s1)
    bm.release(blocks)
    assert slots.num_snapshots == 2
    bm.allocate(2)  # one free block, then the least recently used cached one is evicted
    assert slots.num_snapshots == 1 and slots.num_used == 1
    bm.reset_prefix_cache()
    assert slots.num_snapshots == 0 and slots.num_used == 0
