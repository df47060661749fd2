"""The cudnn_fe backend's check again at a model's own widths (its warm-up): what it turns
off where the check at the start-up's widths passed and the model's fails."""

from __future__ import annotations

import logging

import torch

from teacher_server.attention.base import AttentionBackend

log = logging.getLogger("teacher_server.attention.cudnn_fe")  # the backend's own logger


def at_model_widths(backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                    heads: tuple[int, int, int, int], views: tuple[tuple[int, ...], tuple[int, ...]] | None) -> int:
    """The backend's check again at the model's heads (query heads, kv heads, key width, value
    width; the start-up check's were CHECK_HEADS), and with q and v as the layers' ``views``
    where given. Failing: off for good; failing with narrower values alone, they are padded to
    the key width from then on (the model pads them as it makes them: no copy per call); failing
    with the views alone, the layers hand contiguous copies. Returns the value width the graphs
    take."""
    hq, hkv, d, dv = heads
    if not backend.check(backend, device, dtype, heads):
        backend.enabled = True  # (a refused graph turned it off: the check at equal widths decides)
        if dv != d and backend.check(backend, device, dtype, (hq, hkv, d)):
            log.warning("cuDNN frontend attention failed its check with values %d wide under keys of %d; "
                        "padding them to %d", dv, d, d)
            backend.native_v, backend.distinct_v_width, dv = False, False, d
        else:
            log.warning("cuDNN frontend attention failed its check at %d x %d heads of %d; using %s", hq, hkv, d,
                        "cudnn" if backend.split is not None else "varlen")
            backend.enabled = backend.distinct_v_width = False
    if views is not None and backend.takes_views and not backend.check(backend, device, dtype, (hq, hkv, d, dv), views):
        log.warning("cuDNN frontend attention failed its check with q and v as the layers' views; copying them")
        # (it passed without them just before: a graph refused with them turned it off, wrongly)
        backend.enabled = backend.distinct_v_width = True
        backend.views_ok = False
    return dv
