"""The cudnn_fe backend's start-up check: the check step (``cudnn_check``) through the backend
against the float32 reference, and again with freshly built graphs where plans read back from
the plan store fail it."""

from __future__ import annotations

import logging

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.cudnn_check import CHECK_HEADS, check_with_reference
from teacher_server.attention.cudnn_fe import CudnnFrontendBackend, FeCall

log = logging.getLogger("teacher_server.attention.cudnn_fe")  # the backend's own logger


def checked(backend: CudnnFrontendBackend, device: torch.device, dtype: torch.dtype,
            heads: tuple[int, ...] = CHECK_HEADS, views: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
            ) -> bool:
    """``frontend_check``, and where it fails after graphs were read from the plan store: the
    store is left, every graph built here again, and the check run once more (a saved plan
    that runs wrong costs its start-up time, never the backend)."""
    if frontend_check(backend, device, dtype, heads, views):
        return True
    if backend.plans is None or not backend.loaded:
        return False
    log.warning("cuDNN frontend attention failed its check with plans read from %s; building them instead",
                backend.plans.dir)
    backend.plans, backend.enabled = None, True
    backend._graphs.clear()
    backend.loaded.clear()
    return frontend_check(backend, device, dtype, heads, views)


def frontend_check(backend: CudnnFrontendBackend, device: torch.device, dtype: torch.dtype,
                   heads: tuple[int, ...] = CHECK_HEADS, views: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                   ) -> bool:
    """Run the check step through the cudnn_fe backend (prefixed sequences, one sharing a
    prefix, fresh ones, a short one; ``heads``: query heads, kv heads, head dim[, value width];
    ``views``: q's and the values' strides, as the layers hand them) against the float32 sdpa
    reference: True when it agrees and took its own calls for both parts."""
    x, ctx_on, ref = check_with_reference(device, dtype, heads)
    if views is not None:  # the same numbers, q and the values (fresh and prefixed) in strided buffers
        x = AttentionInputs(as_view(x.q, views[0]), x.k, as_view(x.v, views[1]), x.kp, as_view(x.vp, views[1]))
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


def as_view(x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """x [t, h, w]'s numbers in a view of those element strides (rows ``strides[0]`` apart,
    heads ``strides[1]``), a buffer of its own around it."""
    t, h, w = x.shape
    buf = x.new_zeros(t * strides[0] + h * strides[1] + w)
    out = buf.as_strided((t, h, w), tuple(strides))
    out.copy_(x)
    return out
