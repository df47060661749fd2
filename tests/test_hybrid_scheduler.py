"""The scheduler of a hybrid model (linear-attention state slots, plain Python): working
slots, snapshots at cache_end shared by a GRPO group, hit trimming, slot exhaustion,
release on finish / abort / reset; the step's state arrays; the KV pool's state views."""

from __future__ import annotations

import numpy as np
import torch

from teacher_server.cache_layout import CacheLayout, LinearStateLayout
from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.host_step import build_host_step
from teacher_server.engine.request import ScoreRequest
from teacher_server.engine.scheduler import Scheduler, SchedulerConfig
from teacher_server.engine.sequence import Chunk, Sequence
from teacher_server.engine.state_slots import StateSlots
from teacher_server.kv_pool import KVPool

BS = 4
PROMPT = np.arange(100, 140)  # 40 tokens; rows from 39 on: cache_end = 36 (9 blocks)


def make(budget: int = 1000, slots: int = 8, blocks: int = 256, max_seqs: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), BlockManager(blocks, BS),
                     StateSlots(slots))


def response(i: int, salt: str | None = None, n: int = 20, prompt: np.ndarray = PROMPT) -> Sequence:
    toks = np.concatenate([prompt, 1000 + np.arange(i * n, (i + 1) * n)])
    return Sequence(ScoreRequest(f"r{i}-{salt}", toks, len(prompt) - 1, np.array([1]), cache_salt=salt), BS, True)


def plain(n: int, offset: int = 0) -> Sequence:
    """Every row scored (start 0): nothing cacheable, no snapshot."""
    return Sequence(ScoreRequest(f"p{n}-{offset}", np.arange(n) + offset, 0, np.array([1])), BS, True)


def run(s: Scheduler) -> list[list[tuple[Sequence, int, int, int, int]]]:
    """Every step until idle: (seq, start, end, state_in, state_out) per chunk."""
    steps = []
    for _ in range(100):
        if not s.has_work():
            return steps
        chunks = s.schedule()
        steps.append([(c.seq, c.start, c.end, c.state_in, c.state_out) for c in chunks])
        s.finish_step(chunks)
    raise AssertionError("no end")


def test_group_siblings_start_from_the_prompt_snapshot() -> None:
    s = make()
    group = [response(i) for i in range(4)]
    for g in group:
        s.add(g)
    first = s.schedule()
    # the first response computes the prompt up to cache_end, cut there, keeping its state;
    # its siblings wait for it
    assert [(c.seq, c.start, c.end, c.state_in) for c in first] == [(group[0], 0, 36, 0)]
    snap = first[0].state_out
    assert snap > 0
    s.finish_step(first)
    second = s.schedule()
    assert [c.seq for c in second] == group
    assert all((c.start, c.state_in, c.state_out) == (36, snap, 0) for c in second)  # last chunks keep nothing
    assert all(c.seq.num_cached == 36 for c in second[1:]) and group[0].num_cached == 0
    assert len(s.finish_step(second)) == 4
    # one snapshot stays for later responses to the same prompt; nothing else is held
    assert (s.slots.num_used, s.slots.num_snapshots) == (1, 1)
    late = response(9)
    s.add(late)
    (c,) = s.schedule()
    assert (c.start, c.state_in, late.num_cached) == (36, snap, 36)


def test_chunked_sequence_carries_its_state_and_is_cut_at_cache_end() -> None:
    s = make(budget=16)
    seq = response(0)  # 59 tokens run: [0, 59)
    s.add(seq)
    steps = [[(st, e, i, o) for _, st, e, i, o in step] for step in run(s)]
    w, snap = steps[0][0][3], steps[2][0][3]
    assert w > 0 and snap > 0 and snap != w
    assert steps == [[(0, 16, 0, w)], [(16, 32, w, w)], [(32, 36, w, snap)], [(36, 52, snap, w)],
                     [(52, 59, w, 0)]]
    assert (s.slots.num_used, s.slots.num_snapshots) == (1, 1)  # the working slot went back


