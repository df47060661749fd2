"""Which replica serves a request: one policy for the server's front (``--data-parallel-size``)
and for the client over many hosts.

Affinity: requests whose reusable prefix (the full token blocks before the first scored row,
``block_size`` tokens each, the server's block size, 16 by default) is the same under the same
``cache_salt`` go to the same replica, the one with the highest rendezvous weight
``hash(key, replica)``. A GRPO group (n responses to one prompt) so lands where the prompt's KV
is cached, and adding or removing a replica moves only the keys that replica wins or held. The
key covers the whole reusable prefix, not its first blocks: prompts that open with one system
prompt (of any length) and differ after it are different groups, spread over the replicas (each
of which then computes the shared part once), not one key on one replica.

Spill, decided once per prefix: the first request of a key goes to its preferred replica unless
that one is overloaded, that is when its outstanding tokens (sent, not yet answered) exceed the
least-loaded replica's by more than ``spill_tokens`` (default ``SPILL_TOKENS``, 8192: half a step
of the default GPU token budget); it then goes to the least-loaded replica. The bound is
absolute, not a ratio: a trainer sends a batch and waits for all of it, so the batch takes as
long as its most loaded replica, and new prefixes keep the replicas within about one request
plus ``spill_tokens`` of each other. Where a key went is remembered (the last ``PLACED_KEYS``
keys), and its later requests follow it there, so a GRPO group stays whole on one replica, where
its prompt is cached, even while the load moves; only when that replica's load passes
``STICKY_RATIO`` (2) x the least loaded's plus ``STICKY_SPILLS`` (8) x ``spill_tokens`` is the
key placed again.
Deciding per request instead splits many groups under a steady load (each split costs one more
prefill of the prompt). Requests with no full reusable block go to the least-loaded replica.
``round_robin`` ignores prefixes and load (a comparison for benchmarks).

Plain Python + numpy: the client imports it without torch.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np

Routing = Literal["affinity", "round_robin"]
BLOCK_SIZE = 16  # the server's default block_size (Config.block_size)
SPILL_TOKENS = 8192
STICKY_RATIO = 2.0
STICKY_SPILLS = 8
PLACED_KEYS = 65536


def reusable_tokens(start: int, prompt_logprobs: int | None = None) -> int:
    """Tokens before the first position that must reach the LM head: what a prefix cache can
    serve. Classic ``prompt_logprobs`` scores every position, so nothing is reusable then."""
    return 0 if prompt_logprobs is not None else max(int(start), 0)


def prefix_key(token_ids: Sequence[int] | np.ndarray, reusable: int, cache_salt: str | None = None,
               block_size: int = BLOCK_SIZE) -> bytes | None:
    """The routing key of a request: a digest of its ``reusable // block_size`` full token blocks
    and its salt, or None when it has no full reusable block."""
    n = min(reusable, len(token_ids)) // block_size * block_size
    if n <= 0:
        return None
    toks = np.asarray(token_ids[:n], dtype="<i8")  # the same bytes whatever the caller's dtype
    h = hashlib.blake2b(toks.tobytes(), digest_size=16)
    h.update(b"\x00salt\x00" + (cache_salt or "").encode("utf-8", "surrogatepass"))
    return h.digest()


def rendezvous(key: bytes, replicas: Sequence[str]) -> str:
    """The replica of ``replicas`` with the highest weight for ``key`` (highest random weight
    hashing): stable for a key while that replica is present."""
    assert replicas, "rendezvous over no replicas"
    return max(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest())


def check_routing(routing: str) -> None:
    """ValueError for a routing policy that is not one of ``Routing``'s."""
    if routing not in ("affinity", "round_robin"):
        raise ValueError(f"routing must be 'affinity' or 'round_robin', got {routing!r:.40}")


class Router:
    """Picks a replica for each request. ``replicas`` names the candidates (the server's
    replica indices as strings, or the client's base URLs); ``load`` maps each to its
    outstanding tokens. Thread-safe (round-robin keeps a counter)."""

    def __init__(self, routing: Routing = "affinity", block_size: int = BLOCK_SIZE,
                 spill_tokens: int = SPILL_TOKENS) -> None:
        check_routing(routing)
        if not (block_size >= 1 and spill_tokens >= 0):
            raise ValueError(f"block_size must be >= 1 and spill_tokens >= 0, got {block_size}, {spill_tokens}")
        self.routing = routing
        self.block_size = block_size
        self.spill_tokens = spill_tokens
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._placed: OrderedDict[bytes, str] = OrderedDict()  # key -> replica, least recent first

    def key(self, token_ids: Sequence[int] | np.ndarray, reusable: int, cache_salt: str | None) -> bytes | None:
        return prefix_key(token_ids, reusable, cache_salt, self.block_size)

    def pick(self, key: bytes | None, load: dict[str, int]) -> str:
        """The replica for a request with routing key ``key`` (see ``prefix_key``)."""
        assert load, "no replica to route to"
        names = sorted(load)
        if self.routing == "round_robin":
            with self._lock:
                return names[next(self._turn) % len(names)]
        least = min(names, key=lambda r: (load[r], r))
        if key is None:
            return least
        with self._lock:
            placed = self._placed.get(key)
            if placed in load and load[placed] <= STICKY_RATIO * load[least] + STICKY_SPILLS * self.spill_tokens:
                self._placed.move_to_end(key)
                return placed
            preferred = rendezvous(key, names)
            if load[preferred] > load[least] + self.spill_tokens:
                preferred = least
            self._placed[key] = preferred
            self._placed.move_to_end(key)
            if len(self._placed) > PLACED_KEYS:
                self._placed.popitem(last=False)
            return preferred
