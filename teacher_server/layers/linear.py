"""Linear projections with their tensor-parallel split named.

- Column-parallel (``MergedColumnLinear``: fused QKV, fused gate/up): each rank holds a slice
  of every fused part's output rows; no communication in the forward.
- Row-parallel (``RowLinear``: o, down): each rank holds a slice of the input columns and
  computes a partial sum; the partial sums are all-reduced (with tp > 1, at the marked point).

Weights are [out, in] like ``nn.Linear``. ``load_weight`` copies a Hugging Face tensor (the
whole, unsplit weight of one part) into this rank's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.parallel import SINGLE, TensorParallel


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _frozen(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class MergedColumnLinear(nn.Module):
    """y = x W^T (+ b) for several projections of the same input fused into one GEMM:
    ``parts`` maps each part's name to its full output size (e.g. q, k, v or gate, up).
    Column-parallel: this rank holds rows [rank * n / tp, (rank + 1) * n / tp) of each part,
    laid out part after part."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.parts: dict[str, tuple[int, int]] = {}  # part -> (first row here, rows here)
        off = 0
        for name, n in parts.items():
            local = tp.split(n, f"{name} rows")
            self.parts[name] = (off, local)
            off += local
        self.weight = _frozen(off, in_features, dtype=dtype, device=device)
        self.bias = _frozen(off, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, sum of local parts]

    def shards(self, param: str) -> int:
        """How many HF tensors fill ``param`` (one per part)."""
        return len(self.parts)

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        """Copy this rank's rows of part ``part`` of the full HF tensor ``loaded``."""
        assert part in self.parts, f"{name}: part {part!r} is not one of {list(self.parts)}"
        off, n = self.parts[part]
        rows = loaded.narrow(0, self.tp.rank * n, n) if loaded.shape[0] == n * self.tp.size else loaded
        copy_checked(getattr(self, param).data[off:off + n], rows, name)


class RowLinear(nn.Module):
    """y = x W^T. Row-parallel: this rank holds input columns [rank * n / tp, ...) and makes a
    partial sum; the all-reduce of the partial sums goes where marked (tp > 1)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _frozen(out_features, tp.split(in_features, "input columns"), dtype=dtype, device=device)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, self.weight)  # tensor parallel: all-reduce here

    def add_into(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x += a W^T in place, the sum made in the GEMM's epilogue and rounded once (x must
        be this step's own activation); it saves a full pass over x. Returns x. (With tp > 1
        only one rank may add x before the all-reduce.)"""
        return x.addmm_(a, self.weight.t())  # tensor parallel: all-reduce of the partial sums here

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        n = self.weight.shape[1]
        cols = loaded.narrow(1, self.tp.rank * n, n) if loaded.dim() == 2 and loaded.shape[1] == n * self.tp.size \
            else loaded
        copy_checked(self.weight.data, cols, name)
