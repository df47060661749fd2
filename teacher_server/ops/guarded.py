"""A compiled stage that keeps its eager version beside it (``Guarded``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
