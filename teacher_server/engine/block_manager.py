"""BlockManager: the paged KV pool's bookkeeping and the prefix cache. No torch.

A block holds ``block_size`` token slots. Full blocks that lie wholly before a request's
first scored row are *cacheable*: once computed they are registered under a hash chain
over (previous hash, cache salt, token ids) and can be shared by later requests.
Blocks are reference counted; cached blocks whose count drops to zero stay resident
and are evicted least-recently-used when the pool runs dry. A block with a non-zero
count is never evicted. ``on_evict`` (if set) hears of every block that leaves the prefix
cache, so state bound to it (a hybrid model's snapshot, ``StateSlots``) goes with it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


def block_hashes(tokens: np.ndarray, n_blocks: int, block_size: int, salt: str | None) -> list[bytes]:
    """Hash chain of the first ``n_blocks`` full blocks: h_i = H(h_{i-1} | salt | tokens_i)."""
    out: list[bytes] = []
    # no salt and "" never collide; any str hashes (a lone surrogate too, as the replicas' router reads it)
    seed = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
    prev = hashlib.blake2b(seed, digest_size=16, person=b"ts-salt").digest()
    toks = np.ascontiguousarray(tokens[: n_blocks * block_size], dtype=np.int64)
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(toks[i * block_size:(i + 1) * block_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, f"num_blocks={num_blocks} block_size={block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack of never-hashed blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id (registered, computed)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref == 0 and hashed, LRU first
        self.on_evict: Callable[[int], None] | None = None  # called with a block that leaves the cache
        # stats
        self.hit_tokens = 0
        self.query_tokens = 0

    # --- capacity --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------------
    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Longest run of cached blocks for this hash chain (not yet referenced)."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (from match_prefix)."""
        for b in blocks:
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """Mark a computed full block as holding the prefix with hash ``h``."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if h in self.cached:  # computed twice concurrently: keep the first, this one stays private
            return
        self.block_hash[block] = h
        self.cached[h] = block

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # --- allocation -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1). Evicts least-recently-used cached blocks when needed."""
        if n > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; unreferenced cached blocks become evictable
        (most recently used last), others go back to the free list."""
        # Leaf first, so within one chain the later blocks are evicted before the earlier.
        for b in reversed(blocks):
            assert self.ref[b] > 0, f"double release of block {b}"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None  # most recently used: end of the LRU order
                else:
                    self.free.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block."""
        for b in list(self.evictable):
            self._forget(b)
            self.free.append(b)
        self.evictable.clear()

    def _forget(self, b: int) -> None:
        """Block ``b`` (unreferenced) no longer holds a cached prefix."""
        h = self.block_hash[b]
        if h is not None and self.cached.get(h) == b:
            del self.cached[h]
        self.block_hash[b] = None
        if self.on_evict is not None:
            self.on_evict(b)
