"""Attention backends behind one interface: packed causal attention over a step's
sequences, where a sequence's queries may follow earlier keys (a cached prefix or earlier
chunks; causal alignment is bottom-right).

A step holds "prefixed" sequences first, then "fresh" ones (keys = their own queries),
each part longest first (``StepContext``). Every backend gets the step's q, k, v
([T, H, D]) and the packed ``[prefix | chunk]`` keys of the prefixed sequences (kp, vp).

- ``sdpa``: per-sequence ``scaled_dot_product_attention`` (CPU, float32, the reference).
- ``varlen``: torch's FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``).
- ``flash_attn``: the ``flash-attn`` package's ``flash_attn_varlen_func``.
- ``cudnn``: cuDNN attention per sequence of at least 256 queries, at bucketed lengths
  (see ``CudnnBackend``), torch varlen for the short rest and for sliding-window models.
  On the H200 cuDNN runs ~613 TFLOP/s where varlen FA2 runs ~334.

``auto`` picks cudnn > flash_attn > varlen on CUDA for half precision, sdpa otherwise.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor | None,
                 vp: torch.Tensor | None, ctx: StepContext, scale: float, window: int | None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kp, vp: [ctx.total_k, Hkv, D] packed keys of the
        prefixed sequences (None when there are none). Returns [T, Hq, D]."""
        ...


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """One sequence, [lq, Hq, D] x [lk, Hkv, D] -> [lq, Hq, D]; bottom-right causal."""
    lq, lk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qi, ki, vi = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if groups > 1:
        ki = ki.repeat_interleave(groups, dim=0)
        vi = vi.repeat_interleave(groups, dim=0)
    if lq == lk and window is None:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
    else:
        qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        kpos = torch.arange(lk, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


class SdpaBackend:
    name = "sdpa"

    def __call__(self, q, k, v, kp, vp, ctx, scale, window):  # noqa: ANN001, ANN204
        out = torch.empty_like(q)
        qs = ks = 0
        for i, (lq, lk) in enumerate(zip(ctx.q_lens, ctx.k_lens)):
            if i < ctx.n_prefixed:
                ki, vi = kp[ks:ks + lk], vp[ks:ks + lk]
                ks += lk
            else:
                ki, vi = k[qs:qs + lq], v[qs:qs + lq]
            out[qs:qs + lq] = _sdpa_one(q[qs:qs + lq], ki, vi, scale, window)
            qs += lq
        return out


# --- packed backends ---------------------------------------------------------------------

@dataclass
class _Varlen:
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
class _Fresh:
    """cuDNN causal attention of one fresh sequence: tokens [t0, t0 + n)."""

    t0: int
    n: int


@dataclass
class _Prefixed:
    """cuDNN attention of one prefixed sequence: queries q[t0:t0+c], keys kp[k0:k0+p+c]
    (p of them before the queries)."""

    t0: int
    c: int
    k0: int
    p: int


@dataclass
class _Group:
    """cuDNN attention of neighbouring prefixed sequences whose first s keys are the same
    pool entries: one non-causal call for all their queries (q[t0 : t0 + sum(cs)]) against
    those s keys, then per sequence i a causal square over its keys kp[k0s[i] + s :
    k0s[i] + ps[i] + cs[i]], merged by log-sum-exp."""

    t0: int
    cs: list[int]
    k0s: list[int]
    ps: list[int]
    s: int


@dataclass
class _Plan:
    owner: object
    items: list = field(default_factory=list)


def _cums(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


class _PackedBackend:
    """Shared planning: the prefixed part and the fresh part each as one varlen call.
    Subclasses provide ``_varlen_fn`` and may route long sequences elsewhere."""

    name = "packed"

    def _varlen_fn(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):  # noqa: ANN001, ANN202
        raise NotImplementedError

    def _route(self, ctx: StepContext, window: int | None, lo: int, hi: int, prefixed: bool, items: list,
               cq: list[int], ck: list[int]) -> int:
        """Append special items for the leading sequences of [lo, hi) to items; return where
        the varlen tail starts."""
        return lo

    @staticmethod
    def _varlen_item(ctx: StepContext, j: int, hi: int, prefixed: bool, cq: list[int], ck: list[int]) -> _Varlen:
        """One varlen call over sequences [j, hi) of one part (device offsets sliced, not copied)."""
        kk = ck if prefixed else cq
        dev_k = ctx.cu_k if prefixed else ctx.cu_q
        return _Varlen(prefixed, cq[j], cq[hi], kk[j], kk[hi],
                       (ctx.cu_q[j:hi + 1] - cq[j]) if j else ctx.cu_q[:hi + 1],
                       (dev_k[j:hi + 1] - kk[j]) if j else dev_k[:hi + 1],
                       max(ctx.q_lens[j:hi]), max((ctx.k_lens if prefixed else ctx.q_lens)[j:hi]))

    def _plan(self, ctx: StepContext, window: int | None) -> _Plan:
        plan, special = _Plan(self), []
        cq, ck = _cums(ctx.q_lens), _cums(ctx.k_lens)
        npf, b = ctx.n_prefixed, len(ctx.q_lens)
        for lo, hi, prefixed in ((0, npf, True), (npf, b, False)):
            if lo == hi:
                continue
            j = self._route(ctx, window, lo, hi, prefixed, special, cq, ck)
            if j < hi:
                plan.items.append(self._varlen_item(ctx, j, hi, prefixed, cq, ck))
        plan.items = special + plan.items
        return plan

    def __call__(self, q, k, v, kp, vp, ctx, scale, window):  # noqa: ANN001, ANN204
        plan = ctx.attn_plan
        if plan is None or plan.owner is not self:
            plan = ctx.attn_plan = self._plan(ctx, window)
        if len(plan.items) == 1 and isinstance(plan.items[0], _Varlen) and plan.items[0].t1 - plan.items[0].t0 == q.shape[0]:
            return self._run_varlen(plan.items[0], q, k, v, kp, vp, scale, window)
        out = torch.empty_like(q)
        side = self._side_streams(q) if len(plan.items) > 1 else None
        if side is None:
            for it in plan.items:
                self._run_item(it, q, k, v, kp, vp, scale, window, out)
            return out
        # Items are independent (disjoint output rows), so they run on side streams at once:
        # one sequence's attention leaves SMs idle in its last wave, which the next fills.
        # Every tensor here outlives the join below, and later work on the main stream is
        # ordered after it, so no allocation is reused early.
        main = torch.cuda.current_stream(q.device)
        used = side[:len(plan.items)]
        for s in used:
            s.wait_stream(main)
        try:
            for i, it in enumerate(plan.items):
                with torch.cuda.stream(used[i % len(used)]):
                    self._run_item(it, q, k, v, kp, vp, scale, window, out)
        finally:
            for s in used:
                main.wait_stream(s)
        return out

    concurrent_streams = 3  # side streams for a step's attention items on CUDA (0: one stream)

    def _side_streams(self, q: torch.Tensor) -> list | None:
        if not q.is_cuda or self.concurrent_streams < 2:
            return None
        key = q.device.index
        streams = getattr(self, "_streams", {})
        if key not in streams:
            streams[key] = [torch.cuda.Stream(q.device) for _ in range(self.concurrent_streams)]
            self._streams = streams
        return streams[key]

    def _run_item(self, it, q, k, v, kp, vp, scale, window, out) -> None:  # noqa: ANN001
        if isinstance(it, _Varlen):
            out[it.t0:it.t1] = self._run_varlen(it, q, k, v, kp, vp, scale, window)
        else:
            self._run_special(it, q, k, v, kp, vp, scale, out)

    def _run_varlen(self, it: _Varlen, q, k, v, kp, vp, scale, window):  # noqa: ANN001, ANN202
        kk, vv = (kp, vp) if it.prefixed else (k, v)
        return self._varlen_fn(q[it.t0:it.t1], kk[it.k0:it.k1], vv[it.k0:it.k1], it.cu_q, it.cu_k,
                               it.max_q, it.max_k, scale, window)

    def _run_special(self, it, q, k, v, kp, vp, scale, out):  # noqa: ANN001, ANN202
        raise NotImplementedError


class TorchVarlenBackend(_PackedBackend):
    """torch's varlen FlashAttention-2."""

    name = "varlen"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        self._has_gqa_flag = "enable_gqa" in inspect.signature(varlen_attn).parameters

    def _varlen_fn(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):  # noqa: ANN001, ANN202
        kw = {"scale": scale, "window_size": (-1 if window is None else window - 1, 0)}
        if self._has_gqa_flag and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        return self._fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


class FlashAttnBackend(_PackedBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def _varlen_fn(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):  # noqa: ANN001, ANN202
        ws = (-1, -1) if window is None else (window - 1, 0)
        return self._fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True, window_size=ws)


class _PathFailed(Exception):
    def __init__(self, path: str, err: Exception) -> None:
        super().__init__(path)
        self.path, self.reason = path, " ".join(str(err).split())[:200]


def _not_a_shape_problem(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA error" in str(e)


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D] (query head h reads kv head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def bucket(n: int, per_octave: int = 16) -> int:
    """n rounded up to the next of ``per_octave`` steps per power of two (multiples of 64
    up to 1024): the shapes cuDNN attention runs at, so its execution plans (built once per
    shape) are few and made at start-up. Waste: under 1/per_octave of n."""
    g = 64 if n <= 1024 else (1 << (n.bit_length() - 1)) // per_octave
    return -(-n // g) * g


def slack_rows(n: int) -> int:
    """Rows of slack before and after a step's q/k/v (n rows) so that bucket padding and
    prefix-split offsets of the cuDNN backend are views, not copies (when they fit)."""
    return 64 + n // 8


def bucket_floor(n: int, per_octave: int = 8) -> int:
    """The largest bucket value (``per_octave`` per power of two) not above n; 0 below 64."""
    if n < 64:
        return 0
    g = 64 if n <= 1024 else (1 << (n.bit_length() - 1)) // per_octave
    return (n // g) * g


# Measured on the H200 (bf16, head dim 128): cuDNN ~613 TFLOP/s, varlen FA2 ~334.
_CUDNN_SPEEDUP = 1.8


class CudnnBackend(TorchVarlenBackend):
    """cuDNN attention for sequences of at least ``min_len`` queries, torch varlen for the
    rest (and for sliding-window models).

    Every cuDNN call is a square causal attention at a bucketed length (``bucket``), or,
    for a prefixed sequence, a non-causal one over the first ``bucket_floor(p)`` prefix keys
    plus a square causal one over the remaining keys (queries placed at their offset, zero
    rows before and after), merged by log-sum-exp. Padding rows are zeros and are never
    read back; causal masking keeps them out of every real row. A prefixed sequence goes to
    varlen instead when that is cheaper (a short chunk after a long prefix).

    ``enabled`` turns off for good (one log line) if cuDNN refuses a shape or the start-up
    self-check fails; ``native_gqa`` is whether cuDNN takes fewer kv heads than q heads."""

    name = "cudnn"

    def __init__(self, min_len: int = 256) -> None:
        super().__init__()
        self.min_len = min_len
        self.enabled = True
        self.native_gqa = True
        self.shapes: set[tuple] = set()  # cuDNN shapes run so far (each built a plan once)

    def _route(self, ctx, window, lo, hi, prefixed, items, cq, ck):  # noqa: ANN001, ANN202
        if window is not None or not self.enabled:
            return lo
        if prefixed:
            return self._route_prefixed(ctx, lo, hi, items, cq, ck)
        j = lo
        while j < hi and ctx.q_lens[j] >= self.min_len:
            items.append(_Fresh(cq[j], ctx.q_lens[j]))
            j += 1
        return j

    @staticmethod
    def _split_pays(members: list[tuple[int, int]], s: int) -> bool:
        """Is the cuDNN split cheaper than varlen for these (queries, prefix keys) sequences
        sharing their first s keys: one non-causal call for all their queries over those
        keys, a causal square each over the rest (work in varlen query-key pairs)?"""
        split = (bucket(sum(c for c, _ in members)) * s + sum(bucket(p - s + c) ** 2 / 2 for c, p in members))
        return split / _CUDNN_SPEEDUP < sum(c * p + c * c / 2 for c, p in members)

    group_prefixes = True  # one non-causal call for the queries of sequences sharing a prefix

    def _group_end(self, ctx: StepContext, j: int, hi: int) -> tuple[int, int]:
        """(e, s): sequences [j, e) share their first s keys (s = the bucket floor of each
        one's prefix), each has at least ``min_len`` queries, and the split for them together
        pays. e = j + 1 when there is no such group of two or more."""
        shared, q, k = ctx.prefix_shared, ctx.q_lens, ctx.k_lens
        s = bucket_floor(k[j] - q[j])
        if not self.group_prefixes or shared is None or not s or q[j] < self.min_len:
            return j + 1, s
        e = j + 1
        while e < hi and shared[e] >= s and q[e] >= self.min_len and bucket_floor(k[e] - q[e]) == s:
            e += 1
        if e - j < 2 or not self._split_pays([(q[i], k[i] - q[i]) for i in range(j, e)], s):
            return j + 1, s
        return e, s

    def _route_prefixed(self, ctx, lo, hi, items, cq, ck):  # noqa: ANN001, ANN202
        """Prefixed sequences [lo, hi): a run of neighbours that share their first s keys
        (``ctx.prefix_shared``; s = the bucket floor of each one's prefix) takes one
        non-causal call for all their queries against those keys (``_Group``); others take
        the split one by one (``_Prefixed``) where it pays; the rest go to varlen, one call
        per run of neighbours. Returns hi (every sequence placed)."""
        run = None  # first sequence of the current varlen run
        j = lo
        while j < hi:
            e, s = self._group_end(ctx, j, hi)
            item = None
            if e - j > 1 and self._plan_ready(bucket(cq[e] - cq[j]), s):
                item = _Group(cq[j], ctx.q_lens[j:e], ck[j:e], [k - q for q, k in zip(ctx.q_lens[j:e], ctx.k_lens[j:e])], s)
            else:
                e, c, p = j + 1, ctx.q_lens[j], ctx.k_lens[j] - ctx.q_lens[j]
                if c >= self.min_len and self._split_pays([(c, p)], s) and self._plan_ready(bucket(c), s):
                    item = _Prefixed(cq[j], c, ck[j], p)
            if item is None:
                run = j if run is None else run
            else:
                if run is not None:
                    items.append(self._varlen_item(ctx, run, j, True, cq, ck))
                    run = None
                items.append(item)
            j = e
        if run is not None:
            items.append(self._varlen_item(ctx, run, hi, True, cq, ck))
        return hi

    # Building a cuDNN plan for a new shape holds up the launching thread for ~20 ms, while
    # the GPU runs dry. Square shapes are all built at start-up; the non-causal prefix shapes
    # (chunk bucket x prefix bucket) are too many for that, so a step builds at most this many
    # new ones and sends other prefixed chunks with unbuilt shapes to varlen until their turn.
    # None: build every shape on first use (deterministic mode: a sequence's path must not
    # depend on what ran before).
    new_plans_per_step: int | None = 1

    def _plan(self, ctx, window):  # noqa: ANN001, ANN202
        self._may_build, self._building = self.new_plans_per_step, set()
        return super()._plan(ctx, window)

    def _plan_ready(self, cb: int, s: int) -> bool:
        """May a prefixed chunk take the cuDNN split with a non-causal (cb queries x s keys)
        call in this step: no such call, its plan exists, or the step may build it."""
        shape = (cb, s, False, True)
        if s == 0 or self._may_build is None or shape in self.shapes or shape in self._building:
            return True
        if self._may_build > 0:
            self._may_build -= 1
            self._building.add(shape)
            return True
        return False

    def __call__(self, q, k, v, kp, vp, ctx, scale, window):  # noqa: ANN001, ANN204
        try:
            return super().__call__(q, k, v, kp, vp, ctx, scale, window)
        except _PathFailed as e:  # cuDNN refused a shape: varlen from now on, replan this step
            log.warning("cuDNN attention unavailable (%s); using varlen", e.reason)
            self.enabled = False
            ctx.attn_plan = None
            return super().__call__(q, k, v, kp, vp, ctx, scale, window)

    def _run_special(self, it, q, k, v, kp, vp, scale, out):  # noqa: ANN001, ANN202
        try:
            if isinstance(it, _Fresh):
                t1 = it.t0 + it.n
                out[it.t0:t1] = self._square(q[it.t0:t1], k[it.t0:t1], v[it.t0:t1], 0, scale, False)[0]
            elif isinstance(it, _Group):
                self._split(q, kp, vp, it.t0, it.cs, it.k0s, it.ps, it.s, scale, out)
            else:
                self._split(q, kp, vp, it.t0, [it.c], [it.k0], [it.p], bucket_floor(it.p), scale, out)
        except RuntimeError as e:
            if _not_a_shape_problem(e):  # out of memory / a broken context: not cuDNN's refusal
                raise
            raise _PathFailed("cudnn", e) from e

    def _sdpa(self, q, k, v, causal: bool, lse: bool, scale: float):  # noqa: ANN001, ANN202
        """cuDNN attention: q [n, Hq, D], k, v [m, Hkv, D] -> ([n, Hq, D], lse [Hq, n] | None)."""
        g = q.shape[1] // k.shape[1]
        qd, kd, vd = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))  # [1, H, n, D] views
        if g > 1 and not self.native_gqa:
            kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, lse, 0.0, causal, False,
                                                                  scale=scale)
        self.shapes.add((q.shape[0], k.shape[0], causal, lse))  # its plan exists now
        return res[0][0].transpose(0, 1), (res[1].reshape(q.shape[1], q.shape[0]) if lse else None)

    @staticmethod
    def _padded(x: torch.Tensor, front: int, n: int) -> torch.Tensor:
        """n rows with x at rows [front, front + len). When x's storage has the rows around it
        (the step's q/k/v and packed keys are allocated with slack: ``slack_rows``), this is
        a view, no copy: padding query rows may hold anything (their outputs are dropped and
        never mix into other rows); padding key/value rows lie after x, where the buffers hold
        later sequences' keys or zeroed slack, so they are finite (a zero softmax weight
        times a NaN value would be NaN). Otherwise a zero-padded copy."""
        if front == 0 and x.shape[0] == n:
            return x
        r = x.stride(0)
        off = x.storage_offset() - front * r
        if x.is_contiguous() and off >= 0 and off + n * r <= x.untyped_storage().nbytes() // x.element_size():
            return x.as_strided((n, *x.shape[1:]), x.stride(), off)
        buf = x.new_empty(n, *x.shape[1:])
        buf[:front].zero_()
        buf[front:front + x.shape[0]] = x
        buf[front + x.shape[0]:].zero_()
        return buf

    def _square(self, q, k, v, front: int, scale: float, lse: bool):  # noqa: ANN001, ANN202
        """Causal attention of queries at key positions [front, front + c) over keys k, v
        ([front + c] rows), run at the bucketed length. Returns (out [c], lse [Hq, c] | None)."""
        c, m = q.shape[0], k.shape[0]
        n = bucket(m)
        o, l = self._sdpa(self._padded(q, front, n), self._padded(k, 0, n), self._padded(v, 0, n), True, lse, scale)
        return o[front:front + c], (l[:, front:front + c] if lse else None)

    def _split(self, q, kp, vp, t0: int, cs: list[int], k0s: list[int], ps: list[int], s: int, scale: float,
               out: torch.Tensor) -> None:  # noqa: ANN001
        """Queries q[t0 : t0 + sum(cs)] of prefixed sequences whose first s keys are the same
        (sequence i: cs[i] queries after ps[i] prefix keys, its packed keys at kp[k0s[i]:]):
        one non-causal call for all the queries over those s keys, then a causal square each
        over its other keys, merged by log-sum-exp into out. s == 0: the squares alone."""
        from teacher_server.ops.elementwise import merge_attn

        n = sum(cs)
        if s:
            o1, l1 = self._sdpa(self._padded(q[t0:t0 + n], 0, bucket(n)), kp[k0s[0]:k0s[0] + s],
                                vp[k0s[0]:k0s[0] + s], False, True, scale)
        t = 0
        for c, k0, p in zip(cs, k0s, ps):
            a, b = t0 + t, t0 + t + c
            o2, l2 = self._square(q[a:b], kp[k0 + s:k0 + p + c], vp[k0 + s:k0 + p + c], p - s, scale, s > 0)
            if s:
                merge_attn(o1[t:t + c], l1[:, t:t + c], o2, l2, out[a:b])
            else:
                out[a:b] = o2
            t += c

    def warm_up(self, max_len: int, hq: int, hkv: int, d: int, device: torch.device, dtype: torch.dtype) -> float:
        """Run every square bucket up to max_len once, so their cuDNN plans exist before
        the first request. Returns the seconds it took."""
        import time

        t0 = time.perf_counter()
        if not self.enabled:
            return 0.0
        sizes, n = [], self.min_len
        while n <= bucket(max_len):
            sizes.append(bucket(n))
            n = bucket(n) + 1
        if not sizes:  # max_len below the cuDNN minimum: every sequence takes varlen
            return 0.0
        n = sizes[0]
        try:
            q = torch.randn(sizes[-1], hq, d, device=device, dtype=dtype)
            k = torch.randn(sizes[-1], hkv, d, device=device, dtype=dtype)
            for n in sizes:
                for lse in (False, True):
                    self._sdpa(q[:n], k[:n], k[:n], True, lse, d ** -0.5)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:  # the larger shapes build their plans on first use
            log.warning("cuDNN attention warm-up stopped at length %d (out of memory)", n)
            torch.cuda.empty_cache()
        except RuntimeError as e:
            log.warning("cuDNN attention warm-up failed (%s); using varlen", " ".join(str(e).split())[:200])
            self.enabled = False
        return time.perf_counter() - t0


def self_check(backend: CudnnBackend, device: torch.device, dtype: torch.dtype) -> None:
    """Run one small mixed step (prefixed with and without a prefix split, two sharing a
    prefix, fresh at and off a bucket length, short ones) through the backend, every shape
    on cuDNN, and through the float32 sdpa reference. cuDNN with native GQA is tried first,
    then with expanded kv heads, each with prefix groups and without; if none agrees the
    backend runs varlen only (``enabled`` off)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    # (q, k): prefixed first; the last two prefixed share their first 800 keys (a group)
    lens = [(320, 900), (260, 300), (300, 1100), (280, 1100), (512, 512), (300, 300), (40, 40)]
    q_lens, k_lens, npf = [a for a, _ in lens], [b for _, b in lens], 4
    shared = [0, 0, 0, 800]
    hq, hk, d = 4, 2, 128
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (hq, hk, hk))
    kp, vp = (torch.randn(sum(k_lens[:npf]), hk, d, generator=g).to(device, dtype) for _ in range(2))
    qo = ko = 0
    for i, (lq, lk) in enumerate(lens[:npf]):  # each prefixed sequence's own keys end its packed keys
        kp[ko + lk - lq:ko + lk] = k[qo:qo + lq]
        vp[ko + lk - lq:ko + lk] = v[qo:qo + lq]
        if shared[i]:
            pk = ko - k_lens[i - 1]
            kp[ko:ko + shared[i]] = kp[pk:pk + shared[i]]
            vp[ko:ko + shared[i]] = vp[pk:pk + shared[i]]
        qo, ko = qo + lq, ko + lk

    def ctx_on(dev: torch.device) -> StepContext:
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        cq = torch.tensor(_cums(q_lens), dtype=torch.int32, device=dev)
        ck = torch.tensor(_cums(k_lens), dtype=torch.int32, device=dev)
        return StepContext(input_ids=z, positions=z, cu_q=cq, cu_k=ck, max_q=max(q_lens), max_k=max(k_lens),
                           q_lens=q_lens, k_lens=k_lens, logits_idx=z, total_k=sum(k_lens[:npf]), n_prefixed=npf,
                           tok_prefixed=sum(q_lens[:npf]), prefix_shared=shared)

    cpu = torch.device("cpu")
    ref = SdpaBackend()(*(x.float().to(cpu) for x in (q, k, v, kp, vp)), ctx_on(cpu), d ** -0.5, None)
    limit, backend.new_plans_per_step = backend.new_plans_per_step, None
    try:
        # Native GQA before expanded kv heads; prefix groups on, then off (a group path that
        # fails costs the groups only, not cuDNN).
        for native, grouped in ((True, True), (True, False), (False, True), (False, False)):
            backend.native_gqa, backend.group_prefixes, backend.enabled = native, grouped, True
            try:
                c = ctx_on(device)
                got = backend(q, k, v, kp, vp, c, d ** -0.5, None).float().cpu()
            except Exception as e:  # noqa: BLE001 - any failure: try the next variant
                log.info("cuDNN attention self-check (native GQA %s, groups %s) raised: %s", native, grouped, e)
                continue
            kinds = {type(it) for it in c.attn_plan.items}
            took = backend.enabled and {_Fresh, _Prefixed} | ({_Group} if grouped else set()) <= kinds
            err = (got - ref).abs().max().item()
            if took and err < 2e-2:
                if not grouped:
                    log.warning("cuDNN attention: prefix groups failed the self-check; each prefixed sequence runs alone")
                return
            log.info("cuDNN attention self-check (native GQA %s, groups %s): error %.3g, cuDNN paths used %s", native,
                     grouped, err, sorted(t.__name__ for t in kinds))
        log.warning("cuDNN attention failed its self-check; using varlen")
        backend.enabled = False
    finally:
        backend.new_plans_per_step = limit


def make_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """Build the named backend; ``auto`` picks cudnn > flash_attn > varlen on CUDA for
    bf16/fp16, sdpa on CPU and for float32 (the fused kernels take half precision only)."""
    if name == "auto":
        if device.type != "cuda" or dtype == torch.float32:
            return SdpaBackend()
        for cand in ("cudnn", "flash_attn", "varlen"):
            try:
                return make_backend(cand, device, dtype)
            except Exception as e:  # missing package or op: try the next one
                log.info("attention backend %s unavailable: %s", cand, e)
        return SdpaBackend()
    if name == "sdpa":
        return SdpaBackend()
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "varlen":
        return TorchVarlenBackend()
    if name == "flash_attn":
        return FlashAttnBackend()
    if name == "cudnn":
        if not torch.backends.cudnn.is_available():
            raise RuntimeError("cuDNN is not available")
        b = CudnnBackend()
        self_check(b, device, dtype)
        if not b.enabled:
            raise RuntimeError("cuDNN attention failed its self-check")
        return b
    raise ValueError(f"attention backend {name!r} is not available (choose auto, sdpa, varlen, cudnn, flash_attn)")
