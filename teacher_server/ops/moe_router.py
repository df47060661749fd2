"""DeepSeek-V3's router in one Triton kernel (``layers.deepseek_moe.deepseek_route`` with
sigmoid scoring): the float32 logits of the bf16 rows against the float32 router weights, the
sigmoid scores, the score-correction bias added for picking, the group-limited pick (each
group scored by its two best biased scores, the ``topk_group`` best groups kept), the top-k
experts, their unbiased scores renormalised and scaled. One pass over h per layer instead of a
float32 copy of it, a float32 GEMM and a chain of small kernels (the router was ~3.5% of
Moonlight-16B-A3B's step on the H100).

Numerics: the logits are float32 products of the bf16 inputs widened exactly, summed in
float32 (another order than cuBLAS's: a few float32 ulps), with no TF32 rounding; an exact tie
between experts picks the lower id. The start-up check (``check``) compares the picks with the
torch path's at the layer's own router weights, a different pick allowed only where the two
candidates' biased scores are within float32 noise of each other; the kernel is then kept only
where it is faster (``faster``: at DeepSeek-V3's width the float32 products dominate, and its
FMA loop may not keep up with cuBLAS's float32 GEMM).
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

from typing import Any

import torch

from teacher_server.ops.checks import assert_same_picks
from teacher_server.ops.checks import faster as timed_faster
from teacher_server.ops.gate_up_silu import sm_count
from teacher_server.ops.triton_kernels import lazy

BK = 32  # hidden columns per step


def tokens_per_program(e: int) -> int:
    """Rows a program takes: the router weights are read once per program, and its [rows,
    experts] float32 tiles (logits, scores, picks) live in registers. 64 rows up to 128 experts,
    32 up to 256 (DeepSeek-V3), 16 past (Kimi-K2's 384): compiled for sm_90 with 8 warps, 64
    rows at 256 experts and 32 at 384 spill registers to the stack (tests/test_triton_sm90.py)."""
    return 64 if e <= 128 else 32 if e <= 256 else 16


_K: dict[str, Any] = {}


def _define(triton, tl) -> dict[str, Any]:
    """The router kernel (``triton_kernels.lazy``)."""
    @triton.jit(do_not_specialize=["T"])
    def route(h_ptr, sh, w_ptr, b_ptr, ow_ptr, oi_ptr, T, H, scale, E: tl.constexpr, EP: tl.constexpr,
              TOP: tl.constexpr, TP: tl.constexpr, GROUPS: tl.constexpr, KEEP: tl.constexpr,
              BIAS: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
        toks = tl.program_id(0) * BT + tl.arange(0, BT)
        tmask = toks < T
        ex = tl.arange(0, EP)
        emask = ex < E
        ks = tl.arange(0, BK)
        acc = tl.zeros((BT, EP), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kmask = (k0 + ks) < H
            a = tl.load(h_ptr + toks[:, None].to(tl.int64) * sh + (k0 + ks)[None, :],
                        mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            b = tl.load(w_ptr + ex[None, :].to(tl.int64) * H + (k0 + ks)[:, None],
                        mask=kmask[:, None] & emask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        scores = 1.0 / (1.0 + tl.exp(-acc))
        choice = scores
        if BIAS:
            choice = scores + tl.load(b_ptr + ex, mask=emask, other=0.0)[None, :]
        neg = float("-inf")
        choice = tl.where(emask[None, :], choice, neg)
        if GROUPS > 1:  # (E a power of two of at least 16: EP == E, GROUPS groups of E / GROUPS)
            g = tl.reshape(choice, (BT, GROUPS, E // GROUPS))
            m1 = tl.max(g, axis=2)
            ties = tl.sum((g == m1[:, :, None]).to(tl.int32), axis=2)
            m2 = tl.max(tl.where(g == m1[:, :, None], neg, g), axis=2)
            gs = m1 + tl.where(ties > 1, m1, m2)  # the sum of the group's two best
            gidx = tl.arange(0, GROUPS)
            keep = tl.zeros((BT, GROUPS), dtype=tl.int1)
            for _ in tl.static_range(KEEP):
                best = tl.max(gs, axis=1)
                first = tl.min(tl.where(gs == best[:, None], gidx[None, :], GROUPS), axis=1)
                hit = gidx[None, :] == first[:, None]
                keep = keep | hit
                gs = tl.where(hit, neg, gs)
            kept = tl.reshape(tl.broadcast_to(keep[:, :, None], (BT, GROUPS, E // GROUPS)), (BT, E))
            choice = tl.where(kept, choice, neg)
        # the picks, best first, kept in registers: column j of [BT, TP] (TP: TOP to a power of two)
        col = tl.arange(0, TP)
        wt = tl.zeros((BT, TP), dtype=tl.float32)
        it = tl.zeros((BT, TP), dtype=tl.int32)
        for j in tl.static_range(TOP):
            best = tl.max(choice, axis=1)
            # the lowest id at the best; a row of NaN matches nothing: clamped into range
            pick = tl.minimum(tl.min(tl.where(choice == best[:, None], ex[None, :], EP), axis=1), E - 1)
            hit = ex[None, :] == pick[:, None]
            wt = tl.where(col[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], wt)
            it = tl.where(col[None, :] == j, pick[:, None], it)
            choice = tl.where(hit, neg, choice)
        if NORM:  # renormalised as the torch path: w / (sum + 1e-20), then scaled
            wt = wt / (tl.sum(wt, axis=1)[:, None] + 1e-20)
        out = toks[:, None].to(tl.int64) * TOP + col[None, :]
        omask = tmask[:, None] & (col[None, :] < TOP)
        tl.store(ow_ptr + out, wt * scale, mask=omask)
        tl.store(oi_ptr + out, it.to(tl.int64), mask=omask)

    return {"route": route}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "router kernel", _define)


def takes(h: torch.Tensor, weight: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> bool:
    """bf16/fp16 rows [T, H] (unit column stride) and float32 router weights [E, H] on one
    device; groups only where E is a power of two they divide; top-k within the kept groups."""
    e = weight.shape[0]
    grouped = n_group > 1 and topk_group < n_group
    return (h.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32 and h.dim() == 2
            and weight.dim() == 2 and weight.shape[1] == h.shape[1] and h.stride(1) == 1 and weight.is_contiguous()
            and h.device == weight.device and 0 < top_k <= e
            and (not grouped or (e >= 16 and e & (e - 1) == 0 and e % n_group == 0
                                 and topk_group * (e // n_group) >= top_k))
            and "route" in _kernels())


def enough_tokens(t: int, e: int, device: torch.device) -> bool:
    """Whether t rows fill the GPU: a program per ``tokens_per_program`` rows and nothing split
    further, so a step of fewer rows than 64 times the SMs leaves them short of work (at
    DeepSeek-V3's width one program's products take ~0.5 ms, and each program reads the whole
    float32 router): the torch path takes those. (64: the floor the warm-up's timing at 16,384
    rows speaks for, also where fewer rows a program keep the registers from spilling.)"""
    return device.type != "cuda" or t >= 64 * sm_count(device)


def sigmoid_route(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                  topk_group: int, norm_topk: bool, scale: float,
                  any_size: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, expert ids [T, k] int64) as ``deepseek_route`` with sigmoid
    scoring gives them for router logits h weight^T; None where the kernel does not apply or
    the rows do not fill the GPU (``enough_tokens``; ``any_size``: any row count, the checks)."""
    if not takes(h, weight, n_group, topk_group, top_k):
        return None
    t, e = h.shape[0], weight.shape[0]
    if not any_size and not enough_tokens(t, e, h.device):
        return None
    ow = torch.empty(t, top_k, dtype=torch.float32, device=h.device)
    oi = torch.empty(t, top_k, dtype=torch.int64, device=h.device)
    if t == 0:
        return ow, oi
    grouped = n_group > 1 and topk_group < n_group
    bt, ep = tokens_per_program(e), max(16, 1 << (e - 1).bit_length())
    _K["route"][(-(-t // bt),)](h, h.stride(0), weight, weight if bias is None else bias.contiguous(), ow, oi, t,
                                h.shape[1], float(scale), E=e, EP=ep, TOP=top_k, TP=1 << (top_k - 1).bit_length(),
                                GROUPS=n_group if grouped else 1, KEEP=topk_group, BIAS=bias is not None,
                                NORM=norm_topk, BT=bt, BK=BK, num_warps=8, num_stages=2 if ep > 256 else 3)
    return ow, oi


def check(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
          topk_group: int, norm_topk: bool, scale: float, reference) -> bool:
    """Start-up check on rows h: the kernel's picks and weights against ``reference(logits)``
    (the torch path on float32 logits). A row may pick differently only where the two picks'
    biased scores, sorted, pair up within 1e-5 (ties within float32 noise), or its groups tie
    within 1e-5 at the cut (``group_cut_tied``); elsewhere the ids are
    the same and the weights within 1e-5 relative. False where the kernel does not apply;
    RuntimeError on a mismatch."""
    got = sigmoid_route(h, weight, bias, top_k, n_group, topk_group, norm_topk, scale, any_size=True)
    if got is None:
        return False
    logits = h.float() @ weight.t()
    choice = logits.sigmoid() + (0 if bias is None else bias)
    assert_same_picks("router kernel", got, reference(logits), choice, 1e-5, "biased scores",
                      group_cut_tied(choice, n_group, topk_group, 1e-5))
    return True


def group_cut_tied(choice: torch.Tensor, n_group: int, topk_group: int, tie: float) -> torch.Tensor | None:
    """[T] bool: the rows whose last kept group and first dropped one score within ``tie`` (a
    group scored by its two best biased scores), where float32 noise may keep either; None
    where the router keeps every group."""
    if not (n_group > 1 and topk_group < n_group):
        return None
    t, e = choice.shape
    s = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
    return s[:, topk_group - 1] - s[:, topk_group] <= tie


def faster(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
           topk_group: int, norm_topk: bool, scale: float, reference, margin: float = 0.03) -> bool:
    """Whether the kernel routes rows h at least ``margin`` faster than the torch path (the float32
    logits' GEMM, then ``reference``): at DeepSeek-V3's width the float32 products dominate, and
    the kernel's FMA loop may lose to cuBLAS's where it wins on the copy and the small passes.
    Logs the times."""
    args = (h, weight, bias, top_k, n_group, topk_group, norm_topk, scale)
    return timed_faster("router kernel", lambda: sigmoid_route(*args, any_size=True),
                        lambda: reference(torch.nn.functional.linear(h.float(), weight)), "the torch path",
                        f"{weight.shape[0]} experts, hidden {weight.shape[1]}, {h.shape[0]} tokens", margin)
