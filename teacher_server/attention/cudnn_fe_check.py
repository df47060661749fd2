"""The cudnn_fe backend's start-up check: the check step (``cudnn_check``) through the backend
against the float32 reference, and again with freshly built graphs where plans read back from
the plan store fail it."""

from __future__ import annotations

import logging

import torch

from teacher_server.attention.cudnn_check import CHECK_HEADS, check_with_reference
from teacher_server.attention.cudnn_fe import CudnnFrontendBackend, FeCall

log = logging.getLogger("teacher_server.attention.cudnn_fe")  # the backend's own logger


def checked(backend: CudnnFrontendBackend, device: torch.device, dtype: torch.dtype,
            heads: tuple[int, int, int] = CHECK_HEADS) -> bool:
    """``frontend_check``, and where it fails after graphs were read from the plan store: the
    store is left, every graph built here again, and the check run once more (a saved plan
    that runs wrong costs its start-up time, never the backend)."""
    if frontend_check(backend, device, dtype, heads):
        return True
    if backend.plans is None or not backend.loaded:
        return False
    log.warning("cuDNN frontend attention failed its check with plans read from %s; building them instead",
                backend.plans.dir)
    backend.plans, backend.enabled = None, True
    backend._graphs.clear()
    backend.loaded.clear()
    return frontend_check(backend, device, dtype, heads)


def frontend_check(backend: CudnnFrontendBackend, device: torch.device, dtype: torch.dtype,
                   heads: tuple[int, int, int] = CHECK_HEADS) -> bool:
    """Run the check step through the cudnn_fe backend (prefixed sequences, one sharing a
    prefix, fresh ones, a short one; ``heads``: query heads, kv heads, head dim) against the
    float32 sdpa reference: True when it agrees and took its own calls for both parts."""
    x, ctx_on, ref = check_with_reference(device, dtype, heads)
    d = x.q.shape[-1]
    try:
        c = ctx_on(device)
        got = backend(x, c, d ** -0.5, None).float().cpu()
    except Exception as e:
        log.warning("cuDNN frontend attention self-check raised: %s", " ".join(str(e).split())[:300])
        return False
    calls = sum(isinstance(it, FeCall) for it in c.attn_plan.items)
    err = (got - ref).abs().max().item()
    if calls == 2 and err < 2e-2:
        return True
    log.warning("cuDNN frontend attention failed its self-check: error %.3g, %d calls", err, calls)
    return False
