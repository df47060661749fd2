"""Scheduler: packs chunks of many sequences into one step under a token budget. No torch.

Policy, each step:
1. Sequences already part-way (chunked) continue first, oldest first; their KV blocks were
   reserved when they were admitted, so they always make progress (no deadlock).
2. Waiting sequences are admitted in (priority, arrival) order. A sequence reuses the
   longest cached prefix; if the next block of its prefix is being computed right now by
   another sequence (a GRPO group arriving together), it waits one step and then hits the
   cache instead of computing the prompt again.
3. A sequence that does not fit the remaining budget is split: the rest runs next step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.sequence import Chunk, Sequence


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    deterministic: bool = False


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.bm = blocks
        self.waiting: list[tuple[int, int, Sequence]] = []  # sorted by (priority, order)
        self.running: list[Sequence] = []  # part-way, hold blocks, oldest first

    # --- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, (seq.req.priority, seq.order, seq), key=lambda t: (t[0], t[1]))

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks."""
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
            chunks.append(self._take(seq, min(seq.remaining, budget)))
            budget -= chunks[-1].end - chunks[-1].start
        if budget <= 0 or len(chunks) >= max_seqs:
            return chunks
        inflight = self._inflight_hashes(chunks)
        reserved = self._reserved()  # kept up to date below: O(1) per waiting sequence
        admitted: list[int] = []
        for i, (_, _, seq) in enumerate(self.waiting):
            if budget <= 0 or len(chunks) >= max_seqs:
                break
            hashes = seq.hashes if seq.cache_end else []
            hit = self.bm.match_prefix(hashes)
            if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
                continue  # its prompt is being computed by a sibling: reuse it next step
            cached = len(hit) * self.bm.block_size
            remaining = seq.num_tokens - cached
            n = min(remaining, budget)
            final = n == remaining
            # Blocks this sequence will hold beyond its cache hits.
            if final:
                need = max(self.bm.blocks_for(seq.cache_end) - len(hit), 0)
            else:
                need = seq.max_blocks - len(hit)
            hit_free = sum(1 for b in hit if self.bm.ref[b] == 0)  # evictable ones we would pin
            if self.bm.num_free - hit_free - reserved < need:
                break  # keep admission order; blocks free up as running sequences finish
            self.bm.acquire(hit)
            self.bm.record_lookup(seq.cache_end, cached)
            seq.block_table = list(hit)
            seq.num_computed = seq.num_cached = cached
            seq.num_registered = len(hit)
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

    def _take(self, seq: Sequence, n: int) -> Chunk:
        start, end = seq.num_computed, seq.num_computed + n
        final = end == seq.num_tokens
        write_end = max(start, min(end, seq.cache_end)) if final else end
        have = len(seq.block_table)
        need = self.bm.blocks_for(write_end) - have
        if need > 0:
            seq.block_table.extend(self.bm.allocate(need))
        return Chunk(seq, start, end, write_end)

    def finish_step(self, chunks: list[Chunk]) -> list[Sequence]:
        """Advance sequences after their step ran; register newly computed cacheable blocks.
        Returns the sequences that are complete (their blocks released)."""
        done = []
        for c in chunks:
            seq = c.seq
            seq.num_computed = c.end
            full = min(c.write_end, seq.cache_end) // self.bm.block_size
            for i in range(seq.num_registered, full):
                self.bm.register(seq.block_table[i], seq.hashes[i])
            seq.num_registered = max(seq.num_registered, full)
            if c.final:
                if seq in self.running:
                    self.running.remove(seq)
                self._free(seq)
                done.append(seq)
        return done

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.bm.release(seq.block_table)
            seq.block_table = []
