"""Triton kernels defined on first use: ``lazy(cache, name, define)`` imports Triton, has
``define(triton, tl)`` make the kernels and keeps them in ``cache``; without Triton (the CPU
wheel) the cache holds only ``missing`` and the op takes its torch path."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def lazy(cache: dict[str, Any], name: str, define: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """``cache``, filled on the first call: the kernels ``define`` returns, or ``missing``."""
    if cache:
        return cache
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # no triton (the CPU wheel)
        log.info("%s unavailable: %s: %s", name, type(e).__name__, e)
        cache["missing"] = True
        return cache
    cache.update(define(triton, tl))
    return cache