def test_hit_counts_only_up_to_a_snapshot() -> None:
    """The prompt's blocks stay cached but its snapshot was evicted for working slots: a new
    response recomputes the prompt from position 0 (and keeps a new snapshot)."""
    s = make(budget=16, slots=3)
    s.add(response(0))
    run(s)
    assert s.slots.num_snapshots == 1
    s.add(plain(40, 500))  # two chunked sequences at once: both slots, the snapshot evicted
    s.add(plain(40, 900))
    run(s)
    assert s.slots.num_snapshots == 0
    again = response(1)
    s.add(again)
    steps = run(s)
    assert again.num_cached == 0 and steps[0][0][1:4] == (0, 16, 0)
    assert s.slots.num_snapshots == 1


def test_no_slot_no_snapshot_no_cut() -> None:
    """All slots but one held: the first response runs whole, without a snapshot; a sibling
    then finds the prompt's blocks but no snapshot and starts at 0."""
    s = make(budget=16, slots=3)
    long = plain(200, 7)
    s.add(long)
    s.finish_step(s.schedule())  # long holds a working slot
    s.cfg.max_num_batched_tokens = 1000
    a = response(0)
    s.add(a)
    chunks = s.schedule()  # long's rest, and a: one slot left, a snapshot would need two (snapshot + working)
    assert [(c.seq, c.start, c.end, c.state_out) for c in chunks][1] == (a, 0, 59, 0)
    s.finish_step(chunks)
    b = response(1)
    s.add(b)
    (c,) = s.schedule()
    assert (c.seq, c.start, c.state_in) == (b, 0, 0) and c.end == 36  # now a slot: b keeps the snapshot


def test_admission_waits_for_a_working_slot_and_resumes() -> None:
    s = make(budget=20, slots=2)  # one slot
    a, b = plain(25), plain(30, 50)  # both need more than one chunk
    s.add(a)
    s.add(b)
    steps = run(s)
    got = [[(q is a, st, e) for q, st, e, _, _ in step] for step in steps]
    assert got[0] == [(True, 0, 20)]
    assert got[1] == [(True, 20, 24)]  # b would need the slot a still holds
    assert got[2] == [(False, 0, 20)]
    assert got[3] == [(False, 20, 29)]
    assert s.slots.num_used == 0


def test_abort_frees_slots() -> None:
    s = make(budget=16)
    a = response(0)
    s.add(a)
    s.finish_step(s.schedule())  # [0, 16): a working slot
    s.finish_step(s.schedule())  # [16, 32)
    assert s.slots.num_used == 1
    chunks = s.schedule()  # [32, 36) keeps the snapshot, not yet bound
    assert s.slots.num_used == 2
    s.abort(a)  # the step failed: its snapshot is not kept
    assert s.slots.num_used == 0 and s.slots.num_snapshots == 0
    assert not s.has_work() and chunks[0].state_out > 0
    b = response(1)
    s.add(b)
    for _ in range(4):
        s.finish_step(s.schedule())
    assert s.slots.num_used == 2 and s.slots.num_snapshots == 1  # [36, 52) just read the snapshot
    s.abort(b)  # cancelled: its working slot is freed, the bound snapshot stays for reuse
    assert s.slots.num_used == 1 and s.slots.num_snapshots == 1
    s.bm.reset_prefix_cache()
    assert s.slots.num_used == 0 and s.slots.num_snapshots == 0


def test_cache_salt_isolates_snapshots() -> None:
    s = make()
    s.add(response(0, salt="a"))
    run(s)
    b, c = response(1, salt="b"), response(2, salt="a")
    s.add(b)
    s.add(c)
    steps = run(s)
    first = {q: (st, i) for q, st, _, i, _ in steps[0]}
    assert first[b] == (0, 0) and first[c][0] == 36 and first[c][1] > 0
    assert b.num_cached == 0 and c.num_cached == 36


def test_reset_frees_snapshots() -> None:
    s = make()
    s.add(response(0))
    run(s)
    assert s.slots.num_snapshots == 1
    s.bm.reset_prefix_cache()
    assert s.slots.num_used == 0 and s.slots.num_snapshots == 0
    late = response(1)
    s.add(late)
    run(s)
    assert late.num_cached == 0


