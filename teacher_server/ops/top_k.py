"""top_k: each row's k largest float32 logits over the vocabulary and their ids, sorted
largest first (``torch.topk``'s answer; ties in any order, as there).

``torch.topk`` over a [rows, 151,936] float32 chunk costs ~1.6 us a row on the H200 (its
radix select reads the row several times), eight times the candidate path's whole gather.
Here, on CUDA, with Triton:

1. a bound: the columns are dealt into ``GROUPS`` strided groups (column c in group
   c mod GROUPS) and each group's max taken (one torch reduction); the k-th largest of those
   maxima, ``thr``, is at most the row's k-th largest value (the k largest maxima are k
   distinct elements >= thr), and few elements reach it (~k + k^2 / 2 GROUPS for spread rows);
2. one Triton pass per row collects the elements >= thr (compared as order-keyed integers,
   so NaN ranks above +inf as in torch) into ``cap`` slots; a row with more (ties, or many
   -inf: any row) narrows the bound by bisection over the keys, a pass each, and collects the
   elements above it, then ties of it, up to ``cap``: exact for every row, slow only for those;
3. ``torch.topk`` over the [rows, cap] slots.

Elsewhere (CPU, k above ``MAX_K``, a short vocabulary, no Triton) it is ``torch.topk``.
Each (vocabulary width, slots) is checked against ``torch.topk`` before its first use
(``check_top_k``, which also compiles it; the engine does it at start-up through ``prepare``);
one that fails, or does not compile, stays on ``torch.topk`` with a log line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

GROUPS = 1024  # strided column groups whose maxima bound the k-th value
MAX_K = 256  # above this the groups' collisions make the bound loose: torch.topk
BLOCK = 2048  # columns a program reads per iteration
_K: dict[str, Any] = {}
_CHECKED: dict[tuple[int, int, str], bool] = {}  # (vocab width, slots, device) -> the kernel passed


def cap_for(k: int) -> int:
    """The slots a row collects into: a power of two >= 2k (at least 128)."""
    return max(128, 1 << (2 * k - 1).bit_length())


def _kernels() -> Any:
    """The Triton kernels' module (imports Triton on first use)."""
    if "m" not in _K:
        from teacher_server.ops import top_k_kernels

        _K["m"] = top_k_kernels
    return _K["m"]


def usable(x: torch.Tensor, k: int) -> bool:
    """The Triton path takes ``x`` [rows, V] (float32 CUDA, unit column stride) and ``k``."""
    return (x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
            and 0 < k <= MAX_K and x.shape[1] >= 8 * GROUPS and x.shape[0] > 0)


def bound(x: torch.Tensor, k: int) -> torch.Tensor:
    """[rows] float32: the k-th largest of the strided groups' maxima (step 1)."""
    n = x.shape[1] // GROUPS
    maxima = x[:, :n * GROUPS].view(x.shape[0], n, GROUPS).amax(dim=1)  # [rows, GROUPS]
    return maxima.topk(k, dim=-1).values[:, k - 1].contiguous()


def top_k_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path (``usable(x, k)``): ([rows, k] float32, [rows, k] int64)."""
    rows, v = x.shape
    cap = cap_for(k)
    thr = bound(x, k)
    vals = torch.empty(rows, cap, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, cap, dtype=torch.int32, device=x.device)
    _kernels().collect_above[(rows,)](x, x.stride(0), thr, vals, ids, V=v, CAP=cap, BLOCK=BLOCK, num_warps=8)
    best, at = vals.topk(k, dim=-1)
    return best, ids.gather(1, at).long()


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows, k] values, [rows, k] int64 ids) of ``x`` [rows, V], largest first."""
    if usable(x, k) and _checked(x.shape[1], k, x.device):
        return top_k_triton(x, k)
    return x.topk(k, dim=-1)


def _checked(vocab: int, k: int, device: torch.device) -> bool:
    key = (vocab, cap_for(k), str(device))
    if key not in _CHECKED:
        try:
            check_top_k(vocab, k, device)
            _CHECKED[key] = True
        except Exception as e:  # torch.topk is right, only slower
            log.warning("top-k kernel disabled at vocabulary %d, k %d: %s: %s", vocab, k, type(e).__name__, e)
            _CHECKED[key] = False
    return _CHECKED[key]


def prepare(vocab: int, device: torch.device) -> None:
    """Check and compile the kernel for every slot count at vocabulary width ``vocab`` (no
    compile inside a request later); nothing off CUDA."""
    if device.type == "cuda":
        k = 1
        while k <= MAX_K:
            _checked(vocab, k, device)
            k = cap_for(k) // 2 + 1  # the first k of the next slot count


def check_top_k(vocab: int, k: int, device: torch.device) -> None:
    """Start-up check: the Triton path equals ``torch.topk`` on random rows, rows of ties and
    rows with few finite values (the bisection). Raises RuntimeError otherwise."""
    x = torch.randn(6, vocab, device=device) * 4
    if not usable(x, k):
        return
    x[1] = 1.5  # every element tied
    x[2, :] = float("-inf")  # fewer than k finite values (next line)
    x[2, 5::vocab // max(1, k // 2)] = torch.randn(len(range(5, vocab, vocab // max(1, k // 2))), device=device)
    x[3, : 4 * cap_for(k)] = 100.0  # a run of ties above the rest
    got_v, got_i = top_k_triton(x, k)
    ref_v = x.topk(k, dim=-1).values
    distinct = (got_i.sort(dim=-1).values.diff(dim=-1) != 0).all()
    if not torch.equal(got_v, ref_v) or not torch.equal(x.gather(1, got_i), got_v) or not distinct:
        raise RuntimeError(f"top_k (Triton) differs from torch.topk at vocabulary {vocab}, k {k}")
