"""grouped_mm: one GEMM over row groups, each with its own weight, for the expert layer.

``a`` [M, K] holds rows sorted by group (expert); ``b`` [G, K, N] holds one weight per
group; ``offs`` [G] int32 holds the cumulative row ends (group g owns rows
[offs[g-1], offs[g]), empty groups allowed). The result is [M, N]. Rows past offs[-1] belong
to no group (an expert-parallel rank's rows of other ranks' experts): their results are
undefined and never read.

- ``grouped_mm``: torch's grouped GEMM (``F.grouped_mm`` / ``torch._grouped_mm``: CUTLASS on
  Hopper for bf16; a loop in C++ elsewhere). Its constraints: ``offs`` int32 on a's device,
  16-byte aligned data pointers, one unit stride per matrix and the other a multiple of 16
  bytes (so K and N multiples of 8 in bf16). ``b`` may be a transposed view of a [G, N, K]
  weight, which is how the expert weights are stored.
- ``padded_grouped_mm``: the fallback: rows scattered into a zero-padded [G, capacity, K]
  block and one batched GEMM. No Python loop over groups, but the capacity (the largest
  group) is read back to the host: one sync per call, acceptable only as the fallback.
- ``grouped_mm_reference``: a loop over groups, the definition (tests and the start-up
  check only).

``GroupedGemm`` picks one per (device, dtype, k, n) on first use with a check against the
reference and logs one line when it falls back.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from teacher_server.ops.checks import assert_close

log = logging.getLogger(__name__)

_TORCH_GROUPED = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[M, K] x [G, K, N] by groups -> [M, N] (a Python loop over groups: the reference)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    ends = offs.tolist()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[M, K] x [G, K, N] by groups -> [M, N] through torch's grouped GEMM."""
    assert _TORCH_GROUPED is not None, "this torch has no grouped GEMM"
    return _TORCH_GROUPED(a, b, offs=offs)


def padded_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[M, K] x [G, K, N] by groups -> [M, N] as one bmm over a zero-padded [G, cap, K] block."""
    m, g = a.shape[0], b.shape[0]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(m, device=a.device)
    group = torch.searchsorted(ends, rows, right=True).clamp_max_(max(g - 1, 0))  # [M] the group of each row
    cap = int((ends - starts).max()) if g else 0  # host sync: the fallback only
    # [M] position inside its group; a row past offs[-1] goes to the spare row ``cap`` (unread)
    pos = torch.where(rows < ends[-1], rows - starts[group], cap) if g else rows.new_zeros(m)
    padded = a.new_zeros(g, cap + 1, a.shape[1])
    padded[group, pos] = a
    return torch.bmm(padded, b)[group, pos]  # [M, N]


class GroupedGemm:
    """The grouped GEMM the expert layers of one model call (``self(a, b, offs)``): torch's
    where it passed its check at (device, dtype, k, n), else the padded bmm. ``allow_torch``
    False: always the padded bmm."""

    def __init__(self, allow_torch: bool = True) -> None:
        self.allow_torch = allow_torch
        self._fast: dict[tuple[str, torch.dtype, int, int], bool] = {}

    def use_torch(self, device: torch.device, dtype: torch.dtype,
                  shapes: tuple[tuple[int, int], ...] = ((64, 48),)) -> bool:
        """Whether torch's grouped GEMM is used at (device, dtype) for every width k -> n of
        ``shapes``: each new one checked once against the reference, with empty groups (the
        warm-up checks the model's shapes; a shape first met in a forward is checked there)."""
        return all([self._check(device, dtype, k, n) for k, n in shapes])

    def _check(self, device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
        key = (device.type, dtype, k, n)
        if key not in self._fast:
            ok = self.allow_torch and _TORCH_GROUPED is not None
            if ok:
                try:
                    check_grouped_mm(grouped_mm, k, n, device, dtype)
                except Exception as e:  # unsupported device/dtype/shape: the fallback is correct
                    log.warning("torch grouped GEMM unavailable on %s %s at %d -> %d (%s: %s); those experts "
                                "use a padded bmm", device.type, str(dtype).replace("torch.", ""), k, n,
                                type(e).__name__, " ".join(str(e).split())[:200])
                    ok = False
            elif self.allow_torch:
                log.warning("this torch has no grouped GEMM; experts use a padded bmm")
            self._fast[key] = ok
        return self._fast[key]

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self._check(a.device, a.dtype, b.shape[1], b.shape[2]):
            return grouped_mm(a, b, offs)
        return padded_grouped_mm(a, b, offs)


def check_grouped_mm(fn: object, k: int, n: int, device: torch.device, dtype: torch.dtype) -> None:
    """Start-up check: ``fn`` against the reference at width k -> n with uneven and empty
    groups and 3 rows past the last (their results not compared), b a transposed view as the
    experts pass it. Raises RuntimeError on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 19, 1, 0, 7]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    rows = sum(counts)
    a = torch.randn(rows + 3, k, generator=gen).to(device, dtype)
    w = torch.randn(len(counts), n, k, generator=gen).to(device, dtype)  # stored [G, N, K]
    b = w.transpose(1, 2)
    assert_close("grouped_mm", fn(a, b, offs)[:rows], grouped_mm_reference(a, b, offs)[:rows])  # type: ignore[operator]
