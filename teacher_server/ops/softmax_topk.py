"""The routers' selection in one Triton pass: the softmax routers' (Qwen2/Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next, Mixtral: ``layers.moe.SparseMoe.route``) from the float32 router logits [T, E]
(cuBLAS's product, unchanged), the softmax over the experts, the top-k and the weights
renormalised where the model says so; and DeepSeek's ungrouped sigmoid routing (Moonlight,
GLM-4.5, Kimi-K2: ``sigmoid_topk``), the top-k of the sigmoid scores plus the score-correction
bias, weighed by the scores alone, renormalised, scaled. The torch path runs that as a softmax pass, ``topk``
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
# DeepSeek's ungrouped sigmoid routing: (the score-correction bias or None, the scale); None: softmax
Sigmoid = tuple[torch.Tensor | None, float] | None


def rows_per_program(e: int) -> int:
    """64 rows a program up to 128 experts, 32 up to 256, 16 past (half that for the sigmoid
    routing's two tiles): its [rows, experts] float32 tiles live in the registers of 8 warps
    (with 4, 256 and 512 experts spilled on sm_90; ``tests/test_triton_sm90.py`` compiles each)."""
    return 64 if e <= 128 else 32 if e <= 256 else 16


def _define(triton, tl) -> dict[str, Any]:
    """The selection kernel (``triton_kernels.lazy``)."""
    @triton.jit(do_not_specialize=["T"])
    def select(x_ptr, sx, b_ptr, ow_ptr, oi_ptr, T, scale, eps, E: tl.constexpr, EP: tl.constexpr, TOP: tl.constexpr,
               TP: tl.constexpr, NORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = rows < T
        ex = tl.arange(0, EP)
        emask = ex < E
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ex[None, :], mask=rmask[:, None] & emask[None, :],
                    other=float("-inf"))
        if SIGMOID:  # DeepSeek's scores; the bias only picks (padding: sigmoid(-inf) = 0, never picked below)
            score = 1.0 / (1.0 + tl.exp(-x))
            choice = score
            if BIAS:
                choice = score + tl.load(b_ptr + ex, mask=emask, other=0.0)[None, :]
        else:
            p = tl.exp(x - tl.max(x, axis=1)[:, None])  # (the padding columns: exp(-inf) = 0)
            score = p / tl.sum(p, axis=1)[:, None]
            choice = score
        choice = tl.where(emask[None, :], choice, float("-inf"))  # a padding column is never picked
        col = tl.arange(0, TP)
        wt = tl.zeros((BT, TP), dtype=tl.float32)
        it = tl.zeros((BT, TP), dtype=tl.int32)
        for j in tl.static_range(TOP):
            best = tl.max(choice, axis=1)
            # the lowest id at the best; a row of NaN matches nothing: clamped into range
            pick = tl.minimum(tl.min(tl.where(choice == best[:, None], ex[None, :], EP), axis=1), E - 1)
            hit = ex[None, :] == pick[:, None]
            if SIGMOID:  # the weight is the unbiased score (a second tile: half the rows a program)
                wt = tl.where(col[None, :] == j, tl.sum(tl.where(hit, score, 0.0), axis=1)[:, None], wt)
            else:  # the probability picked by
                wt = tl.where(col[None, :] == j, best[:, None], wt)
            it = tl.where(col[None, :] == j, pick[:, None], it)
            choice = tl.where(hit, float("-inf"), choice)
        if NORM:  # as the torch paths: w / w.sum() (DeepSeek's: + 1e-20)
            wt = wt / (tl.sum(tl.where(col[None, :] < TOP, wt, 0.0), axis=1)[:, None] + eps)
        wt = wt * scale
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
    return _select(logits, None, top_k, norm, False, 1.0, 0.0)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek's ungrouped sigmoid routing (Moonlight, GLM-4.5, Kimi-K2) of float32 logits [T, E]
    as ``sigmoid_topk_torch`` gives it, the score-correction ``bias`` [E] (float32) picking only;
    None where the kernel does not apply."""
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (logits.shape[-1],)):
        return None
    return _select(logits, None if bias is None else bias.contiguous(), top_k, norm, True, scale, 1e-20)


