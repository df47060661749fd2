"""moe_group: an expert layer's slots (token t's j-th routed expert, slot s = t k + j) grouped
by expert, in the order a stable sort by expert id gives them, by counting instead of sorting.

``torch.sort`` of the [T k] int64 expert ids is a radix sort over all 64 key bits (several
passes over the keys), then the row ends by ``searchsorted``, the inverse permutation by a
scatter, the tokens by a division: about 0.9% of Moonlight-16B-A3B's step on the H100 for the
sort alone. With E experts the ids are small integers, so a counting placement gives the same
order:

1. ``count``: per block of BLOCK slots, how many go to each expert ([E, blocks] int32: each
   expert's counts contiguous, so the sum over blocks below is torch's scan along the last
   dimension, a parallel one; along the first it would walk the blocks one after another);
2. two cumulative sums: each expert's first row, and each block's first row within it;
3. ``place``: slot s of block b with expert e goes to row first[e] + before[b, e] + the slots
   of b ahead of s with the same expert, which is where the stable sort puts it.

The result is the torch path's exactly (a test checks it bit for bit); the warm-up keeps the
kernels only where they are faster at the layer's expert count and top-k (``pick``).
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from teacher_server.ops.checks import faster
from teacher_server.ops.triton_kernels import lazy

BLOCK = 64  # slots a program takes: its [BLOCK, BLOCK] comparison ranks them within the block
_K: dict[str, Any] = {}
_ENDS: dict[tuple[int, str], torch.Tensor] = {}


class Grouped(NamedTuple):
    """Slots grouped by bucket (expert), as ``torch.sort(flat, stable=True)`` orders them."""

    keys: torch.Tensor  # [M] int64: the bucket of each row (sorted)
    tokens: torch.Tensor  # [M] int64: the token of each row (its slot // k)
    ends: torch.Tensor  # [buckets] int32: each bucket's cumulative row end
    pos: torch.Tensor  # [M] int64: the row of each slot


def _define(triton, tl) -> dict[str, Any]:
    """The counting and placing kernels (``triton_kernels.lazy``)."""
    @triton.jit(do_not_specialize=["M", "NBLK"])
    def count(ids_ptr, counts_ptr, M, NBLK, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        s = b * BLOCK + tl.arange(0, BLOCK)
        ok = s < M
        e = tl.load(ids_ptr + s, mask=ok, other=0)
        tl.atomic_add(counts_ptr + e * NBLK + b, 1, mask=ok)

    @triton.jit(do_not_specialize=["M", "NBLK"])
    def place(ids_ptr, counts_ptr, cum_ptr, starts_ptr, keys_ptr, tok_ptr, pos_ptr, M, NBLK, K: tl.constexpr,
              BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        s = b * BLOCK + i
        ok = s < M
        e = tl.load(ids_ptr + s, mask=ok, other=-1)  # (slots past M sort after the block's own: never ahead)
        ahead = (e[None, :] == e[:, None]) & (i[None, :] < i[:, None])
        rank = tl.sum(ahead.to(tl.int32), axis=1)
        at = e * NBLK + b
        # the expert's first row + this block's first within it (the inclusive sum less its own count)
        row = (tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(cum_ptr + at, mask=ok, other=0)
               - tl.load(counts_ptr + at, mask=ok, other=0) + rank).to(tl.int64)
        tl.store(pos_ptr + s, row, mask=ok)
        tl.store(keys_ptr + row, e, mask=ok)
        tl.store(tok_ptr + row, s // K, mask=ok)

    return {"count": count, "place": place}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "expert grouping kernels", _define)


def _bucket_ends(buckets: int, device: torch.device) -> torch.Tensor:
    """1..buckets on ``device``, made once (every expert layer's every step searches against it)."""
    key = (buckets, str(device))
    if key not in _ENDS:
        _ENDS[key] = torch.arange(1, buckets + 1, device=device)
    return _ENDS[key]


def group_torch(flat: torch.Tensor, buckets: int, k: int) -> Grouped:
    """The stable sort's grouping (any device): rows of bucket 0 first, each bucket's slots in
    slot order."""
    keys, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(keys, _bucket_ends(buckets, flat.device), out_int32=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(flat.shape[0], device=flat.device)
    return Grouped(keys, order // k, ends, pos)


def group_kernels(flat: torch.Tensor, buckets: int, k: int) -> Grouped | None:
    """The same from the counting kernels; None where they do not apply (no Triton, not int64,
    no slots)."""
    m = flat.shape[0]
    if flat.dtype != torch.int64 or flat.dim() != 1 or not flat.is_contiguous() or m == 0 or "count" not in _kernels():
        return None
    nb = -(-m // BLOCK)
    counts = torch.zeros(buckets, nb, dtype=torch.int32, device=flat.device)
    _K["count"][(nb,)](flat, counts, m, nb, BLOCK=BLOCK, num_warps=2)
    cum = counts.cumsum(1, dtype=torch.int32)  # [buckets, blocks] inclusive over the blocks
    ends = cum[:, -1].cumsum(0, dtype=torch.int32)  # [buckets] each bucket's row end
    starts = ends - cum[:, -1]
    keys = torch.empty_like(flat)
    tokens = torch.empty_like(flat)
    pos = torch.empty_like(flat)
    _K["place"][(nb,)](flat, counts, cum, starts, keys, tokens, pos, m, nb, K=k, BLOCK=BLOCK, num_warps=2)
    return Grouped(keys, tokens, ends, pos)


def group(flat: torch.Tensor, buckets: int, k: int, kernel: bool) -> Grouped:
    """Slots ``flat`` [M] (int64 buckets in [0, buckets), M = T k) grouped by bucket: the
    counting kernels where ``kernel`` (the warm-up's pick) and they apply, else the sort."""
    out = group_kernels(flat, buckets, k) if kernel else None
    return out if out is not None else group_torch(flat, buckets, k)


def _routing(t: int, k: int, buckets: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """[t k] int64: each token's k distinct buckets, drawn as a router's top-k would be."""
    return torch.rand(t, buckets, generator=g).topk(k, dim=-1).indices.reshape(-1).to(device)


def check(buckets: int, k: int, device: torch.device) -> bool:
    """The kernels' grouping against the sort's, bit for bit, at a few step sizes (one slot, a
    part block, many blocks, every slot in one bucket); False where they do not apply,
    RuntimeError where they differ."""
    g = torch.Generator().manual_seed(5)
    k = min(k, buckets)
    cases = [_routing(t, k, buckets, device, g) for t in (1, 37, 3000)]
    cases.append(torch.full((300 * k,), buckets - 1, dtype=torch.int64, device=device))
    for flat in cases:
        got = group_kernels(flat, buckets, k)
        if got is None:
            return False
        want = group_torch(flat, buckets, k)
        for name, a, b in zip(Grouped._fields, got, want):
            if not torch.equal(a, b):
                raise RuntimeError(f"expert grouping kernels: {name} differs from the sort's ({flat.shape[0]} slots, "
                                   f"{buckets} experts)")
    return True


def pick(buckets: int, k: int, device: torch.device, tokens: int = 16384, margin: float = 0.03) -> bool:
    """Whether the layer groups with the kernels: right (``check``) and at least ``margin``
    faster than the sort at ``tokens`` tokens. Logs the times."""
    if not check(buckets, k, device):
        return False
    flat = _routing(tokens, min(k, buckets), buckets, device, torch.Generator().manual_seed(6))
    return faster("expert grouping kernels", lambda: group_kernels(flat, buckets, k),
                  lambda: group_torch(flat, buckets, k), "the sort", f"{buckets} experts, top-{k}, {tokens} tokens",
                  margin)
