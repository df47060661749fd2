"""The comparison every start-up check of an op makes: its fast version against its torch
reference on random inputs, within a bound relative to the reference's magnitude."""

from __future__ import annotations

import torch


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2, floor: float = 1e-3) -> None:
    """Raise RuntimeError naming ``name`` when max |got - ref| exceeds rel * max |ref| + floor."""
    err = (got.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    bound = rel * (ref.float().abs().max().item() if ref.numel() else 0.0) + floor
    if not err <= bound:  # also catches NaN
        raise RuntimeError(f"{name} differs from its torch reference by {err:.3g} (bound {bound:.3g})")