def _select(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm: bool, sigmoid: bool, scale: float,
            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or not 0 < top_k <= logits.shape[1] or "select" not in _kernels()):
        return None
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        bt = rows_per_program(e) // (2 if sigmoid else 1)
        _K["select"][(-(-t // bt),)](logits, logits.stride(0), logits if bias is None else bias, w, ids, t,
                                     float(scale), float(eps), E=e, EP=max(16, 1 << (e - 1).bit_length()), TOP=top_k,
                                     TP=1 << (top_k - 1).bit_length(), NORM=norm, SIGMOID=sigmoid,
                                     BIAS=bias is not None, BT=bt, num_warps=8)
    return w, ids


def softmax_topk_torch(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, top-k, renormalised when ``norm`` (as transformers'
    Qwen-MoE and Mixtral routers)."""
    w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def sigmoid_topk_torch(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.deepseek_moe.deepseek_route`` with sigmoid scores and one group: the top-k of
    sigmoid(logits) + bias, weighed by sigmoid(logits), renormalised when ``norm``, times ``scale``."""
    scores = logits.sigmoid()
    return top_k_weighed(scores, scores if bias is None else scores + bias, top_k, norm, scale)


def top_k_weighed(scores: torch.Tensor, choice: torch.Tensor, top_k: int, norm: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's pick and weights ([T, k] float32, [T, k] int64): the top-k of ``choice`` [T, E]
    (the scores, biased or masked for picking), weighed by ``scores``, renormalised when ``norm``
    (the sum + 1e-20), times ``scale``."""
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, ids


def check(logits: torch.Tensor, top_k: int, norm: bool, sigmoid: Sigmoid = None) -> bool:
    """The kernel's picks and weights against the torch path's on ``logits`` (``sigmoid``: the
    score-correction bias and scale of DeepSeek's ungrouped sigmoid routing; None: softmax). A
    row may pick differently only where the two picks' scores (probabilities; biased sigmoid
    scores), sorted, pair up within 1e-6 (biased scores: 1e-5; ties within float32 noise);
    elsewhere the ids are the same and the weights within 1e-5 relative. False where the kernel
    does not apply; RuntimeError on a mismatch."""
    ours, theirs, scores, name = _paths(top_k, norm, sigmoid)
    got = ours(logits)
    if got is None:
        return False
    # (biased scores reach the bias's magnitude, a few units, where a float32 step is ~5e-7: ties within 1e-5)
    assert_same_picks(name, got, theirs(logits), scores(logits), 1e-6 if sigmoid is None else 1e-5, "scores")
    return True


def _paths(top_k: int, norm: bool, sigmoid: Sigmoid) -> tuple[Callable, ...]:
    """(the kernel, the torch path, the scores the picks are made on, the kernel's name) for logits."""
    if sigmoid is None:
        return (lambda lg: softmax_topk(lg, top_k, norm), lambda lg: softmax_topk_torch(lg, top_k, norm),
                lambda lg: torch.softmax(lg, dim=-1), "softmax top-k kernel")
    bias, scale = sigmoid
    return (lambda lg: sigmoid_topk(lg, bias, top_k, norm, scale),
            lambda lg: sigmoid_topk_torch(lg, bias, top_k, norm, scale),
            lambda lg: lg.sigmoid() + (0 if bias is None else bias), "sigmoid top-k kernel")


def pick(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: int, top_k: int, norm: bool,
         device: torch.device, dtype: torch.dtype, margin: float = 0.03, sigmoid: Sigmoid = None) -> bool:
    """Whether a layer routes with the kernel: right (``check``) on the logits ``logits_of`` (the
    layer's router) gives for random rows at 16, 300 and 16,384 tokens, and at least ``margin``
    faster than the torch path's selection at the last. Logs the times."""
    g = torch.Generator().manual_seed(3)
    for t in (16, 300, 16384):
        logits = logits_of(torch.randn(t, hidden, generator=g).to(device, dtype))
        if not check(logits, top_k, norm, sigmoid):
            return False
    ours, theirs, _, name = _paths(top_k, norm, sigmoid)
    return faster(name, lambda: ours(logits), lambda: theirs(logits), "the torch path",
                  f"{logits.shape[1]} experts, top-{top_k}, {logits.shape[0]} tokens", margin)
