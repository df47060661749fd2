"""The softmax routers' selection in one Triton pass (Qwen2/Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next, Mixtral: ``layers.moe.SparseMoe.route``): from the float32 router logits [T, E]
(cuBLAS's product, unchanged), the softmax over the experts, the top-k and the weights
renormalised where the model says so. The torch path runs that as a softmax pass, ``topk``
(a radix select of several kernels: ~0.9% of Moonlight-16B-A3B's step for its top-6 of 64 on
the H100, more at Qwen3-Next's top-10 of 512) and two small passes for the renormalisation.

Numerics: the softmax as torch's (the row's maximum subtracted, exp, the sum, one division)
with another summation order, so a probability may differ from torch's by a float32 ulp; an
exact tie picks the lower expert id. A row of NaN logits (a NaN input row) picks expert E - 1
k times, with NaN weights: torch picks k distinct ids for it, and the scores are NaN either
way. The start-up check (``check``) compares the picks with the torch path's at the layer's
own router weights, a different pick allowed only where the two picks' probabilities are
within float32 noise; the warm-up keeps the kernel only where it is also faster (``pick``).
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from teacher_server.ops.checks import assert_same_picks, faster
from teacher_server.ops.triton_kernels import lazy

_K: dict[str, Any] = {}


def rows_per_program(e: int) -> int:
    """64 rows a program up to 128 experts, 32 up to 256, 16 past: its [rows, experts] float32
    tiles live in the registers of 8 warps (with 4, 256 and 512 experts spilled on sm_90;
    ``tests/test_triton_sm90.py`` compiles each)."""
    return 64 if e <= 128 else 32 if e <= 256 else 16


def _define(triton, tl) -> dict[str, Any]:
    """The selection kernel (``triton_kernels.lazy``)."""
    @triton.jit(do_not_specialize=["T"])
    def select(x_ptr, sx, ow_ptr, oi_ptr, T, E: tl.constexpr, EP: tl.constexpr, TOP: tl.constexpr,
               TP: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = rows < T
        ex = tl.arange(0, EP)
        emask = ex < E
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ex[None, :], mask=rmask[:, None] & emask[None, :],
                    other=float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])  # (the padding columns: exp(-inf) = 0)
        probs = p / tl.sum(p, axis=1)[:, None]
        choice = tl.where(emask[None, :], probs, -1.0)  # a padding column is never picked
        col = tl.arange(0, TP)
        wt = tl.zeros((BT, TP), dtype=tl.float32)
        it = tl.zeros((BT, TP), dtype=tl.int32)
        for j in tl.static_range(TOP):
            best = tl.max(choice, axis=1)
            # the lowest id at the best; a row of NaN matches nothing: clamped into range
            pick = tl.minimum(tl.min(tl.where(choice == best[:, None], ex[None, :], EP), axis=1), E - 1)
            wt = tl.where(col[None, :] == j, best[:, None], wt)
            it = tl.where(col[None, :] == j, pick[:, None], it)
            choice = tl.where(ex[None, :] == pick[:, None], -2.0, choice)
        if NORM:  # as the torch path: w / w.sum()
            wt = wt / tl.sum(tl.where(col[None, :] < TOP, wt, 0.0), axis=1)[:, None]
        out = rows[:, None].to(tl.int64) * TOP + col[None, :]
        omask = rmask[:, None] & (col[None, :] < TOP)
        tl.store(ow_ptr + out, wt, mask=omask)
        tl.store(oi_ptr + out, it.to(tl.int64), mask=omask)

    return {"select": select}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "softmax top-k kernel", _define)


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, expert ids [T, k] int64) of float32 router logits [T, E] (unit
    column stride) as ``softmax_topk_torch`` gives them; None where the kernel does not apply."""
    if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or not 0 < top_k <= logits.shape[1] or "select" not in _kernels()):
        return None
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        bt = rows_per_program(e)
        _K["select"][(-(-t // bt),)](logits, logits.stride(0), w, ids, t, E=e, EP=max(16, 1 << (e - 1).bit_length()),
                                     TOP=top_k, TP=1 << (top_k - 1).bit_length(), NORM=norm, BT=bt, num_warps=8)
    return w, ids


def softmax_topk_torch(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, top-k, renormalised when ``norm`` (as transformers'
    Qwen-MoE and Mixtral routers)."""
    w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def check(logits: torch.Tensor, top_k: int, norm: bool) -> bool:
    """The kernel's picks and weights against the torch path's on ``logits``. A row may pick
    differently only where the two picks' probabilities, sorted, pair up within 1e-6 (ties
    within float32 noise); elsewhere the ids are the same and the weights within 1e-5 relative.
    False where the kernel does not apply; RuntimeError on a mismatch."""
    got = softmax_topk(logits, top_k, norm)
    if got is None:
        return False
    probs = torch.softmax(logits, dim=-1)
    assert_same_picks("softmax top-k kernel", got, softmax_topk_torch(logits, top_k, norm), probs, 1e-6,
                      "probabilities")
    return True


def pick(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: int, top_k: int, norm: bool,
         device: torch.device, dtype: torch.dtype, margin: float = 0.03) -> bool:
    """Whether a layer routes with the kernel: right (``check``) on the logits ``logits_of`` (the
    layer's router) gives for random rows at 16, 300 and 16,384 tokens, and at least ``margin``
    faster than the torch path's selection at the last. Logs the times."""
    g = torch.Generator().manual_seed(3)
    for t in (16, 300, 16384):
        logits = logits_of(torch.randn(t, hidden, generator=g).to(device, dtype))
        if not check(logits, top_k, norm):
            return False
    return faster("softmax top-k kernel", lambda: softmax_topk(logits, top_k, norm),
                  lambda: softmax_topk_torch(logits, top_k, norm), "the torch path",
                  f"{logits.shape[1]} experts, top-{top_k}, {logits.shape[0]} tokens", margin)
