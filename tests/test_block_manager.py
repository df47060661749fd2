"""BlockManager and Scheduler bookkeeping (plain Python, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from teacher_server.engine.block_manager import BlockManager, block_hashes
from teacher_server.engine.request import ScoreRequest
from teacher_server.engine.scheduler import Scheduler, SchedulerConfig
from teacher_server.engine.sequence import Sequence


def test_hash_chain_depends_on_prefix_and_salt() -> None:
    t = np.arange(64)
    a = block_hashes(t, 4, 16, None)
    assert len(a) == 4 and len(set(a)) == 4
    assert block_hashes(t, 4, 16, "s") != a
    u = t.copy()
    u[0] = 999  # a change in block 0 changes every later hash
    b = block_hashes(u, 4, 16, None)
    assert all(x != y for x, y in zip(a, b))
    u = t.copy()
    u[40] = 999
    c = block_hashes(u, 4, 16, None)
    assert c[:2] == a[:2] and c[2:] != a[2:]


def test_refcount_lru_eviction() -> None:
    bm = BlockManager(4, 2)
    x = bm.allocate(2)
    bm.register(x[0], b"h0")
    bm.register(x[1], b"h1")
    bm.release(x)
    assert bm.num_free == 4 and bm.match_prefix([b"h0", b"h1"]) == x
    hit = bm.match_prefix([b"h0"])
    bm.acquire(hit)  # a referenced block is never evicted
    y = bm.allocate(3)
    assert x[0] not in y and bm.match_prefix([b"h0"]) == [x[0]]
    assert bm.match_prefix([b"h0", b"h1"]) == [x[0]]  # h1's block was evicted for y
    with pytest.raises(MemoryError):
        bm.allocate(1)
    bm.release(hit)
    bm.release(y)
    assert bm.num_free == 4
    with pytest.raises(AssertionError):
        bm.release(y)


def seq(n: int, start: int, bs: int = 4, salt: str | None = None, prio: int = 0, toks=None) -> Sequence:
    toks = np.arange(n) if toks is None else toks
    return Sequence(ScoreRequest(f"s{n}-{start}-{salt}", toks, start, np.array([1]), priority=prio, cache_salt=salt), bs, True)


def test_chunking_and_budget() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), bm)
    a, b = seq(25, 0), seq(7, 0)
    s.add(a)
    s.add(b)
    steps = []
    while s.has_work():
        chunks = s.schedule()
        assert sum(c.end - c.start for c in chunks) <= 10
        steps.append([(c.seq is a, c.start, c.end) for c in chunks])
        s.finish_step(chunks)
    assert steps[0] == [(True, 0, 10)]
    assert steps[1] == [(True, 10, 20)]
    assert steps[2] == [(True, 20, 24), (False, 0, 6)]  # last logit row of b is 5 (L-2), a's is 23
    assert bm.num_free == 64  # everything released


def test_priority_order() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=1), bm)
    low, high = seq(10, 0, prio=5), seq(11, 0, prio=-1)
    s.add(low)
    s.add(high)
    assert s.schedule()[0].seq is high


def test_group_arriving_together_computes_prompt_once() -> None:
    bm = BlockManager(256, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1000, max_num_seqs=64), bm)
    prompt = np.arange(100, 140)  # 40 tokens = 10 blocks
    group = [Sequence(ScoreRequest(f"g{i}", np.concatenate([prompt, np.arange(i * 20, i * 20 + 20)]), 39,
                                   np.array([1])), 4, True) for i in range(4)]
    for g in group:
        s.add(g)
    first = s.schedule()
    assert [c.seq for c in first] == [group[0]]  # siblings wait for the prompt
    s.finish_step(first)
    second = s.schedule()
    assert [c.seq.request_id for c in second] == [g.request_id for g in group[1:]]
    assert all(c.start == 36 for c in second)  # 9 full blocks (36 tokens) before row 39 reused
    assert all(c.seq.num_cached == 36 for c in second)


def test_salt_isolates_cache() -> None:
    bm = BlockManager(256, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1000, max_num_seqs=64), bm)
    a = seq(40, 30, salt="tenant-a")
    s.finish_step(s.schedule()) if s.add(a) is None else None
    b = seq(40, 30, salt="tenant-b")
    c = seq(40, 30, salt="tenant-a")
    s.add(b)
    s.finish_step(s.schedule())
    s.add(c)
    s.finish_step(s.schedule())
    assert b.num_cached == 0 and c.num_cached == 28


def test_no_deadlock_when_pool_is_tight() -> None:
    """Two long sequences that cannot both be resident: admission reserves blocks so the
    first always finishes and the second then runs."""
    bm = BlockManager(30, 4)  # 120 tokens
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8), bm)
    a, b = seq(100, 0), seq(100, 0, toks=np.arange(100) + 7)
    s.add(a)
    s.add(b)
    for _ in range(50):
        if not s.has_work():
            break
        chunks = s.schedule()
        assert chunks, "no progress"
        s.finish_step(chunks)
    assert not s.has_work()


def test_host_step_parts_agree() -> None:
    """One step's host arrays (a chunked sequence continuing after 20 tokens, and a fresh
    one whose first two blocks are cacheable): prefixed chunks first; the KV plan writes
    each token's KV where ``tok_slots`` says and gathers the prefix into the packed keys
    before the chunk's own; every logit row maps back to its request, with its candidates."""
    from teacher_server.engine.host_step import build_host_step

    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=8), bm)
    a = seq(29, 0)
    b = Sequence(ScoreRequest("b", np.arange(13) + 50, 10, np.array([[7, 8], [9, 10]])), 4, True)
    s.add(a)
    s.finish_step(s.schedule())  # a[0:20)
    s.add(b)
    chunks = s.schedule()  # b fresh [0, 12) (KV of [0, 8) cached), a continues [20, 28)
    hs = build_host_step(chunks, bm.block_size)
    tok, kv, sc = hs.tokens, hs.kv, hs.scoring
    assert [sp.chunk.seq for sp in sc.spans] == [a, b]  # prefixed first
    assert tok.q_lens == [8, 12] and tok.k_lens == [28, 12] and tok.cu_q.tolist() == [0, 8, 20]
    np.testing.assert_array_equal(tok.input_ids, np.concatenate([np.arange(20, 28), np.arange(50, 62)]))
    np.testing.assert_array_equal(tok.positions, np.concatenate([np.arange(20, 28), np.arange(12)]))
    assert kv.n_prefixed == 1 and kv.total_k == 28 and kv.prefix_shared == [0]
    np.testing.assert_array_equal(kv.prefix_pos, np.arange(20))
    np.testing.assert_array_equal(kv.new_pos, np.arange(20, 28))
    np.testing.assert_array_equal(kv.prefix_slots, a.slots(0, 20))
    np.testing.assert_array_equal(kv.write_src, 8 + np.arange(8))
    np.testing.assert_array_equal(kv.write_slots, b.slots(0, 8))
    np.testing.assert_array_equal(kv.tok_slots, np.concatenate([[-1] * 8, b.slots(0, 8), [-1] * 4]))
    # a's rows: positions 20..27; b's: 10 and 11 (start 10, L-1 = 12)
    assert [(sp.rows_at, sp.n_rows) for sp in sc.spans] == [(0, 8), (8, 2)]
    np.testing.assert_array_equal(sc.logits_idx, np.concatenate([np.arange(8), [18, 19]]))
    assert sc.kmax == 2
    np.testing.assert_array_equal(sc.cand, [[1, -1]] * 8 + [[7, 8], [9, 10]])
    assert sc.plp_rows.size == 0 and sc.argmax_rows.size == 0


