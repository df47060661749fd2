"""Latent attention's elementwise stages (``models.mla``), stages of ``FusedOps``: compiled
into a few fused passes where the stages are compiled, instead of a chain of strided copies
and float32 passes per layer (~8% of the Moonlight-16B-A3B shape's step on the H100).

- ``mla_prep``: the latent a layer keeps, RMSNorm of the fused a-projection's first
  ``rank`` latent columns | its rotated shared key, and q with its last dims rotated;
- ``mla_expand``: each head's key (k_nope | the shared rotated key) and value written from
  kv_b_proj's output into the step's buffers.

Rotary is half-split (the interleaved rows were permuted at load), float32 math, rounded once."""

from __future__ import annotations

from collections.abc import Callable

import torch

from teacher_server.ops.checks import assert_close
from teacher_server.ops.norm import rms_norm


def rotate(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, H, r] rotated half-split by cs [T, r] (cos | sin, float32); float32 math, rounded once."""
    half = cs.shape[1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def q_in(a: torch.Tensor, latent: int, heads: int) -> torch.Tensor:
    """q [T, heads, d] as the first columns of the a-projection's output ``a`` (q | the latent's
    ``latent`` columns), where they are."""
    return a[:, :a.shape[1] - latent].view(a.shape[0], heads, -1)


def mla_prep(a: torch.Tensor, q: torch.Tensor | None, cs: torch.Tensor, norm_w: torch.Tensor, eps: float,
             rank: int, rope_only: bool = False, heads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent [T, rank + r], q [T, n, d]), both new and contiguous: the latent from the last
    rank + r columns of ``a`` (rms_norm of the first ``rank`` | the rest rotated by cs [T, r]),
    and q with its last r dims rotated; ``rope_only``: those r dims alone ([T, n, r]: the layer
    writes them back into q, ``rotate_q_in_place``). q None: q is ``a``'s first columns,
    ``heads`` heads of the width the rest leaves. (Plain ints: ``FusedOps`` compiles this.)"""
    r = cs.shape[1]
    kv_a = a[:, a.shape[1] - rank - r:]
    latent = torch.cat([rms_norm(kv_a[:, :rank], norm_w, eps), rotate(kv_a[:, None, rank:], cs)[:, 0]], dim=-1)
    q = q_in(a, rank + r, heads) if q is None else q
    nope = q.shape[-1] - r
    if rope_only:
        return latent, rotate(q[..., nope:], cs)
    return latent, torch.cat([q[..., :nope], rotate(q[..., nope:], cs)], dim=-1)


def rotate_q_in_place(prep: Callable, a: torch.Tensor, q: torch.Tensor | None, cs: torch.Tensor,
                      norm_w: torch.Tensor, eps: float, rank: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, q) with q rotated where it is (q None: ``a``'s first columns): ``prep`` (the
    stage ``mla_prep``, compiled or not) makes the latent and q's rotated dims, and one strided
    copy writes those dims into q; q's other dims are neither read nor written (a compiled
    in-place update of an input's slice wrote all of q, twice)."""
    latent, rot = prep(a, q, cs, norm_w, eps, rank, True, heads)
    q = q_in(a, latent.shape[1], heads) if q is None else q
    q[..., q.shape[-1] - rot.shape[-1]:].copy_(rot)
    return latent, q


def mla_expand(kv: torch.Tensor, pe: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Write keys k [N, n, nope + r] = kv's first nope columns | pe [N, r] (every head), and the
    first kv.shape[-1] - nope columns of values v [N, n, >= that] = kv's others (kv [N, n, nope +
    v width]); v's further columns are left as they are. v None: the keys alone (the values are
    read from kv where they are)."""
    nope = k.shape[-1] - pe.shape[-1]
    k[..., :nope] = kv[..., :nope]
    k[..., nope:] = pe[:, None, :]
    if v is not None:
        v[..., :kv.shape[-1] - nope] = kv[..., nope:]


def check_mla_stages(prep: Callable, expand: Callable, width: int, heads: int, nope: int, rope: int, vd: int,
                     rank: int, norm_w: torch.Tensor, eps: float, cos_sin: torch.Tensor, device: torch.device,
                     dtype: torch.dtype, q_in_a: bool = False, views: bool = False) -> None:
    """Start-up check of compiled ``prep`` and ``expand`` against the functions above at a
    model's widths (``width``: the a-projection's output), called as a layer calls them: two
    token counts (the static, then the dynamic graph), q its own tensor or (``q_in_a``) the
    first columns of ``a``, as a layer with q and the latent in one GEMM hands it, the shared key
    a column slice of the latents, the buffers after some rows (a step after a cached prefix) or
    not, values as wide as kv_b_proj makes them and zero-padded to the key width; with
    ``views`` (a backend that takes q and v as views) also q rotated in place (the columns
    around its rotated ones untouched) and the keys alone. Raises RuntimeError on a mismatch."""
    for n, first in ((16, 0), (40, 3)):
        a = torch.randn(n, width, device=device, dtype=dtype)
        q = torch.randn(n, heads, nope + rope, device=device, dtype=dtype)
        if q_in_a:
            q = a[:, :heads * (nope + rope)].view(n, heads, nope + rope)
        cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]
        for got, ref in zip(prep(a, q, cs, norm_w, eps, rank), mla_prep(a, q, cs, norm_w, eps, rank)):
            assert_close("compiled mla_prep", got, ref)
        if views:  # in place, on copies: q where the layer has it (``a``'s columns: passed as None)
            (a1, q1), (a2, q2) = ((b, b[:, :q.numel() // n].view_as(q) if q_in_a else q.clone())
                                  for b in (a.clone(), a.clone()))
            got = rotate_q_in_place(prep, a1, None if q_in_a else q1, cs, norm_w, eps, rank, heads)
            ref = rotate_q_in_place(mla_prep, a2, None if q_in_a else q2, cs, norm_w, eps, rank, heads)
            assert_close("compiled mla_prep in place, latent", got[0], ref[0])
            assert_close("compiled mla_prep in place, q", q1, q2)
            assert_close("compiled mla_prep in place, q unrotated", q1[..., :nope], q[..., :nope], rel=0, floor=0)
            rest = q.numel() // n if q_in_a else 0
            assert_close("compiled mla_prep in place, the rest of a", a1[:, rest:], a[:, rest:], rel=0, floor=0)
        kv = torch.randn(n - first, heads, nope + vd, device=device, dtype=dtype)
        pe = torch.randn(n, rank + rope, device=device, dtype=dtype)[first:, rank:]  # strided, as the latent's
        for vw in (vd, nope + rope) + ((0,) if views else ()):
            bufs = [torch.zeros(n, heads, w, device=device, dtype=dtype) for w in (nope + rope, vw, nope + rope, vw)]
            expand(kv, pe, bufs[0][first:], bufs[1][first:] if vw else None)
            mla_expand(kv, pe, bufs[2][first:], bufs[3][first:] if vw else None)
            assert_close("compiled mla_expand keys", bufs[0], bufs[2], rel=0, floor=0)
            assert_close("compiled mla_expand values", bufs[1], bufs[3], rel=0, floor=0)
