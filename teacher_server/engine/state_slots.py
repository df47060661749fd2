"""StateSlots: the bookkeeping of the linear-attention state slots of the KV pool. No torch.

A hybrid model's linear layers keep, per sequence, a convolution state and a recurrent
state instead of KV; the pool holds ``num_slots`` of them per layer (``KVPool.conv_state``
/ ``rec_state``). Slot 0 is the zero state (a sequence starting at position 0) and is never
handed out. The others are:

- *working* slots: a sequence processed in several chunks holds one from admission to its
  end, and each chunk carries its state there in place;
- *snapshots*: the state of a prompt at its reuse boundary, bound to the prefix-cache block
  that ends there (``bind``), so later requests with the same prefix (a GRPO group's other
  responses) start from it instead of position 0.

Each slot has a reference count: a working slot is held by its sequence; a snapshot by each
sequence that still has to read it (``acquire``). A bound snapshot that nobody holds stays
resident and is evicted least-recently-used when slots run short (``take``); it is freed at
once when its block leaves the prefix cache (``drop_block``: eviction or a reset). A slot
read by a scheduled step is released only after that step was scheduled, so a later step
is the first that may reuse it (one CUDA stream orders them).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        """``num_slots``: the pool's slots, slot 0 (the zero state) included."""
        assert num_slots >= 2, f"num_slots={num_slots}: slot 0 and at least one more"
        self.num_slots = num_slots
        self.refs = [0] * num_slots
        self.free: list[int] = list(range(num_slots - 1, 0, -1))  # stack, lowest slot on top
        self.snap_of: dict[int, int] = {}  # block -> its snapshot slot
        self.block_of: dict[int, int] = {}  # snapshot slot -> its block
        self.idle: OrderedDict[int, None] = OrderedDict()  # bound, refs == 0: least recently used first

    # --- capacity ----------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Slots ``take`` can hand out now (free, or an idle snapshot it would evict)."""
        return len(self.free) + len(self.idle)

    @property
    def num_used(self) -> int:
        """Slots not free (held or holding a snapshot); slot 0 not counted."""
        return self.num_slots - 1 - len(self.free)

    @property
    def num_snapshots(self) -> int:
        return len(self.block_of)

    # --- slots -------------------------------------------------------------------------
    def take(self) -> int | None:
        """A slot with one reference (the caller's), or None when every slot is held. Evicts
        the least recently used idle snapshot when no slot is free."""
        if self.free:
            s = self.free.pop()
        elif self.idle:
            s, _ = self.idle.popitem(last=False)
            del self.snap_of[self.block_of.pop(s)]
        else:
            return None
        self.refs[s] = 1
        return s

    def acquire(self, slot: int) -> None:
        """One more reference on a held slot or a snapshot (it is not evicted meanwhile)."""
        assert slot > 0 and (self.refs[slot] > 0 or slot in self.block_of), f"slot {slot} is free"
        self.refs[slot] += 1
        self.idle.pop(slot, None)

    def release(self, slot: int) -> None:
        """Drop one reference; an unreferenced snapshot becomes idle (most recently used),
        any other unreferenced slot free."""
        assert slot > 0 and self.refs[slot] > 0, f"double release of state slot {slot}"
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            if slot in self.block_of:
                self.idle[slot] = None
            else:
                self.free.append(slot)

    # --- snapshots ---------------------------------------------------------------------
    def snapshot(self, block: int) -> int | None:
        """The snapshot slot bound to a prefix-cache block, if any."""
        return self.snap_of.get(block)

    def bind(self, slot: int, block: int) -> bool:
        """Make a held slot the snapshot of ``block`` (the references stay). False when the
        block already has one (the slot stays unbound: freed at its last release)."""
        assert self.refs[slot] > 0 and slot not in self.block_of, f"slot {slot} is not held or already bound"
        if block in self.snap_of:
            return False
        self.snap_of[block], self.block_of[slot] = slot, block
        return True

    def drop_block(self, block: int) -> None:
        """``block`` left the prefix cache: its snapshot is freed (at its last release when
        someone still reads it)."""
        s = self.snap_of.pop(block, None)
        if s is None:
            return
        del self.block_of[s]
        if self.refs[s] == 0:
            del self.idle[s]
            self.free.append(s)