def test_a_windows_keys_drop_the_prefix_before_its_first_query() -> None:
    """The same step for a model with windows 4 and 30: a's chunk [20, 28) reads keys from
    position 17 (its first query looks back 3) under window 4, so 3 of its 20 prefix keys
    are gathered; window 30 reaches every key, so it keeps the full plan; the fresh chunk's
    keys are its queries under both."""
    from teacher_server.engine.host_step import build_host_step

    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=8), bm)
    a = seq(29, 0)
    s.add(a)
    s.finish_step(s.schedule())
    s.add(Sequence(ScoreRequest("b", np.arange(13) + 50, 10, np.array([[7, 8], [9, 10]])), 4, True))
    hs = build_host_step(s.schedule(), bm.block_size, windows=(4, 30))
    kv = hs.kv
    assert list(kv.windows) == [4]
    w = kv.windows[4]
    assert w.k_lens == [11, 12] and w.cu_k.tolist() == [0, 11, 23] and w.total_k == 11
    np.testing.assert_array_equal(w.prefix_slots, a.slots(17, 20))
    np.testing.assert_array_equal(w.prefix_pos, np.arange(3))
    np.testing.assert_array_equal(w.new_pos, np.arange(3, 11))
    assert w.prefix_shared == [0]


def test_siblings_on_one_cached_prompt_share_their_windows_keys() -> None:
    """Two responses to a cached 24-token prompt (start 24 each): under window 6 each gathers
    the prompt's last 5 keys, the same pool entries, so the second shares all 5; the full
    plan shares all 24."""
    from teacher_server.engine.host_step import build_host_step

    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), bm)
    prompt = np.arange(24) + 100
    s.add(seq(26, 24, toks=np.concatenate([prompt, [1, 2]])))
    s.finish_step(s.schedule())
    for tail in ([3, 4, 5], [6, 7, 8]):
        s.add(seq(27, 24, toks=np.concatenate([prompt, tail])))
    chunks = s.schedule()
    assert [(c.start, c.end) for c in chunks] == [(24, 26), (24, 26)]  # the last position scores nothing
    kv = build_host_step(chunks, bm.block_size, windows=(6,)).kv
    assert kv.prefix_shared == [0, 24]
    w = kv.windows[6]
    assert w.prefix_shared == [0, 5] and w.k_lens == [7, 7] and w.total_k == 14
    np.testing.assert_array_equal(w.prefix_slots[:5], w.prefix_slots[5:])