def test_dense_scheduler_routes_no_state() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8), BlockManager(64, BS))
    s.add(response(0))
    steps = run(s)
    assert [(st, e) for step in steps for _, st, e, _, _ in step] == [(0, 16), (16, 32), (32, 48), (48, 59)]
    assert all(i == o == 0 for step in steps for *_, i, o in step)


def test_host_step_state_arrays_follow_step_order() -> None:
    """A step with a chunked sequence continuing in place, a sibling starting from the
    snapshot, a fresh sequence cut at its cache_end and a fresh short one: the state arrays
    follow the step's order (prefixed first), and only kept states are listed."""
    s = make(budget=16)
    long = plain(40, 300)
    s.add(long)
    s.add(response(0))
    s.finish_step(s.schedule())  # long [0, 16)
    s.cfg.max_num_batched_tokens = 1000
    chunks = s.schedule()  # long [16, 39); response(0) [0, 36) cut
    s.finish_step(chunks)
    sib, other, short = response(1), response(5, prompt=np.arange(600, 620)), plain(6, 800)
    for q in (sib, other, short):
        s.add(q)
    chunks = s.schedule()
    by = {c.seq.request_id: c for c in chunks}
    hs = build_host_step(chunks, BS, linear_state=True)
    order: list[Chunk] = [sp.chunk for sp in hs.scoring.spans]
    assert [c.start > 0 for c in order] == sorted([c.start > 0 for c in order], reverse=True)
    np.testing.assert_array_equal(hs.state.state_in, [c.state_in for c in order])
    assert hs.state.keep.tolist() == [i for i, c in enumerate(order) if c.state_out]
    np.testing.assert_array_equal(hs.state.out, [c.state_out for c in order if c.state_out])
    snap = by[sib.request_id].state_in
    assert snap > 0 and by["r0-None"].state_in == snap  # the first response's rest reads it too
    assert by[other.request_id].state_in == 0 and by[other.request_id].state_out > 0  # cut at its cache_end (16)
    assert (by[short.request_id].state_in, by[short.request_id].state_out) == (0, 0)
    assert len(hs.state.keep) == 1
    assert build_host_step(chunks, BS).state is None  # a dense model's step


def test_pool_state_views() -> None:
    layout = LinearStateLayout(layers=(0, 2), conv_shape=(3, 5), rec_shape=(2, 4, 6), conv_dtype=torch.bfloat16)
    assert layout.slot_bytes() == 2 * (3 * 5 * 2 + 2 * 4 * 6 * 4)
    pool = KVPool(8, CacheLayout.uniform((1, 3), 2, 4, torch.float32, layout), torch.device("cpu"), state_slots=4)
    assert pool.conv_state(2).shape == (4, 3, 5) and pool.conv_state(2).dtype == torch.bfloat16
    assert pool.rec_state(0).shape == (4, 2, 4, 6) and pool.rec_state(0).dtype == torch.float32
    assert pool.k_cache(3).shape == (8, 2, 4)
    for layer in (0, 2):  # zero at allocation, slot 0 included
        assert not pool.conv_state(layer).any() and not pool.rec_state(layer).any()
    pool.rec_state(2)[3] = 1.0  # a view: writes land in the pool, in that layer and slot only
    pool.conv_state(0)[1] = 2.0
    assert pool.rec_state(2)[3].eq(1).all() and not pool.rec_state(2)[:3].any() and not pool.rec_state(0).any()
    assert not pool.conv_state(0)[0].any() and not pool.conv_state(2).any()
    pool.k_cache(1).fill_(1.0)
    pool.k_cache(3).fill_(3.0)
    assert pool.k_cache(1).eq(1).all() and pool.k_cache(3).eq(3).all()  # model layer ids map to their own KV
    assert pool.nbytes == 2 * 2 * 8 * 2 * 4 * 4 + 4 * layout.slot_bytes()
