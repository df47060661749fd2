"""The cudnn backend: cuDNN attention for sequences of at least ``min_len`` queries, at
bucketed lengths, torch varlen for the short rest and for sliding-window models. On the
H200 cuDNN runs ~613 TFLOP/s where varlen FA2 runs ~334."""

from __future__ import annotations

import logging
import time

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.buckets import bucket, bucket_floor
from teacher_server.attention.cudnn_items import Fresh, Group, PathFailed, Prefixed, not_a_shape_problem
from teacher_server.attention.packed import Plan, cums
from teacher_server.attention.varlen import TorchVarlenBackend
from teacher_server.ops.merge_attn import merge_attn
from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)

# Measured on the H200 (bf16, head dim 128): cuDNN ~613 TFLOP/s, varlen FA2 ~334.
_CUDNN_SPEEDUP = 1.8
_VARLEN_FLOPS = 334e12
# A new cuDNN shape's plan holds up the launching thread ~40-50 ms on the H200 (median of
# bench_cudnn_plans.py at both model shapes; now and then over a second). A constant, not
# this process's own timing (warm_up logs that): tensor-parallel ranks plan their attention
# each on its own, and must route alike.
_BUILD_S = 0.045


class CudnnBackend(TorchVarlenBackend):
    """Every cuDNN call is a square causal attention at a bucketed length (``bucket``), or,
    for a prefixed sequence, a non-causal one over the first ``bucket_floor(p)`` prefix keys
    plus a square causal one over the remaining keys (queries placed at their offset, zero
    rows before and after), merged by log-sum-exp. Padding rows are zeros and are never
    read back; causal masking keeps them out of every real row. A prefixed sequence goes to
    varlen instead when that is cheaper (a short chunk after a long prefix).

    Settings: ``min_len``, the fewest queries a sequence takes cuDNN with;
    ``new_plans_per_step`` (below); ``group_prefixes``, one non-causal call for the queries
    of neighbours sharing a prefix; ``native_gqa``, whether cuDNN takes fewer kv heads than
    q heads. ``enabled`` turns off for good (one log line) if cuDNN refuses a shape."""

    sinks_by_lse = False  # its cuDNN calls return no log-sum-exp to a layer: sink models take varlen

    name = "cudnn"

    def __init__(self, min_len: int = 256, new_plans_per_step: int | None = 1, group_prefixes: bool = True,
                 native_gqa: bool = True, concurrent_streams: int = 3) -> None:
        super().__init__(concurrent_streams)
        self.min_len = min_len
        # Building a cuDNN plan for a new shape holds up the launching thread for ~45 ms, while
        # the GPU runs dry. Square shapes are all built at start-up; the non-causal prefix
        # shapes (chunk bucket x prefix bucket) are too many for that (thousands), and most
        # come once: a chunk continuing a sequence split at a step's end has a shape of its
        # own. So a prefix shape is rented before it is bought: its calls go to varlen until
        # what varlen cost over cuDNN on them adds up to one build (``_plan_ready``), and
        # then a step builds at most ``new_plans_per_step`` of them (the others wait their
        # turn on varlen). A shape that recurs (a GRPO group's prompt, a long sequence's
        # chunks) is built within a few uses, or at once when one use saves more than a
        # build; a one-off never holds the launch up. None: build every shape on first use
        # (deterministic mode: a sequence's path must not depend on what ran before).
        self.new_plans_per_step = new_plans_per_step
        self.build_s = _BUILD_S  # host seconds a new plan takes
        self.layers = 1  # attention layers per forward (warm_up): a step's plan serves each
        self.flops_per_pair = 0.0  # per query-key pair and layer: 4 Hq D (warm_up); 0 until then
        self._rent: dict[tuple, float] = {}  # unbuilt prefix shape -> what varlen cost over cuDNN so far (s)
        self.group_prefixes = group_prefixes
        self.native_gqa = native_gqa
        self.enabled = True
        self.shapes: set[tuple] = set()  # cuDNN shapes run so far (each built a plan once)
        # Whether warm_up builds the squares without log-sum-exp too: those of fresh sequences
        # and of prefixes under 64 keys (no prefix call). Off where another backend takes the
        # fresh sequences (cudnn_fe's split): a lone prefixed sequence with such a short prefix
        # then takes the split only once its square exists, else the caller's own call (half
        # the warm-up's plans, ~4 s of an 8B start on the H200).
        self.plain_squares = True
        self._may_build: int | None = new_plans_per_step
        self._building: set[tuple] = set()

    # --- planning ----------------------------------------------------------------------
    def _route(self, ctx: StepContext, window: int | None, lo: int, hi: int, prefixed: bool, items: list,
               cq: list[int], ck: list[int]) -> int:
        if window is not None or not self.enabled:
            return lo
        if prefixed:
            return self._route_prefixed(ctx, lo, hi, items, cq, ck)
        j = lo
        while j < hi and ctx.q_lens[j] >= self.min_len:
            items.append(Fresh(cq[j], ctx.q_lens[j]))
            j += 1
        return j

    @staticmethod
    def _split_saves(members: list[tuple[int, int]], s: int) -> float:
        """What the cuDNN split saves over varlen for these (queries, prefix keys) sequences
        sharing their first s keys (one non-causal call for all their queries over those keys,
        a causal square each over the rest), in varlen query-key pairs; negative when it costs
        more."""
        split = (bucket(sum(c for c, _ in members)) * s + sum(bucket(p - s + c) ** 2 / 2 for c, p in members))
        return sum(c * p + c * c / 2 for c, p in members) - split / _CUDNN_SPEEDUP

    @classmethod
    def _split_pays(cls, members: list[tuple[int, int]], s: int) -> bool:
        """Is the cuDNN split cheaper than varlen for these sequences (``_split_saves``)?"""
        return cls._split_saves(members, s) > 0

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

    def _route_prefixed(self, ctx: StepContext, lo: int, hi: int, items: list, cq: list[int], ck: list[int]) -> int:
        """Prefixed sequences [lo, hi): a run of neighbours that share their first s keys
        (``ctx.prefix_shared``; s = the bucket floor of each one's prefix) takes one
        non-causal call for all their queries against those keys (``Group``); others take
        the split one by one (``Prefixed``) where it pays; the rest go to varlen, one call
        per run of neighbours. Returns hi (every sequence placed)."""
        run = None  # first sequence of the current varlen run
        j = lo
        while j < hi:
            e, s = self._group_end(ctx, j, hi)
            item = None
            prefixes = [k - q for q, k in zip(ctx.q_lens[j:e], ctx.k_lens[j:e])]
            if e - j > 1 and self._plan_ready(bucket(cq[e] - cq[j]), s, list(zip(ctx.q_lens[j:e], prefixes))):
                item = Group(cq[j], ctx.q_lens[j:e], ck[j:e], prefixes, s)
            else:
                e, c, p = j + 1, ctx.q_lens[j], ctx.k_lens[j] - ctx.q_lens[j]
                if (c >= self.min_len and self._split_pays([(c, p)], s) and self._plan_ready(bucket(c), s, [(c, p)])
                        and (s or self._plain_ready(p + c))):
                    item = Prefixed(cq[j], c, ck[j], p)
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

    def _plan(self, ctx: StepContext, window: int | None) -> Plan:
        self._may_build, self._building = self.new_plans_per_step, set()
        return super()._plan(ctx, window)

    def plan_prefixed(self, ctx: StepContext) -> list:
        """The items of the step's prefixed part alone (for a backend that runs the fresh
        part itself): this step's build allowance, then ``_route_prefixed``."""
        self._may_build, self._building = self.new_plans_per_step, set()
        items: list = []
        cq, ck = cums(ctx.q_lens), cums(ctx.k_lens)
        if self.enabled:
            self._route_prefixed(ctx, 0, ctx.n_prefixed, items, cq, ck)
        else:
            items.append(self._varlen_item(ctx, 0, ctx.n_prefixed, True, cq, ck))
        return items

    def run_item(self, it: object, x: AttentionInputs, scale: float, out: torch.Tensor) -> None:
        """One item of ``plan_prefixed`` into its rows of out (cuDNN refusing: ``PathFailed``)."""
        self._run_item(it, x, scale, None, out)

    def _plan_ready(self, cb: int, s: int, members: list[tuple[int, int]]) -> bool:
        """May prefixed chunks (``members``: (queries, prefix keys) each) take the cuDNN split
        with a non-causal (cb queries x s keys) call in this step: no such call, its plan
        exists, or it is worth building (the rent paid on varlen for this shape, this use
        included, adds up to a build) and the step may build one more."""
        shape = (cb, s, False, True)
        if s == 0 or self._may_build is None or shape in self.shapes or shape in self._building:
            return True
        rent = self._rent.get(shape, 0.0) + self._varlen_extra_s(members, s)
        if rent >= self.build_s and self._may_build > 0:
            self._may_build -= 1
            self._building.add(shape)
            self._rent.pop(shape, None)
            return True
        self._rent[shape] = rent
        return False

    def _plain_ready(self, n: int) -> bool:
        """May a causal square of n keys without log-sum-exp run on cuDNN (``plain_squares``)?"""
        return self.plain_squares or (bucket(n), bucket(n), True, False) in self.shapes

    def _varlen_extra_s(self, members: list[tuple[int, int]], s: int) -> float:
        """GPU seconds these prefixed chunks cost on varlen over the cuDNN split, over the
        forward's attention layers (at the measured rates: varlen ~334 TFLOP/s, cuDNN 1.8x);
        infinite before ``warm_up`` gave the model's sizes (every shape is built at once)."""
        if not self.flops_per_pair:
            return float("inf")
        return max(self._split_saves(members, s), 0.0) * self.flops_per_pair * self.layers / _VARLEN_FLOPS

    # --- running -----------------------------------------------------------------------
    def __call__(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
        try:
            return super().__call__(x, ctx, scale, window, softcap)
        except PathFailed as e:  # cuDNN refused a shape: varlen from now on, replan this step
            log.warning("cuDNN attention unavailable (%s); using varlen", e.reason)
            self.enabled = False
            ctx.attn_plan = None
            return super().__call__(x, ctx, scale, window, softcap)

    def _run_special(self, it: object, x: AttentionInputs, scale: float, out: torch.Tensor) -> None:
        try:
            if isinstance(it, Fresh):
                t1 = it.t0 + it.n
                out[it.t0:t1] = self._square(x.q[it.t0:t1], x.k[it.t0:t1], x.v[it.t0:t1], 0, scale, False)[0]
            elif isinstance(it, Group):
                self._split(x, it.t0, it.cs, it.k0s, it.ps, it.s, scale, out)
            else:
                self._split(x, it.t0, [it.c], [it.k0], [it.p], bucket_floor(it.p), scale, out)
        except RuntimeError as e:
            if not_a_shape_problem(e):  # out of memory / a broken context: not cuDNN's refusal
                raise
            raise PathFailed("cudnn", e) from e

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, lse: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """cuDNN attention: q [n, Hq, D], k, v [m, Hkv, D] -> ([n, Hq, D], lse [Hq, n] | None)."""
        g = q.shape[1] // k.shape[1]
        qd, kd, vd = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))  # [1, H, n, D] views
        if g > 1 and not self.native_gqa:
            kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, lse, 0.0, causal, False,
                                                                  scale=scale)
        self.shapes.add((q.shape[0], k.shape[0], causal, lse))  # its plan exists now
        return res[0][0].transpose(0, 1), (res[1].reshape(q.shape[1], q.shape[0]) if lse else None)

    @staticmethod
    def _padded(x: torch.Tensor, front: int, n: int) -> torch.Tensor:
        """n rows with x at rows [front, front + len). When x's storage has the rows around it
        (the step's q/k/v and packed keys are allocated with slack: ``ops.slack``), this is
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

    def _square(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, front: int, scale: float,
                lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of queries at key positions [front, front + c) over keys k, v
        ([front + c] rows), run at the bucketed length. Returns (out [c], lse [Hq, c] | None)."""
        c, m = q.shape[0], k.shape[0]
        n = bucket(m)
        o, lse_ = self._sdpa(self._padded(q, front, n), self._padded(k, 0, n), self._padded(v, 0, n), True, lse, scale)
        return o[front:front + c], (lse_[:, front:front + c] if lse else None)

    def _split(self, x: AttentionInputs, t0: int, cs: list[int], k0s: list[int], ps: list[int], s: int, scale: float,
               out: torch.Tensor) -> None:
        """Queries q[t0 : t0 + sum(cs)] of prefixed sequences whose first s keys are the same
        (sequence i: cs[i] queries after ps[i] prefix keys, its packed keys at kp[k0s[i]:]):
        one non-causal call for all the queries over those s keys, then a causal square each
        over its other keys, merged by log-sum-exp into out. s == 0: the squares alone."""
        q, kp, vp = x.q, x.kp, x.vp
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

    def warm_up(self, max_len: int, hq: int, hkv: int, d: int, device: torch.device, dtype: torch.dtype,
                layers: int = 1, dv: int | None = None, views: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                ) -> float:
        """Run every square bucket up to max_len once, so their cuDNN plans exist before
        the first request (the median host time of those builds is logged: ``_BUILD_S`` is
        what a prefix shape's build is weighed against; it takes no views). Returns the seconds it took."""
        t0 = time.perf_counter()
        self.layers, self.flops_per_pair = layers, 4.0 * hq * d
        median = _BUILD_S
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
            builds = []
            for n in sizes:
                for lse in (False, True) if self.plain_squares else (True,):
                    t = time.perf_counter()
                    self._sdpa(q[:n], k[:n], k[:n], True, lse, d ** -0.5)
                    builds.append(time.perf_counter() - t)
            torch.cuda.synchronize(device)
            median = sorted(builds)[len(builds) // 2]
        except torch.cuda.OutOfMemoryError:  # the larger shapes build their plans on first use
            log.warning("cuDNN attention warm-up stopped at length %d (out of memory)", n)
            torch.cuda.empty_cache()
        except RuntimeError as e:
            log.warning("cuDNN attention warm-up failed (%s); using varlen", " ".join(str(e).split())[:200])
            self.enabled = False
        secs = time.perf_counter() - t0
        log.info("attention warm-up: %d cuDNN shapes in %.1fs (median %.0f ms each)", len(self.shapes), secs,
                 1e3 * median)
        return secs
