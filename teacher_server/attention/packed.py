"""Shared planning of the packed backends: the prefixed part and the fresh part of a step
each as one varlen call; subclasses may route leading sequences of a part elsewhere
(``_route``) and run those items themselves (``_run_special``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from teacher_server.attention.base import AttentionBackend, AttentionInputs
from teacher_server.attention.sinks import apply_sinks
from teacher_server.step_context import StepContext


@dataclass
class Varlen:
    """One varlen call over sequences [i, j) of one part: queries q[t0:t1], keys K[k0:k1]."""

    prefixed: bool
    t0: int
    t1: int
    k0: int
    k1: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass
class Plan:
    """A step's attention items (disjoint output rows), made by ``owner`` for the first
    layer of a kind (window) and reused by the others of that kind (``ctx.attn_plans``)."""

    owner: object
    items: list = field(default_factory=list)


def cums(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


class PackedBackend(AttentionBackend):
    """``concurrent_streams``: side CUDA streams for a step's attention items (0: one stream)."""

    name = "packed"

    def __init__(self, concurrent_streams: int = 3) -> None:
        self.concurrent_streams = concurrent_streams
        self._streams: dict[int | None, list[torch.cuda.Stream]] = {}

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Causal varlen attention of packed sequences (cu_q / cu_k: [B + 1] int32 offsets)."""
        raise NotImplementedError

    def varlen_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, scale: float, window: int | None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``varlen`` and its softmax's log-sum-exp [Hq, T] float32 (for attention sinks:
        ``sinks.apply_sinks``); backends that honour "sinks" have it."""
        raise NotImplementedError

    def _route(self, ctx: StepContext, window: int | None, lo: int, hi: int, prefixed: bool, items: list,
               cq: list[int], ck: list[int]) -> int:
        """Append special items for the leading sequences of [lo, hi) to items; return where
        the varlen tail starts."""
        return lo

    def _run_special(self, it: object, x: AttentionInputs, scale: float, out: torch.Tensor) -> None:
        raise NotImplementedError

    @staticmethod
    def _varlen_item(ctx: StepContext, j: int, hi: int, prefixed: bool, cq: list[int], ck: list[int]) -> Varlen:
        """One varlen call over sequences [j, hi) of one part (device offsets sliced, not copied)."""
        kk = ck if prefixed else cq
        dev_k = ctx.cu_k if prefixed else ctx.cu_q
        return Varlen(prefixed, cq[j], cq[hi], kk[j], kk[hi],
                      (ctx.cu_q[j:hi + 1] - cq[j]) if j else ctx.cu_q[:hi + 1],
                      (dev_k[j:hi + 1] - kk[j]) if j else dev_k[:hi + 1],
                      max(ctx.q_lens[j:hi]), max((ctx.k_lens if prefixed else ctx.q_lens)[j:hi]))

    def _plan(self, ctx: StepContext, window: int | None) -> Plan:
        plan, special = Plan(self), []
        cq, ck = cums(ctx.q_lens), cums(ctx.k_lens)
        npf, b = ctx.n_prefixed, len(ctx.q_lens)
        for lo, hi, prefixed in ((0, npf, True), (npf, b, False)):
            if lo == hi:
                continue
            j = self._route(ctx, window, lo, hi, prefixed, special, cq, ck)
            if j < hi:
                plan.items.append(self._varlen_item(ctx, j, hi, prefixed, cq, ck))
        plan.items = special + plan.items
        return plan

    def plan_for(self, ctx: StepContext, window: int | None) -> Plan:
        """This step's plan for layers with ``window`` (made by the first such layer): what a
        query sees depends on the window, so layers of another window never share it."""
        key = (self, window)
        plan = ctx.attn_plans.get(key)
        if plan is None:
            plan = ctx.attn_plans[key] = self._plan(ctx, window)
        return plan

    def __call__(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
        items = self.plan_for(ctx, window).items
        if len(items) == 1 and isinstance(items[0], Varlen) and items[0].t1 - items[0].t0 == x.q.shape[0]:
            return self._run_varlen(items[0], x, scale, window, softcap)
        out = x.q.new_empty(*x.q.shape[:2], x.v.shape[2])
        side = self._side_streams(x.q) if len(items) > 1 else None
        if side is None:
            for it in items:
                self._run_item(it, x, scale, window, out, softcap)
            return out
        # Items are independent (disjoint output rows), so they run on side streams at once:
        # one sequence's attention leaves SMs idle in its last wave, which the next fills.
        # Every tensor here outlives the join below, and later work on the main stream is
        # ordered after it, so no allocation is reused early.
        main = torch.cuda.current_stream(x.q.device)
        used = side[:len(items)]
        for s in used:
            s.wait_stream(main)
        try:
            for i, it in enumerate(items):
                with torch.cuda.stream(used[i % len(used)]):
                    self._run_item(it, x, scale, window, out, softcap)
        finally:
            for s in used:
                main.wait_stream(s)
        return out

    def _side_streams(self, q: torch.Tensor) -> list[torch.cuda.Stream] | None:
        if not q.is_cuda or self.concurrent_streams < 2:
            return None
        key = q.device.index
        if key not in self._streams:
            self._streams[key] = [torch.cuda.Stream(q.device) for _ in range(self.concurrent_streams)]
        return self._streams[key]

    def _run_item(self, it: object, x: AttentionInputs, scale: float, window: int | None, out: torch.Tensor,
                  softcap: float | None = None) -> None:
        if isinstance(it, Varlen):
            out[it.t0:it.t1] = self._run_varlen(it, x, scale, window, softcap)
        else:
            self._run_special(it, x, scale, out)

    def _run_varlen(self, it: Varlen, x: AttentionInputs, scale: float, window: int | None,
                    softcap: float | None = None) -> torch.Tensor:
        kk, vv = (x.kp, x.vp) if it.prefixed else (x.k, x.v)
        if x.sinks is not None:  # the sinks rescale each row by its log-sum-exp
            out, lse = self.varlen_lse(x.q[it.t0:it.t1], kk[it.k0:it.k1], vv[it.k0:it.k1], it.cu_q, it.cu_k,
                                       it.max_q, it.max_k, scale, window, softcap)
            return apply_sinks(out, lse, x.sinks)
        return self.varlen(x.q[it.t0:it.t1], kk[it.k0:it.k1], vv[it.k0:it.k1], it.cu_q, it.cu_k, it.max_q, it.max_k,
                           scale, window, softcap)