def _steps(s: Scheduler, named: dict[str, Sequence]) -> list[list[tuple[str, int, int]]]:
    """Run the scheduler to completion: per step, (name, start, end) of each chunk."""
    names = {id(q): k for k, q in named.items()}
    out = []
    while s.has_work():
        chunks = s.schedule()
        assert chunks, "a step with work must schedule something"
        assert sum(c.end - c.start for c in chunks) <= s.cfg.max_num_batched_tokens
        out.append([(names[id(c.seq)], c.start, c.end) for c in chunks])
        s.finish_step(chunks)
    return out


def test_a_sequence_that_fits_a_step_is_not_split_to_fill_a_full_one() -> None:
    """Once the step holds whole_fill of its budget, a sequence the budget would cut (but
    that fits a step of its own) waits for the next step, where it goes first; shorter
    ones behind it fill this step. whole_fill=1 splits to fill, as before."""
    def run(fill: float) -> list:
        bm = BlockManager(256, 4)
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, whole_fill=fill), bm)
        named = {"a": seq(61, 0), "b": seq(61, 0), "c": seq(31, 0), "d": seq(41, 0)}
        for q in named.values():
            s.add(q)
        steps = _steps(s, named)
        assert bm.num_free == 256
        return steps

    assert run(0.5) == [[("a", 0, 60), ("c", 0, 30)], [("b", 0, 60), ("d", 0, 40)]]
    assert run(1.0) == [[("a", 0, 60), ("b", 0, 40)], [("b", 40, 60), ("c", 0, 30), ("d", 0, 40)]]


def test_splits_that_cannot_be_avoided_still_fill_the_step() -> None:
    """A sequence longer than the budget is split to fill the rest, and so is any sequence
    while the step holds less than whole_fill of its budget."""
    bm = BlockManager(256, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, whole_fill=0.5), bm)
    named = {"a": seq(61, 0), "long": seq(251, 0), "short": seq(31, 0), "b": seq(81, 0)}
    for q in named.values():
        s.add(q)
    assert _steps(s, named) == [
        [("a", 0, 60), ("long", 0, 40)],  # long fits no step whole: it fills this one
        [("long", 40, 140)],
        [("long", 140, 240)],
        [("long", 240, 250), ("short", 0, 30), ("b", 0, 60)],  # 40 held (< 50): b split to fill
        [("b", 60, 80)],
    ]


def test_a_sequence_passed_over_is_not_pushed_back_by_later_splits() -> None:
    """Behind a passed-over sequence a step takes only sequences that end in it: a long
    lower-priority one arriving every other step must not be split in ahead of it (its
    continuation would hold the next step and push the passed one back again, forever)."""
    bm = BlockManager(4096, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, whole_fill=0.5), bm)
    a, p = seq(61, 0), seq(61, 0, salt="p")
    s.add(a)
    s.add(p)
    first = None
    for step in range(40):
        if step % 2 == 0:
            s.add(seq(201, 0, salt=f"long{step}", prio=5))
        chunks = s.schedule()
        if first is None and any(c.seq is p for c in chunks):
            first = step
        s.finish_step(chunks)
    assert first == 1, first  # passed over in step 0 (a holds 60 of 100), first in step 1


def test_a_prefix_hit_can_make_a_long_sequence_fit_whole() -> None:
    """What must fit a step is what is left after the cache hit: a sequence longer than the
    budget whose cached prompt leaves less than a budget is passed over, not split."""
    bm = BlockManager(256, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, whole_fill=0.5), bm)
    toks = np.arange(141)
    first = seq(141, 81, toks=toks)  # 140 to compute; blocks before row 81 are cacheable (80 tokens)
    s.add(first)
    while s.has_work():
        s.finish_step(s.schedule())
    a, again = seq(61, 0, salt="a"), seq(141, 81, toks=toks)  # again: 80 cached, 60 left
    s.add(a)
    s.add(again)
    named = {"a": a, "again": again}
    assert _steps(s, named) == [[("a", 0, 60)], [("again", 80, 140)]]
