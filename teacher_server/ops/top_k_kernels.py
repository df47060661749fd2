"""The Triton kernel of ``ops.top_k`` (see there): one program per row collects the elements
at or above the row's bound into ``CAP`` slots, narrowing the bound by bisection where more
reach it. Imported on first use (it imports Triton)."""

# ruff: noqa: ANN001, ANN201, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key(x):
    # float32 -> int32 whose signed order is the floats' order (-NaN < -inf < ... < +inf < +NaN)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)

@triton.jit
def _count_at_least(row, V: tl.constexpr, t, BLOCK: tl.constexpr):
    n = tl.full((), 0, tl.int32)
    for s in range(0, V, BLOCK):
        c = s + tl.arange(0, BLOCK)
        key = _key(tl.load(row + c, mask=c < V, other=float("-inf")))
        n += tl.sum(((key >= t) & (c < V)).to(tl.int32), axis=0)
    return n

@triton.jit
def _collect(row, V: tl.constexpr, vo, io, n, lo, hi, CAP: tl.constexpr, BLOCK: tl.constexpr):
    # append the elements with lo <= key < hi (as int64 bounds) at slots n.. (below CAP)
    for s in range(0, V, BLOCK):
        c = s + tl.arange(0, BLOCK)
        x = tl.load(row + c, mask=c < V, other=float("-inf"))
        key = _key(x).to(tl.int64)
        m = (key >= lo) & (key < hi) & (c < V)
        pos = n + tl.cumsum(m.to(tl.int32), axis=0) - 1
        ok = m & (pos < CAP)
        tl.store(vo + pos, x, mask=ok)
        tl.store(io + pos, c, mask=ok)
        n += tl.sum(m.to(tl.int32), axis=0)
    return n

@triton.jit
def collect_above(x_ptr, sx, thr_ptr, v_ptr, i_ptr, V: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * sx
    vo, io = v_ptr + r.to(tl.int64) * CAP, i_ptr + r.to(tl.int64) * CAP
    lo = _key(tl.load(thr_ptr + r)).to(tl.int64)
    top = tl.full((), 2147483648, tl.int64)  # above every key
    n = _collect(row, V, vo, io, tl.full((), 0, tl.int32), lo, top, CAP, BLOCK)
    if n > CAP:
        # bisection: count(key >= lo) > CAP, count(key >= hi) <= CAP, until they are adjacent
        hi = top
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if _count_at_least(row, V, mid.to(tl.int32), BLOCK) > CAP:
                lo = mid
            else:
                hi = mid
        n = _collect(row, V, vo, io, tl.full((), 0, tl.int32), hi, top, CAP, BLOCK)  # all above the ties (<= CAP)
        n = _collect(row, V, vo, io, n, lo, hi, CAP, BLOCK)  # then ties of lo, up to CAP
    s = tl.arange(0, CAP)
    tl.store(vo + s, float("-inf"), mask=s >= n)  # empty slots (n >= k: never among the top k)
    tl.store(io + s, -1, mask=s >= n)
