"""Attention backends behind one interface: packed causal attention over a step's
sequences, where a sequence's queries may follow earlier keys (a cached prefix or earlier
chunks; causal alignment is bottom-right).

A step holds "prefixed" sequences first, then "fresh" ones (keys = their own queries),
each part longest first (``StepContext``). Every backend gets the step's q, k, v
([T, H, D]) and the packed ``[prefix | chunk]`` keys of the prefixed sequences (kp, vp).

- ``sdpa``: per-sequence ``scaled_dot_product_attention`` (CPU, float32, the reference).
- ``varlen``: torch's FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``).
- ``flash_attn``: the ``flash-attn`` package's ``flash_attn_varlen_func``.
- ``cudnn``: cuDNN attention for every sequence of at least ``cudnn_min_len`` queries
  (fresh: one dense causal call per run of equal lengths; prefixed: a non-causal call over
  the prefix and a causal one over the chunk, merged by their log-sum-exp), torch varlen for
  the short rest and for sliding-window models. On the H200 cuDNN runs ~613 TFLOP/s where
  varlen FA2 runs ~334.

``auto`` picks cudnn > flash_attn > varlen on CUDA for half precision, sdpa otherwise.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from teacher_server.model.context import StepContext

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
class _Dense:
    """cuDNN dense causal over b fresh sequences of n tokens each, starting at token t0."""

    t0: int
    b: int
    n: int


@dataclass
class _Merged:
    """cuDNN for one prefixed sequence: queries q[t0:t0+c], prefix keys kp[k0:k0+p]."""

    t0: int
    c: int
    k0: int
    p: int


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

    def _route(self, ctx: StepContext, window: int | None, lo: int, hi: int, prefixed: bool, items: list) -> int:
        """Append special items for the leading sequences of [lo, hi) to items; return where
        the varlen tail starts."""
        return lo

    def _plan(self, ctx: StepContext, window: int | None) -> _Plan:
        plan, special = _Plan(self), []
        cq, ck = _cums(ctx.q_lens), _cums(ctx.k_lens)
        npf, b = ctx.n_prefixed, len(ctx.q_lens)
        for lo, hi, prefixed in ((0, npf, True), (npf, b, False)):
            if lo == hi:
                continue
            j = self._route(ctx, window, lo, hi, prefixed, special)
            if j < hi:
                kk = ck if prefixed else cq
                plan.items.append(_Varlen(
                    prefixed, cq[j], cq[hi], kk[j], kk[hi],
                    (ctx.cu_q[j:hi + 1] - cq[j]) if j else ctx.cu_q[:hi + 1],
                    ((ctx.cu_k if prefixed else ctx.cu_q)[j:hi + 1] - kk[j]) if j else
                    (ctx.cu_k if prefixed else ctx.cu_q)[:hi + 1],
                    max(ctx.q_lens[j:hi]), max((ctx.k_lens if prefixed else ctx.q_lens)[j:hi])))
        plan.items = special + plan.items
        return plan

    def __call__(self, q, k, v, kp, vp, ctx, scale, window):  # noqa: ANN001, ANN204
        plan = ctx.attn_plan
        if plan is None or plan.owner is not self:
            plan = ctx.attn_plan = self._plan(ctx, window)
        if len(plan.items) == 1 and isinstance(plan.items[0], _Varlen) and plan.items[0].t1 - plan.items[0].t0 == q.shape[0]:
            return self._run_varlen(plan.items[0], q, k, v, kp, vp, scale, window)
        out = torch.empty_like(q)
        for it in plan.items:
            if isinstance(it, _Varlen):
                out[it.t0:it.t1] = self._run_varlen(it, q, k, v, kp, vp, scale, window)
            else:
                self._run_special(it, q, k, v, kp, vp, scale, out)
        return out

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


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D] (query head h reads kv head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class CudnnBackend(TorchVarlenBackend):
    """cuDNN attention for sequences of at least ``min_len`` queries, torch varlen for the
    rest. ``dense`` / ``merged`` switch the fresh / prefixed cuDNN paths; each turns itself
    off for good (one log line) if cuDNN refuses it or its self-check fails."""

    name = "cudnn"

    def __init__(self, min_len: int = 256) -> None:
        super().__init__()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self._sdpa_kernel, self._cudnn = sdpa_kernel, SDPBackend.CUDNN_ATTENTION
        self.min_len = min_len
        self.dense = self.merged = True
        self.native_gqa = True  # SDPA's enable_gqa on the cuDNN path; else heads are expanded

    def _route(self, ctx, window, lo, hi, prefixed, items):  # noqa: ANN001, ANN202
        if window is not None:
            return lo
        cq, ck = _cums(ctx.q_lens), _cums(ctx.k_lens)
        j = lo
        if prefixed and self.merged:
            while j < hi and ctx.q_lens[j] >= self.min_len:
                items.append(_Merged(cq[j], ctx.q_lens[j], ck[j], ctx.k_lens[j] - ctx.q_lens[j]))
                j += 1
        elif not prefixed and self.dense:
            while j < hi and ctx.q_lens[j] >= self.min_len:
                n, e = ctx.q_lens[j], j
                while e < hi and ctx.q_lens[e] == n:
                    e += 1
                items.append(_Dense(cq[j], e - j, n))
                j = e
        return j

    def __call__(self, q, k, v, kp, vp, ctx, scale, window):  # noqa: ANN001, ANN204
        while True:
            try:
                return super().__call__(q, k, v, kp, vp, ctx, scale, window)
            except _PathFailed as e:  # cuDNN refused these shapes: that path is off now, replan
                log.warning("cuDNN %s attention unavailable (%s); using varlen for it", e.path, e.reason)
                ctx.attn_plan = None

    def _run_special(self, it, q, k, v, kp, vp, scale, out):  # noqa: ANN001, ANN202
        if isinstance(it, _Dense):
            t1 = it.t0 + it.b * it.n
            try:
                out[it.t0:t1] = self._dense(q[it.t0:t1], k[it.t0:t1], v[it.t0:t1], it.b, it.n, scale)
            except RuntimeError as e:
                self.dense = False
                raise _PathFailed("dense", e) from e
        else:
            t1, k1 = it.t0 + it.c, it.k0 + it.p
            try:
                self._merged(q[it.t0:t1], kp[it.k0:k1], vp[it.k0:k1], kp[k1:k1 + it.c], vp[k1:k1 + it.c], scale,
                             out[it.t0:t1])
            except RuntimeError as e:
                self.merged = False
                raise _PathFailed("merged prefix", e) from e

    def _dense(self, q, k, v, b, n, scale):  # noqa: ANN001, ANN202
        """[b*n, H, D] -> [b*n, Hq, D]: b sequences of n tokens, causal."""
        hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
        qd = q.view(b, n, hq, d).transpose(1, 2)
        kd = k.view(b, n, hk, d).transpose(1, 2)
        vd = v.view(b, n, hk, d).transpose(1, 2)
        with self._sdpa_kernel([self._cudnn]):
            if self.native_gqa and hq != hk:
                try:
                    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
                except RuntimeError:
                    self.native_gqa = False
            if not self.native_gqa or hq == hk:
                o = F.scaled_dot_product_attention(qd, _expand_heads(kd, hq // hk), _expand_heads(vd, hq // hk),
                                                   is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(b * n, hq, d)

    def _merged(self, q, kpre, vpre, kown, vown, scale, out):  # noqa: ANN001, ANN202
        """One prefixed sequence: softmax over [prefix | chunk] keys = the two partial
        attentions merged by their log-sum-exp. Writes out [c, Hq, D]."""
        from teacher_server.ops.elementwise import merge_attn

        g = q.shape[1] // kpre.shape[1]
        qd = q.unsqueeze(0).transpose(1, 2)  # [1, Hq, c, D]
        t = lambda x: _expand_heads(x.unsqueeze(0).transpose(1, 2), g)  # noqa: E731
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        o1, l1 = op(qd, t(kpre), t(vpre), None, True, 0.0, False, False, scale=scale)[:2]
        o2, l2 = op(qd, t(kown), t(vown), None, True, 0.0, True, False, scale=scale)[:2]
        hq, c = q.shape[1], q.shape[0]
        merge_attn(o1[0].transpose(0, 1), l1.reshape(hq, c), o2[0].transpose(0, 1), l2.reshape(hq, c), out)


def self_check(backend: _PackedBackend, device: torch.device, dtype: torch.dtype) -> None:
    """Run one small mixed step (prefixed, fresh of equal lengths, short) through the
    backend and the sdpa reference; a cuDNN path that disagrees is switched off."""
    if not isinstance(backend, CudnnBackend):
        return
    g = torch.Generator(device="cpu").manual_seed(0)
    q_lens, k_lens, npf = [320, 300, 300, 40], [800, 300, 300, 40], 1
    hq, hk, d = 4, 2, 128
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (hq, hk, hk))
    kp, vp = (torch.randn(k_lens[0], hk, d, generator=g).to(device, dtype) for _ in range(2))
    kp[k_lens[0] - q_lens[0]:] = k[:q_lens[0]]
    vp[k_lens[0] - q_lens[0]:] = v[:q_lens[0]]

    def ctx_on(dev: torch.device) -> StepContext:
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        cq = torch.tensor(_cums(q_lens), dtype=torch.int32, device=dev)
        ck = torch.tensor(_cums(k_lens), dtype=torch.int32, device=dev)
        return StepContext(z, z, cq, ck, max(q_lens), max(k_lens), q_lens, k_lens, None, None, None, None, None,
                           k_lens[0], z, npf, q_lens[0])

    cpu = torch.device("cpu")
    ref = SdpaBackend()(*(x.float().to(cpu) for x in (q, k, v, kp, vp)), ctx_on(cpu), d ** -0.5, None)
    for _ in range(3):  # a failing path is switched off inside the call, then checked again
        try:
            got = backend(q, k, v, kp, vp, ctx_on(device), d ** -0.5, None).float().cpu()
        except Exception as e:
            log.warning("cuDNN attention self-check raised (%s); using varlen only", e)
            backend.dense = backend.merged = False
            return
        err = (got - ref).abs().amax(dim=(1, 2))
        bad_dense = err[q_lens[0]:q_lens[0] + 600].max().item() > 2e-2
        bad_merged = err[:q_lens[0]].max().item() > 2e-2
        if not (bad_dense or bad_merged):
            return
        if bad_dense and backend.dense:
            log.warning("cuDNN dense attention disagrees with the reference (%.3g); using varlen", err.max().item())
            backend.dense = False
        if bad_merged and backend.merged:
            log.warning("cuDNN merged prefix attention disagrees with the reference (%.3g); using varlen",
                        err.max().item())
            backend.merged = False
    backend.dense = backend.merged = False


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
        if not (b.dense or b.merged):
            raise RuntimeError("cuDNN attention failed its self-check")
        return b
    raise ValueError(f"attention backend {name!r} is not available (choose auto, sdpa, varlen, cudnn, flash_attn)")
