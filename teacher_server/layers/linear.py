"""Linear projections with their tensor-parallel split.

- Column-parallel (``MergedColumnLinear``: fused QKV, fused gate/up): each rank holds a slice
  of every fused part's output rows; no communication in the forward.
- Row-parallel (``RowLinear``: o, down): each rank holds a slice of the input columns and
  computes a partial sum; the partial sums are all-reduced over the ranks.

Weights are [out, in] like ``nn.Linear``, held and applied through the layer's weight format
(``fmt``: ``layers.formats``; unquantized: ``layer.weight`` in the model dtype). Sharded
loading: ``checkpoint_slice`` says which slice of a Hugging Face tensor this rank needs (the
loader reads only that, ``get_slice``); ``load_weight`` copies it in (given the whole tensor,
it cuts the slice itself). ``param`` is the layer's tensor the checkpoint tensor fills:
``weight``, ``bias`` or one of the format's extras (``weight_scale_inv``), each sliced in its
own coordinates (``WeightFormat.span``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

Slice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor
_HELD_PLAIN: set[tuple[str, tuple[str, ...]]] = set()  # (format, parts) already reported


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


class MergedColumnLinear(nn.Module):
    """y = x W^T (+ b) for several projections of the same input fused into one GEMM:
    ``parts`` maps each part's name to its full output size (e.g. q, k, v or gate, up).
    Column-parallel: this rank holds its slice of each part (``TensorParallel.rows``, in units
    of ``units[part]`` rows, default 1: a head for q/k/v, so KV heads replicate past their
    count), laid out part after part. The bias stays in the model dtype whatever the format."""

    role = "linear"
    slots = ("weight",)  # the weights its format holds (``WeightFormat.create``)

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, units: dict[str, int] | None = None,
                 fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.tp = tp
        fmt = fmt.for_layer(self.role)
        self.parts: dict[str, tuple[int, int]] = {}  # part -> (first row here, rows here)
        self.sources: dict[str, tuple[int, int]] = {}  # part -> (first row in the HF tensor, rows)
        off = 0
        for name, n in parts.items():
            start, local = tp.rows(n, f"{name} rows", (units or {}).get(name, 1))
            self.parts[name] = (off, local)
            self.sources[name] = (start, local)
            off += local
        # A part whose rows here, or whose place in the fused weight, cut the format's blocks
        # (Qwen3.5's 48-row b and a beside 128-row blocks): the fused weight is held in the model
        # dtype instead, its quantized parts dequantized as they are read (slower, exact).
        cut = [name for name, n in parts.items()
               if not (fmt.fits(0, *self.sources[name], n) and fmt.fits(0, *self.parts[name], off))]
        if cut:
            if (fmt.name, tuple(cut)) not in _HELD_PLAIN:
                _HELD_PLAIN.add((fmt.name, tuple(cut)))
                log.warning("a fused projection with parts %s is held in the model dtype: their rows cut the %s "
                            "weight format's blocks of %s rows", ", ".join(cut), fmt.name, fmt.shard_unit[0])
            fmt = UNQUANTIZED
        self.fmt = fmt
        self.fmt.create(self, "weight", (off, in_features), dtype, device)
        self.bias = nn.Parameter(torch.empty(off, dtype=dtype, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.apply(self, x)  # [T, sum of local parts]

    def shards(self, param: str) -> int:
        """How many HF tensors fill ``param`` (one per part)."""
        return len(self.parts)

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        """The rows of part ``part`` of the HF tensor this rank holds (None: all of it)."""
        start, n = self.sources[part]
        return (0, *self.fmt.span(param, 0, start, n)) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        """Copy this rank's rows of part ``part`` (the whole HF tensor, or just those rows)."""
        assert part in self.parts, f"{name}: part {part!r} is not one of {list(self.parts)}"
        off, n = self.fmt.span(param, 0, *self.parts[part])
        copy_checked(getattr(self, param).data[off:off + n], take(loaded, self.checkpoint_slice(param, part)), name)


class RowLinear(nn.Module):
    """y = x W^T. Row-parallel: this rank holds input columns [rank * n / tp, ...) and makes a
    partial sum; the partial sums are all-reduced (tp > 1)."""

    role = "linear"
    slots = ("weight",)
    split_columns = ("weight",)  # the slots whose input columns ranks split
    bias = None

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.tp = tp
        self.fmt = fmt.for_layer(self.role)
        self.out_features = out_features
        self.cols = tp.rows(in_features, "input columns")
        self.fmt.check_shard("input columns", 1, *self.cols, in_features)
        self.fmt.create(self, "weight", (out_features, self.cols[1]), dtype, device)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        spans = self.tp.spans(a.shape[0])
        if len(spans) > 1:  # in parts, each part's all-reduce under the next's GEMM
            out = a.new_empty(a.shape[0], self.out_features)
            return self.tp.all_reduce_parts(out, lambda lo, hi: self.fmt.apply(self, a[lo:hi], out[lo:hi]), spans)
        return self.tp.all_reduce(self.fmt.apply(self, a))  # [T, out], summed over ranks

    def add_partial(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x += a W^T (this rank's columns, nothing reduced) in place: in the GEMM's epilogue,
        rounded once, where the format allows, else added after. Returns x."""
        if self.fmt.add_into(self, x, a) is None:
            x.add_(self.fmt.apply(self, a))
        return x

    def add_into(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x += a W^T in place, the sum made in the GEMM's epilogue and rounded once (x must
        be this step's own activation, the same on every rank); it saves a full pass over x.
        Returns x. With tp > 1 only rank 0 adds x to its partial sum; the others overwrite x
        with theirs, and the all-reduce makes x + the full product on every rank (in parts
        where ``tp.comm_parts`` asks for them)."""
        spans = self.tp.spans(x.shape[0])
        if len(spans) > 1:
            def make(lo: int, hi: int) -> None:
                if self.tp.rank == 0:
                    self.add_partial(x[lo:hi], a[lo:hi])
                else:
                    self.fmt.apply(self, a[lo:hi], x[lo:hi])

            return self.tp.all_reduce_parts(x, make, spans)
        if self.tp.rank != 0:
            self.fmt.apply(self, a, x)
        elif self.fmt.add_into(self, x, a) is None:  # (``add_partial``, inlined on the per-layer path)
            x.add_(self.fmt.apply(self, a))
        return self.tp.all_reduce(x)

    def shards(self, param: str) -> int:
        return 1

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return (1, *self.fmt.span(param, 1, *self.cols)) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(getattr(self, param).data, take(loaded, self.checkpoint_slice(param, part)), name)
