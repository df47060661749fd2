"""The cudnn_fe backend: a step's attention as at most two cuDNN calls through cuDNN's Python
frontend (``nvidia-cudnn-frontend``, optional), on the packed layout with ragged offsets.

One call takes the fresh sequences (queries over the step's own keys), one the prefixed
ones (queries over their packed ``[prefix | chunk]`` keys, causal from the bottom right).
Each sequence's length and its offsets into q, k, v and the output travel as device
tensors made once per step, so nothing is padded to a bucket, every layer's call writes
straight into the step's output, and one launch spreads all the step's sequences over the
GPU (the ``cudnn`` backend runs a call per sequence at its bucketed length, each with a
partly idle last wave). A graph (and its cuDNN plan) is built once per (sequences,
longest queries, longest keys) class: the counts rounded up to a power of two, the lengths
to ``per_octave`` steps per power of two; shorter sequences in a class only leave some
of its thread blocks with nothing to do. Sliding-window models take the ``cudnn`` backend's
route (torch varlen).

Measured on the H200 (``bench/bench_attention.py``, one Qwen3-8B layer, bf16, in short
bursts; ``bench/results/attention_cudnn_fe_a43e6c8.json``) against the ``cudnn`` backend:
sixteen GRPO responses after a shared prompt 1.87 against 2.65 ms, W2 with the prefix cache on
1.50 against 1.81, a W1 step continuing a split sequence 1.34 against 1.42, a W1 step of whole
sequences 1.12 against 1.12; the launching thread's time per layer 0.06-0.3 ms against
0.5-1.6. In the engine (same process, variants alternated): W1 0.0-0.7% less time, W2 with the
cache on 0.6%, W1f and W3 the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.buckets import batch_class, size_class
from teacher_server.attention.cudnn import CudnnBackend
from teacher_server.attention.cudnn_items import FeCall, PathFailed, ragged_columns
from teacher_server.attention.fe_widths import at_model_widths
from teacher_server.attention.packed import Plan, Varlen, cums
from teacher_server.attention.plan_store import PlanStore, code_digest
from teacher_server.attention.varlen import TorchVarlenBackend
from teacher_server.ops.slack import with_slack
from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)

# Operand ids in a graph
_Q, _K, _V, _O, _LEN_Q, _LEN_K, _OFF_Q, _OFF_K, _OFF_V, _OFF_O = range(1, 11)
WARM_MAX = 32768  # the longest fresh length whose graphs warm_up builds (the runner passes up to a step's tokens)
_UIDS = (_Q, _K, _V, _O, _LEN_Q, _LEN_K, _OFF_Q, _OFF_K, _OFF_V, _OFF_O)


class CudnnFrontendBackend(TorchVarlenBackend):
    """Settings: ``per_octave``, the length classes of graphs per power of two; ``split``, a
    ``cudnn`` backend that takes a step's prefixed part when it is one sequence whose split
    plans exist or are worth building (a recurring shape, such as W3's second chunks: there
    the non-causal call over the prefix and the causal square ran 1.3% faster than the
    frontend's masked call; a one-off shape, such as most W1 continuations, takes the
    frontend's call rather than varlen), or None."""

    sinks_by_lse = False  # its cuDNN calls return no log-sum-exp to a layer: sink models take varlen
    # Values narrower than keys (latent attention's 128 under keys of 192) go to cuDNN as they
    # are: no zero columns in its second product, none to drop from its output. Where the
    # frontend's call cannot take them (its check at the model's widths failed: ``native_v``
    # off) or the frontend is off, it says so (the model then pads them as it makes them); a
    # call that meets them on another route (the split, varlen) pads them here (``_padded``).
    distinct_v_width = True
    views_ok = True  # q and v as the latent layers' strided views (off where the check with them fails)
    name = "cudnn_fe"

    @property
    def takes_views(self) -> bool:  # (the frontend's own call takes them, values at their own width)
        return self.enabled and self.distinct_v_width and self.views_ok

    def __init__(self, per_octave: int = 4, split: CudnnBackend | None = None, plans: PlanStore | None = None,
                 ) -> None:
        """``plans``: where built graphs are kept across restarts (``plan_store``), or None."""
        super().__init__(concurrent_streams=0)
        import cudnn  # noqa: F401  (raises where the frontend or cuDNN is missing)

        self.per_octave = per_octave
        self.split = split
        self.enabled = True  # off for good (one log line) when the frontend refuses a shape
        self.native_v = True  # values narrower than keys go to the frontend's call as they are (else padded)
        self._graphs: dict[tuple, tuple] = {}  # full key -> (graph, workspace bytes)
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.builds: list[float] = []  # host seconds of each graph build (or load)
        self.plans = plans
        self.loaded: set[tuple] = set()  # graphs read back from ``plans``, not built here
        # cuDNN heuristics whose ranked plans a graph lists (the first that builds runs)
        self.heur_modes = ("A", "FALLBACK")
        # the start-up check (cudnn_fe_check.checked, set by the registry; it imports this module),
        # run again at the model's heads by warm_up
        self.check: Callable[..., bool] | None = None  # (backend, device, dtype, heads) -> passed

    # --- planning ----------------------------------------------------------------------
    def _fe_plan(self, x: AttentionInputs, ctx: StepContext) -> Plan:
        plan = Plan(self)
        npf, b = ctx.n_prefixed, len(ctx.q_lens)
        cq = cums(ctx.q_lens)
        hq, dv = x.q.shape[1], x.v.shape[2]
        for lo, hi, prefixed in ((0, npf, True), (npf, b, False)):
            if lo == hi:
                continue
            if prefixed and hi - lo == 1 and self.split is not None and dv == x.q.shape[2]:  # the split, where
                items = self.split.plan_prefixed(ctx)  # its plans exist or are worth building (not varlen)
                if not any(isinstance(it, Varlen) for it in items):
                    plan.items += items
                    continue
            q_lens = ctx.q_lens[lo:hi]
            k_lens = ctx.k_lens[lo:hi] if prefixed else q_lens
            kt = x.kp if prefixed else x.k
            vt = x.vp if prefixed else x.v
            bp = batch_class(hi - lo)
            t0 = cq[lo]
            lens, offs = ragged_columns(q_lens, k_lens, t0, prefixed, bp,
                                        (x.q.stride(0), kt.stride(0), vt.stride(0), hq * dv))
            pin = x.q.is_cuda
            lens_d = torch.tensor(lens, dtype=torch.int32, pin_memory=pin).to(x.q.device, non_blocking=True)
            offs_d = torch.tensor(offs, dtype=torch.int64, pin_memory=pin).to(x.q.device, non_blocking=True)
            key = (prefixed, bp, size_class(max(q_lens), self.per_octave), size_class(max(k_lens), self.per_octave))
            plan.items.append(FeCall(prefixed, t0, t0 + sum(q_lens), key, lens_d, offs_d))
        return plan

    def warm_up(self, max_len: int, hq: int, hkv: int, d: int, device: torch.device, dtype: torch.dtype,
                layers: int = 1, dv: int | None = None, views: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                ) -> float:
        """Check the backend at the model's heads (values ``dv`` wide, default ``d``; q and v as
        ``views`` where given), then build the graphs of fresh sequences (q, k, v contiguous or
        those views; scale d^-0.5) for up to eight
        sequences a call and every length class up to ``max_len`` (the runner's: a step's
        tokens, or less) and ``WARM_MAX``; other classes build on first use (the first W1
        steps take a few). Returns seconds."""
        if device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        dv = d if dv is None else dv
        if self.enabled and self.check is not None:  # the model's own widths (the start-up check's were CHECK_HEADS)
            dv = at_model_widths(self, device, dtype, (hq, hkv, d, dv), views)
        if not self.enabled:
            if self.split is not None:
                self.split.warm_up(max_len, hq, hkv, d, device, dtype, layers)
            return time.perf_counter() - t0
        if self.split is not None:  # the fresh sequences are this backend's: the split's plain squares are not needed
            self.split.plain_squares = False
        sizes = sorted({size_class(n, self.per_octave) for n in range(64, min(max_len, WARM_MAX) + 64, 64)})
        qs, ks, vs = (hq * d, d, 1), (hkv * d, d, 1), (hkv * dv, dv, 1)
        if views is not None and self.takes_views:  # (the graphs of the layers' own strides)
            qs, vs = views
        try:
            handle = self._handle(device)
            for bp in (1, 2, 4, 8):
                for s in sizes:
                    full = (False, bp, s, s, hq, hkv, d, dv, dtype, d ** -0.5, qs, ks, vs)
                    if full not in self._graphs:
                        self._build(full, handle)
        except torch.cuda.OutOfMemoryError:  # the other graphs build on first use
            log.warning("cuDNN frontend attention warm-up stopped after %d graphs (out of memory)", len(self._graphs))
            torch.cuda.empty_cache()
        except Exception as e:  # a graph the frontend does not build: as when a step meets one
            self._turn_off(e)
        graphs_s = time.perf_counter() - t0
        if self.split is not None:
            self.split.warm_up(max_len, hq, hkv, d, device, dtype, layers)
        secs = time.perf_counter() - t0
        log.info("attention warm-up: %d cuDNN graphs in %.1fs (%d of them read from %s), the split's in %.1fs",
                 len(self._graphs), graphs_s, len(self.loaded),
                 self.plans.dir if self.plans is not None else "no plan store", secs - graphs_s)
        return secs

    # --- running -----------------------------------------------------------------------
    def __call__(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
        fe = window is None and self._on_device(x) and self.enabled
        if not (fe and self.takes_views):  # strided views go to the frontend's call alone
            x = AttentionInputs(with_slack(x.q), x.k, with_slack(x.v), x.kp, with_slack(x.vp), x.sinks)
        if x.v.shape[2] != x.q.shape[2] and not (fe and self.native_v):
            return self._padded(x, ctx, scale, window, softcap)
        if not fe:
            if self.split is not None:
                return self.split(x, ctx, scale, window, softcap)
            return super().__call__(x, ctx, scale, window, softcap)
        key = (self, "fe")  # (the windowed layers' plans are the split's or varlen's own)
        plan = ctx.attn_plans.get(key)
        if plan is None:
            plan = ctx.attn_plans[key] = self._fe_plan(x, ctx)
        out = torch.empty(x.q.shape[0], x.q.shape[1], x.v.shape[2], dtype=x.q.dtype, device=x.q.device)
        try:
            for it in plan.items:
                if isinstance(it, FeCall):
                    self._run(it, x, scale, out)
                else:
                    self.split.run_item(it, x, scale, out)
        except torch.cuda.OutOfMemoryError:
            raise
        except PathFailed as e:  # cuDNN refused the split's shape: the frontend's call from now on
            log.warning("cuDNN split attention unavailable (%s); a lone prefixed sequence takes the frontend's call",
                        e.reason)
            self.split, ctx.attn_plan = None, None
            return self(x, ctx, scale, window, softcap)
        except Exception as e:  # the frontend refused a shape (a head size, a layout)
            self._turn_off(e)
            ctx.attn_plan = None
            return self(x, ctx, scale, window, softcap)
        return out

    def _padded(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                softcap: float | None) -> torch.Tensor:
        """The call with values zero-padded to the key width, the output's extra columns
        dropped: for a route that takes values only as wide as keys."""
        d, dv = x.q.shape[2], x.v.shape[2]
        pad = lambda t: None if t is None else torch.nn.functional.pad(t, (0, d - dv))  # noqa: E731
        wide = AttentionInputs(x.q, x.k, pad(x.v), x.kp, pad(x.vp), x.sinks)
        return self(wide, ctx, scale, window, softcap)[..., :dv]

    def _turn_off(self, e: Exception) -> None:
        """The frontend refused a graph: off for good, one log line (re-raised where the CUDA
        context is broken: nothing to fall back to)."""
        if "CUDA error" in str(e):
            raise e
        log.warning("cuDNN frontend attention unavailable (%s); using %s", " ".join(str(e).split())[:200],
                    "cudnn" if self.split is not None else "varlen")
        self.enabled = self.distinct_v_width = False  # (the model pads values from its next layer on)
        if self.split is not None:  # it takes the fresh sequences now
            self.split.plain_squares = True

    @staticmethod
    def _on_device(x: AttentionInputs) -> bool:
        """Can this step's tensors take cuDNN's calls (on a CUDA device)?"""
        return x.q.is_cuda

    def _handle(self, device: torch.device) -> object:
        import cudnn

        handles = getattr(self._tls, "handles", None)
        if handles is None:
            handles = self._tls.handles = {}
        if device not in handles:
            with torch.cuda.device(device):
                handles[device] = cudnn.create_handle()
        h = handles[device]
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
        return h

    def _run(self, it: FeCall, x: AttentionInputs, scale: float, out: torch.Tensor) -> None:
        kt, vt = (x.kp, x.vp) if it.prefixed else (x.k, x.v)
        handle = self._handle(x.q.device)
        full = (*it.key, x.q.shape[1], kt.shape[1], x.q.shape[2], vt.shape[2], x.q.dtype, scale,
                x.q.stride(), kt.stride(), vt.stride())
        entry = self._graphs.get(full)
        if entry is None:
            entry = self._build(full, handle)
        g, ws = entry
        workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=x.q.device)
        lens, offs = it.lens, it.offs
        g.execute([x.q, kt, vt, out, lens[0], lens[1], offs[0], offs[1], offs[2], offs[3]], workspace,
                  handle=handle, tensor_uids=_UIDS)

    def _build(self, full: tuple, handle: object) -> tuple:
        """The graph of ``full`` (and its workspace bytes): read from the plan store where it
        holds it, else built (and saved there)."""
        t = time.perf_counter()
        with self._lock:
            g = self._load(full, handle)
            if g is None:
                g = self._graph(full, handle)
                g.build_plans()
                if self.plans is not None:
                    self._save(full, g)
            entry = self._graphs[full] = (g, g.get_workspace_size())
        self.builds.append(time.perf_counter() - t)
        return entry

    def _load(self, full: tuple, handle: object) -> object | None:
        """The saved graph of ``full``, or None (not saved, or it did not load: the file is
        dropped). Caller holds the lock."""
        if self.plans is None:
            return None
        data = self.plans.load(self._store_key(full))
        if data is None:
            return None
        import cudnn

        try:
            g = cudnn.pygraph(handle=handle)
            g.deserialize(list(data))  # (pybind takes the bytes as a list of ints, not as bytes)
        except Exception as e:
            if "CUDA error" in str(e):
                raise
            log.info("cuDNN plan %s did not load (%s); building it", self.plans.path(self._store_key(full)).name,
                     " ".join(str(e).split())[:200])
            self.plans.drop(self._store_key(full))
            return None
        self.loaded.add(full)
        self.plans.loaded += 1
        return g

    def _save(self, full: tuple, g: object) -> None:
        try:
            data = bytes(g.serialize())
        except Exception as e:  # a plan cuDNN cannot serialize: built at every start, as without a store
            log.info("cuDNN plan not kept (%s)", " ".join(str(e).split())[:200])
            return
        self.plans.save(self._store_key(full), data)

    def _store_key(self, full: tuple) -> tuple:
        """A graph's name in the plan store: its full key, the heuristics that chose its plan, and
        the code that makes the graph (a change to ``_graph`` never reads a plan made before it)."""
        return (full, self.heur_modes, code_digest(type(self)._graph.__code__))

    def _graph(self, full: tuple, handle: object) -> object:
        """The graph of ``full`` with its execution plans chosen, not yet built. Caller holds the lock."""
        import cudnn

        prefixed, bp, sq, sk, hq, hk, d, dv, dtype, scale, qs, ks, vs = full
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)

        def thd(name: str, uid: int, h: int, s: int, st: tuple, w: int) -> object:  # [B, H, S, w] over packed rows
            return g.tensor(name=name, dim=[bp, h, s, w], stride=[s * st[0], st[1], st[0], st[2]], data_type=io,
                            uid=uid)

        def col(name: str, uid: int, n: int, kind: object) -> object:
            return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=kind, uid=uid)

        q, k, v = thd("q", _Q, hq, sq, qs, d), thd("k", _K, hk, sk, ks, d), thd("v", _V, hk, sk, vs, dv)
        i32, i64 = cudnn.data_type.INT32, cudnn.data_type.INT64
        len_q, len_k = col("len_q", _LEN_Q, bp, i32), col("len_k", _LEN_K, bp, i32)
        off_q, off_k, off_v, off_o = (col(nm, u, bp + 1, i64) for nm, u in
                                      (("off_q", _OFF_Q), ("off_k", _OFF_K), ("off_v", _OFF_V), ("off_o", _OFF_O)))
        q.set_ragged_offset(off_q)
        k.set_ragged_offset(off_k)
        v.set_ragged_offset(off_v)
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=False, attn_scale=scale, use_padding_mask=True,
                      seq_len_q=len_q, seq_len_kv=len_k,
                      diagonal_alignment=(cudnn.diagonal_alignment.BOTTOM_RIGHT if prefixed
                                          else cudnn.diagonal_alignment.TOP_LEFT),
                      diagonal_band_right_bound=0)
        o.set_uid(_O).set_output(True).set_dim([bp, hq, sq, dv]).set_stride([sq * hq * dv, dv, hq * dv, 1])
        o.set_data_type(io).set_ragged_offset(off_o)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in self.heur_modes])
        g.check_support()
        return g
