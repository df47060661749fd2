"""Linear projections with their tensor-parallel split.

- Column-parallel (``MergedColumnLinear``: fused QKV, fused gate/up): each rank holds a slice
  of every fused part's output rows; no communication in the forward.
- Row-parallel (``RowLinear``: o, down): each rank holds a slice of the input columns and
  computes a partial sum; the partial sums are all-reduced over the ranks.

Weights are [out, in] like ``nn.Linear``. Sharded loading: ``checkpoint_slice`` says which
slice of a Hugging Face tensor this rank needs (the loader reads only that, ``get_slice``);
``load_weight`` copies it in (given the whole tensor, it cuts the slice itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.parallel import SINGLE, TensorParallel

Slice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def take(loaded: torch.Tensor, sl: Slice | None) -> torch.Tensor:
    """``loaded`` cut to the slice ``sl`` unless it already is that slice (the loader read it
    sharded) or the layer is not split."""
    if sl is None or loaded.dim() <= sl[0]:
        return loaded
    dim, start, n = sl
    return loaded if loaded.shape[dim] == n else loaded.narrow(dim, start, n)


def _frozen(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class MergedColumnLinear(nn.Module):
    """y = x W^T (+ b) for several projections of the same input fused into one GEMM:
    ``parts`` maps each part's name to its full output size (e.g. q, k, v or gate, up).
    Column-parallel: this rank holds its slice of each part (``TensorParallel.rows``, in units
    of ``units[part]`` rows, default 1: a head for q/k/v, so KV heads replicate past their
    count), laid out part after part."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, units: dict[str, int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.parts: dict[str, tuple[int, int]] = {}  # part -> (first row here, rows here)
        self.sources: dict[str, tuple[int, int]] = {}  # part -> (first row in the HF tensor, rows)
        off = 0
        for name, n in parts.items():
            start, local = tp.rows(n, f"{name} rows", (units or {}).get(name, 1))
            self.parts[name] = (off, local)
            self.sources[name] = (start, local)
            off += local
        self.weight = _frozen(off, in_features, dtype=dtype, device=device)
        self.bias = _frozen(off, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, sum of local parts]

    def shards(self, param: str) -> int:
        """How many HF tensors fill ``param`` (one per part)."""
        return len(self.parts)

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        """The rows of part ``part`` of the HF tensor this rank holds (None: all of it)."""
        start, n = self.sources[part]
        return (0, start, n) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        """Copy this rank's rows of part ``part`` (the whole HF tensor, or just those rows)."""
        assert part in self.parts, f"{name}: part {part!r} is not one of {list(self.parts)}"
        off, n = self.parts[part]
        copy_checked(getattr(self, param).data[off:off + n], take(loaded, self.checkpoint_slice(param, part)), name)


class RowLinear(nn.Module):
    """y = x W^T. Row-parallel: this rank holds input columns [rank * n / tp, ...) and makes a
    partial sum; the partial sums are all-reduced (tp > 1)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.cols = tp.rows(in_features, "input columns")
        self.weight = _frozen(out_features, self.cols[1], dtype=dtype, device=device)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        spans = self.tp.spans(a.shape[0])
        if len(spans) > 1:  # in parts, each part's all-reduce under the next's GEMM
            out = a.new_empty(a.shape[0], self.weight.shape[0])
            w = self.weight.t()
            return self.tp.all_reduce_parts(out, lambda lo, hi: torch.mm(a[lo:hi], w, out=out[lo:hi]), spans)
        return self.tp.all_reduce(F.linear(a, self.weight))  # [T, out], summed over ranks

    def add_into(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x += a W^T in place, the sum made in the GEMM's epilogue and rounded once (x must
        be this step's own activation, the same on every rank); it saves a full pass over x.
        Returns x. With tp > 1 only rank 0 adds x to its partial sum; the others overwrite x
        with theirs, and the all-reduce makes x + the full product on every rank (in parts
        where ``tp.comm_parts`` asks for them)."""
        spans = self.tp.spans(x.shape[0])
        if len(spans) > 1:
            w = self.weight.t()

            def make(lo: int, hi: int) -> None:
                if self.tp.rank == 0:
                    x[lo:hi].addmm_(a[lo:hi], w)
                else:
                    torch.mm(a[lo:hi], w, out=x[lo:hi])

            return self.tp.all_reduce_parts(x, make, spans)
        if self.tp.rank == 0:
            x.addmm_(a, self.weight.t())
        else:
            torch.mm(a, self.weight.t(), out=x)
        return self.tp.all_reduce(x)

    def shards(self, param: str) -> int:
        return 1

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return (1, *self.cols) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.weight.data, take(loaded, self.checkpoint_slice(param, part)), name)
