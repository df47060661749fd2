"""Scheduler: packs chunks of many sequences into one step under a token budget. No torch.

Policy, each step:
1. Sequences already part-way (chunked) continue first, oldest first; their KV blocks were
   reserved when they were admitted, so they always make progress (no deadlock).
2. Waiting sequences are admitted in (priority, arrival) order. A sequence reuses the
   longest cached prefix; if the next block of its prefix is being computed right now by
   another sequence (a GRPO group arriving together), it waits one step and then hits the
   cache instead of computing the prompt again.
3. A sequence that does not fit the remaining budget is split: the rest runs next step.
   Except, once the step holds ``whole_fill`` of its budget, one that would fit a step of
   its own waits for the next (where it is first in line) and shorter ones behind it fill
   this step whole: a split costs its second chunk attention over the first's keys (read
   back from the pool, on a slower path than a fresh sequence's) and the KV writes and
   reads between them, where a step a little short of its budget costs nothing per token.
   Behind a sequence passed over, a step takes only sequences that end in it, so no later
   one starts part-way and runs ahead of it next step.

Hybrid models (``slots`` given: linear-attention layers carry a state per sequence, see
``StateSlots``):
4. A sequence admitted with a chunk that is not its last holds a working state slot until
   it ends (admission waits when none can be had, like blocks); its chunks carry their
   state there in place.
5. With prefix caching, the state at ``cache_end`` is kept as a snapshot bound to the
   prefix-cache block that ends there: the chunk that would cross ``cache_end`` is cut
   there (no slot to be had: no snapshot, no cut). A prefix hit counts only up to the
   deepest matched block with a snapshot, and the sequence starts from that snapshot. A
   sibling of a sequence that computes the same snapshot now waits for it (rule 2).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.sequence import Chunk, Sequence
from teacher_server.engine.state_slots import StateSlots


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    deterministic: bool = False
    # Share of the budget from which a sequence that fits a step of its own is not split to
    # fill the rest (rule 3); 1.0: always split to fill.
    whole_fill: float = 1.0


# Waiting sequences a step passes over at most while it looks for ones that fit whole.
_LOOKAHEAD = 64


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, slots: StateSlots | None = None) -> None:
        self.cfg = cfg
        self.bm = blocks
        self.slots = slots  # hybrid models only
        if slots is not None:  # a snapshot goes with its block when the block leaves the prefix cache
            blocks.on_evict = slots.drop_block
        self.waiting: list[tuple[int, int, Sequence]] = []  # sorted by (priority, order)
        self.running: list[Sequence] = []  # part-way, hold blocks, oldest first

    # --- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, (seq.req.priority, seq.order, seq), key=lambda t: (t[0], t[1]))

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks and state slots."""
        seq.aborted = True
        self.waiting = [t for t in self.waiting if t[2] is not seq]
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ----------------------------------------------------------------------
    def _reserved(self) -> int:
        return sum(max(s.max_blocks - len(s.block_table), 0) for s in self.running)

    def _inflight_hashes(self, chunks: list[Chunk]) -> set[bytes]:
        """Cacheable blocks some scheduled or running sequence computes but has not registered."""
        out: set[bytes] = set()
        for s in [c.seq for c in chunks] + self.running:
            if s.cache_end:
                out.update(s.hashes[s.num_registered:])
        return out

    def schedule(self) -> list[Chunk]:
        budget = self.cfg.max_num_batched_tokens
        max_seqs = 1 if self.cfg.deterministic else self.cfg.max_num_seqs
        chunks: list[Chunk] = []
        for seq in list(self.running):
            if budget <= 0 or len(chunks) >= max_seqs:
                break
            n = min(seq.remaining, budget)
            if self._snapshot_due(seq, seq.num_computed, n):
                seq.snapshot_slot = self.slots.take() or 0  # none: no snapshot, no cut
                if seq.snapshot_slot:
                    n = seq.cache_end - seq.num_computed
            chunks.append(self._take(seq, n))
            budget -= chunks[-1].end - chunks[-1].start
        if budget <= 0 or len(chunks) >= max_seqs:
            return chunks
        inflight = self._inflight_hashes(chunks)
        reserved = self._reserved()  # kept up to date below: O(1) per waiting sequence
        full = self.cfg.max_num_batched_tokens
        passed = 0  # sequences passed over in this step (rule 3)
        admitted: list[int] = []
        for i, (_, _, seq) in enumerate(self.waiting):
            if budget <= 0 or len(chunks) >= max_seqs or passed >= _LOOKAHEAD:
                break
            hashes = seq.hashes if seq.cache_end else []
            hit = self.bm.match_prefix(hashes)
            if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
                continue  # its prompt is being computed by a sibling: reuse it next step
            hit_slot = 0
            if self.slots is not None and hit:
                hit, hit_slot = self._snapshot_hit(hit)
                if len(hit) < len(hashes) and hashes[-1] in inflight:
                    continue  # a sibling computes the state at its cache_end now: start from it next step
            fit = self._fit(seq, hit, budget, reserved, hit_slot)
            if fit is None:
                break  # keep admission order; blocks and slots free up as running sequences finish
            n, final, snapshot = fit
            cached = len(hit) * self.bm.block_size
            if (not final and not snapshot and full - budget >= self.cfg.whole_fill * full
                    and seq.num_tokens - cached <= full):
                passed += 1  # cut by the budget alone, and it fits a step of its own: next step, whole
                continue
            if passed and not final:
                # Behind a passed-over sequence only whole ones: a later one split here would run
                # part-way next step ahead of it, and could push it back again, step after step.
                passed += 1  # passed over too: the look-ahead bounds the scan either way
                continue
            self.bm.acquire(hit)
            self.bm.record_lookup(seq.cache_end, cached)
            seq.block_table = list(hit)
            seq.num_computed = seq.num_cached = cached
            seq.num_registered = len(hit)
            if self.slots is not None:
                self._admit_state(seq, hit_slot, final, snapshot)
            if seq.result is not None:
                seq.result.scheduled_at = time.monotonic()
            chunks.append(self._take(seq, n))
            budget -= n
            admitted.append(i)
            if not final:
                self.running.append(seq)
                reserved += max(seq.max_blocks - len(seq.block_table), 0)
            inflight.update(hashes[len(hit):])
        for i in reversed(admitted):
            del self.waiting[i]
        return chunks

    def _fit(self, seq: Sequence, hit: list[int], budget: int, reserved: int,
             hit_slot: int) -> tuple[int, bool, bool] | None:
        """(chunk length, final, ends at a snapshot) of a waiting sequence that starts after
        its cache hit ``hit``, when the blocks (and state slots) it needs can be had now."""
        cached = len(hit) * self.bm.block_size
        remaining = seq.num_tokens - cached
        n = min(remaining, budget)
        hit_free = sum(1 for b in hit if self.bm.ref[b] == 0)  # evictable ones we would pin
        free_blocks = self.bm.num_free - hit_free - reserved
        free_slots = 0
        if self.slots is not None:  # an idle snapshot we start from would be pinned too
            free_slots = self.slots.num_available - (1 if hit_slot and self.slots.refs[hit_slot] == 0 else 0)
        for snapshot in ((True, False) if self._snapshot_due(seq, cached, n) else (False,)):
            m = seq.cache_end - cached if snapshot else n
            final = m == remaining
            # Blocks this sequence will hold beyond its cache hits.
            if final:
                need = max(self.bm.blocks_for(seq.cache_end) - len(hit), 0)
            else:
                need = seq.max_blocks - len(hit)
            need_slots = (0 if final or self.slots is None else 1) + snapshot  # working slot, snapshot
            if free_blocks >= need and free_slots >= need_slots:
                return m, final, snapshot
        return None

    # --- linear-attention state (hybrid models) -------------------------------------------
    def _snapshot_due(self, seq: Sequence, start: int, n: int) -> bool:
        """A chunk [start, start + n) reaches the sequence's cache_end, where its state is
        to be kept as a snapshot."""
        return self.slots is not None and self.bm.enable_prefix_caching and start < seq.cache_end <= start + n

    def _snapshot_hit(self, hit: list[int]) -> tuple[list[int], int]:
        """A cache hit cut back to its deepest block with a snapshot, and that snapshot's slot
        (([], 0) when none has one)."""
        for j in range(len(hit), 0, -1):
            s = self.slots.snapshot(hit[j - 1])
            if s is not None:
                return hit[:j], s
        return [], 0

    def _admit_state(self, seq: Sequence, hit_slot: int, final: bool, snapshot: bool) -> None:
        """Take the slots an admitted sequence needs (``_fit`` said they can be had)."""
        if hit_slot:
            self.slots.acquire(hit_slot)  # first, so that taking slots below cannot evict it
            seq.state_read = seq.state_src = hit_slot
        if not final:
            seq.state_slot = self.slots.take()
        if snapshot:
            seq.snapshot_slot = self.slots.take()
        assert seq.state_slot or final, "a working slot was counted free"
        assert seq.snapshot_slot or not snapshot, "a snapshot slot was counted free"

    def _take(self, seq: Sequence, n: int) -> Chunk:
        start, end = seq.num_computed, seq.num_computed + n
        final = end == seq.num_tokens
        write_end = max(start, min(end, seq.cache_end)) if final else end
        have = len(seq.block_table)
        need = self.bm.blocks_for(write_end) - have
        if need > 0:
            seq.block_table.extend(self.bm.allocate(need))
        c = Chunk(seq, start, end, write_end)
        if self.slots is not None:
            # A snapshot chunk ends at cache_end (it was cut there), before the last row: never final.
            c.state_in, c.state_out = seq.state_src, seq.snapshot_slot or (0 if final else seq.state_slot)
            seq.state_src = c.state_out
            assert (start == 0 or c.state_in) and (final or c.state_out), \
                f"chunk [{start}, {end}) of {seq.request_id!r}: state in {c.state_in}, out {c.state_out}"
        return c

    def finish_step(self, chunks: list[Chunk]) -> list[Sequence]:
        """Advance sequences after their step ran; register newly computed cacheable blocks.
        Returns the sequences that are complete (their blocks released). A sequence aborted
        after this step was scheduled (its previous step failed while this one launched) is
        left as the abort left it: no blocks, nothing to register."""
        done = []
        for c in chunks:
            seq = c.seq
            if seq.aborted:
                continue
            seq.num_computed = c.end
            full = min(c.write_end, seq.cache_end) // self.bm.block_size
            for i in range(seq.num_registered, full):
                self.bm.register(seq.block_table[i], seq.hashes[i])
            seq.num_registered = max(seq.num_registered, full)
            if self.slots is not None:
                self._advance_state(c)
            if c.final:
                if seq in self.running:
                    self.running.remove(seq)
                self._free(seq)
                done.append(seq)
        return done

    def _advance_state(self, c: Chunk) -> None:
        """After a hybrid chunk was scheduled (its blocks registered): release the snapshot it
        read; bind the one it wrote to the prefix cache's block at cache_end, which the next
        chunk reads."""
        seq = c.seq
        if seq.state_read and c.state_in == seq.state_read:
            self.slots.release(seq.state_read)
            seq.state_read = 0
        if seq.snapshot_slot:
            s, seq.snapshot_slot = seq.snapshot_slot, 0
            # The registered block of this hash (ours, or another computed concurrently). None or
            # a block with a snapshot already: s stays private and is freed after the next read.
            b = self.bm.cached.get(seq.hashes[-1])
            if b is not None:
                self.slots.bind(s, b)
            seq.state_read = s

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.bm.release(seq.block_table)
            seq.block_table = []
        if self.slots is not None:
            for s in (seq.state_slot, seq.state_read, seq.snapshot_slot):
                if s:
                    self.slots.release(s)
            seq.state_slot = seq.state_read = seq.snapshot_slot = seq.state_src = 0
