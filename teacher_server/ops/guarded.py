"""A compiled stage that keeps its eager version beside it (``Guarded``); kernels whose first
launch may fail to compile, and whose calls then go to a torch path (``FirstLaunch``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)


class Guarded:
    """A compiled stage that falls back to its eager version for good the first time
    compilation fails at run time (for example a recompile limit); results stay correct."""

    def __init__(self, compiled: Callable, eager: Callable) -> None:
        self.compiled, self.eager, self.ok = compiled, eager, True

    def __call__(self, *args):  # noqa: ANN002, ANN204
        if self.ok:
            try:
                return self.compiled(*args)
            except Exception as e:
                if not isinstance(e, torch._dynamo.exc.TorchDynamoException) and "inductor" not in type(e).__module__:
                    raise
                log.warning("compiled %s failed at run time (%s); using eager", self.eager.__name__, type(e).__name__)
                self.ok = False
        return self.eager(*args)


class FirstLaunch:
    """What a Triton kernel's launches have shown, per key (what it was compiled for): a key
    whose first launch raised (compiling, or a launch this build refuses) is left to the
    caller's fallback (a torch path, another kernel) from then on, logged once; a launch that
    raises after one of that key succeeded is the call's own error, raised."""

    def __init__(self, what: str) -> None:
        self.what, self.failed, self.launched = what, set(), set()

    def usable(self, key: Hashable = None) -> bool:
        return key not in self.failed

    def fail(self, key: Hashable = None) -> None:
        """Leave ``key`` to the torch path (e.g. its start-up check failed)."""
        self.failed.add(key)

    def run(self, launch: Callable[[], object], key: Hashable = None) -> bool:
        """Launch; False where this was the key's first launch and it raised."""
        try:
            launch()
        except Exception as e:
            if key in self.launched:
                raise
            self.failed.add(key)
            log.warning("%s%s failed, its fallback runs instead: %s: %s", self.what,
                        "" if key is None else f" {key}", type(e).__name__, str(e)[:300])
            return False
        self.launched.add(key)
        return True
