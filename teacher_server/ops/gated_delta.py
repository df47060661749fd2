"""The ops of a Gated DeltaNet layer over a step's packed varlen tokens; the two sequence
ops carry per-sequence initial and end states:

- ``causal_conv1d``: depthwise causal convolution (kernel W) then SiLU. Its state is the
  last W inputs of a sequence, ``[N, D, W]`` (entry W - 1 the newest; entry 0 is not read by
  the next chunk, only kept for the layout fla-core uses, so no copy is needed there).
- ``gated_delta_rule``: the chunked gated delta rule with L2-normed q and k, q scaled by
  ``K ** -0.5``, value heads a multiple of the q/k heads (GVA: value head h reads q/k head
  ``h // (HV / H)``); float32 recurrent state ``[N, HV, K, V]``. The layer norms q and k
  itself (``linear_prep``, a compiled stage that also makes q, k, v contiguous and computes
  the gates in the same pass) and says so (``qk_normed``): fla-core would otherwise copy the
  strided q/k/v column slices and norm q and k in passes of their own.

Per token t (per value head): ``S = exp(g_t) S``, ``u_t = beta_t (v_t - S^T k_t)``,
``S = S + k_t u_t^T``, ``o_t = S^T q_t``. On CUDA with fla-core importable both run its
Triton kernels (``LinearPlan`` carries the host copy of the sequence ends and fla's chunk
indices, so no call syncs); otherwise the torch path below (float32, a loop over the step's
sequences), with one warning on CUDA. ``check_fla`` is the start-up check on CUDA. (The
layer's gated output norm is a stage of ``FusedOps``: fla-core's fused norm tunes itself
again for every 65536 rows of a step's token count, seconds each time a step size is new.)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHUNK = 64  # chunk length of the chunked rule (fla's default; its conv uses the same chunk indices)
_FLA: dict[str, Any] = {}


def fla_ops() -> dict[str, Any] | None:
    """fla-core's chunked gated delta rule and causal convolution, or None when it does not
    import (then the torch path runs; a warning once)."""
    if not _FLA:
        try:
            from fla.modules.causal_conv1d import causal_conv1d as conv
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
            from fla.ops.utils.index import prepare_chunk_indices
        except Exception as e:  # not installed, or no triton
            log.warning("fla-core unavailable (%s: %s); Gated DeltaNet layers run the torch path (slow on GPU)",
                        type(e).__name__, e)
            _FLA["ok"] = None
        else:
            _FLA["ok"] = {"conv": conv, "rule": rule, "chunk_indices": prepare_chunk_indices}
    return _FLA["ok"]


@dataclass
class LinearPlan:
    """A step's sequence layout for the linear layers, made once per step (``make_plan``).
    ``bounds``: host [N + 1] sequence ends (cu_q); ``cu``: the same on the device, int64;
    ``chunk_indices``: fla's [chunks, 2] (sequence, chunk) table on the device (fla path
    only); ``has_init``: some sequence starts from a stored state; ``keep``: some end state
    is stored."""

    bounds: list[int]
    cu: torch.Tensor
    fla: dict[str, Any] | None
    chunk_indices: torch.Tensor | None
    has_init: bool
    keep: bool
    _heads: dict[int, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def seq_of(self) -> torch.Tensor:
        """Each token's sequence, int32 [T] on the device, for the fused input stage
        (``ops.conv_prep``): made on its first use in a step, not at all on the other paths."""
        return seq_of_tokens(self.cu, self.bounds[-1])

    def heads(self, n: int) -> torch.Tensor:
        """The first n token indices of every sequence, [N * n] on the device, -1 past a
        sequence's end (made once per step and n)."""
        if n not in self._heads:
            first = (self.cu[:-1, None] + torch.arange(n, device=self.cu.device)).flatten()
            self._heads[n] = torch.where(first < self.cu[1:].repeat_interleave(n), first, -1)
        return self._heads[n]


def make_plan(q_lens: list[int], cu_q: torch.Tensor, has_init: bool, keep: bool) -> LinearPlan:
    """The plan of a step with query lengths ``q_lens`` (host) and ``cu_q`` ([N + 1] on the device)."""
    bounds = bounds_of(q_lens)
    fla = fla_ops() if cu_q.is_cuda else None
    cu = cu_q.to(torch.int64)
    chunks = None
    if fla is not None:  # built from the host copy, moved once: no sync in any layer
        chunks = fla["chunk_indices"](cu, CHUNK, cu_seqlens_cpu=torch.tensor(bounds, dtype=torch.int64))
    return LinearPlan(bounds, cu, fla, chunks, has_init, keep)


def seq_of_tokens(cu: torch.Tensor, t: int) -> torch.Tensor:
    """Each of a step's t tokens' sequence index, int32 [t], from cu [N + 1] (on cu's device, no sync)."""
    return torch.searchsorted(cu[1:], torch.arange(t, device=cu.device, dtype=cu.dtype), right=True).to(torch.int32)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, plan: LinearPlan, initial: torch.Tensor | None,
                  final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SiLU(causal depthwise conv) of x [T, D] (may be a column slice of a wider tensor)
    with weight [D, W]; initial [N, D, W] (None: zeros). Returns (y [T, D] contiguous, end
    states [N, D, W] in x's dtype or None)."""
    if plan.fla is not None:
        y, end = plan.fla["conv"](x.unsqueeze(0), weight, initial_state=initial, output_final_state=final,
                                  activation="silu", cu_seqlens=plan.cu, chunk_indices=plan.chunk_indices)
        return y.squeeze(0), end
    return causal_conv1d_torch(x, weight, plan.bounds, initial, final)


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, bounds: list[int], initial: torch.Tensor | None,
                        final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path of ``causal_conv1d`` (float32 sums, one rounding); ``bounds``: host [N + 1]."""
    t, d = x.shape
    w = weight.shape[1]
    wf = weight.float().t()  # [W, D]: tap j multiplies the input j - (W - 1) steps back
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    ends = torch.empty(len(bounds) - 1, d, w, dtype=x.dtype, device=x.device) if final else None
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        prev = initial[n].t() if initial is not None else x.new_zeros(w, d)  # [W, D], last row newest
        xx = torch.cat([prev.to(x.dtype), x[a:b]]).float()  # [W + L, D]
        acc = sum(xx[1 + j:1 + j + b - a] * wf[j] for j in range(w))  # [L, D]
        y[a:b] = F.silu(acc).to(x.dtype)
        if ends is not None:
            ends[n] = xx[-w:].t().to(x.dtype)
    return y, ends


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     plan: LinearPlan, initial: torch.Tensor | None, final: bool,
                     qk_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o [T, HV, V] (v's dtype) of the gated delta rule with L2-normed q, k [T, H, K] (normed
    here unless ``qk_normed``), values v [T, HV, V], log decays g [T, HV] (float32, <= 0),
    betas [T, HV]; initial [N, HV, K, V] float32 (None: zeros). Returns (o, end states
    [N, HV, K, V] float32 or None)."""
    if plan.fla is not None:
        o, end = plan.fla["rule"](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                                  scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=final,
                                  use_qk_l2norm_in_kernel=not qk_normed, cu_seqlens=plan.cu,
                                  chunk_indices=plan.chunk_indices)
        return o.squeeze(0), end
    return gated_delta_rule_torch(q, k, v, g, beta, plan.bounds, initial, final, qk_normed=qk_normed)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (fla-core's l2norm; float32 in, float32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _normed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x L2-normed over its last dim, in ``dtype`` (as ``linear_prep`` hands q and k to the rule)."""
    return _l2norm(x.float()).to(dtype)


def linear_prep(y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                nk: int, dk: int, nv: int,
                dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the rule reads, from the convolution's output y [T, 2 nk dk + nv dv] (q | k | v)
    and the gate inputs b, a [T, nv] (may be strided): q, k [T, nk, dk] L2-normed per head
    (float32 sums, rounded once to y's dtype, as fla-core's own norm does), v [T, nv, dv], each
    a contiguous tensor of its own; beta = sigmoid(b) in b's dtype; g = -exp(A_log)
    softplus(a + dt_bias) [T, nv] float32. A stage of ``FusedOps`` (compiled: one or two passes)."""
    t, kd = y.shape[0], nk * dk
    q = _normed(y[:, :kd].reshape(t, nk, dk), y.dtype)
    k = _normed(y[:, kd:2 * kd].reshape(t, nk, dk), y.dtype)
    v = y[:, 2 * kd:].reshape(t, nv, dv).clone(memory_format=torch.contiguous_format)
    beta = torch.sigmoid(b.float()).to(b.dtype)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, v, beta, g


def gated_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           bounds: list[int], initial: torch.Tensor | None, final: bool,
                           chunk: int = CHUNK, qk_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path of ``gated_delta_rule`` (float32; ``bounds``: host [N + 1] sequence ends)."""
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // k.shape[1]
    norm = (lambda x: x) if qk_normed else _l2norm
    # [HV, T, K] float32 heads-first; GVA: each q/k head serves ``rep`` consecutive value heads
    qf = (norm(q.float()) * q.shape[-1] ** -0.5).repeat_interleave(rep, 1).transpose(0, 1)
    kf = norm(k.float()).repeat_interleave(rep, 1).transpose(0, 1)
    vf, gf, bf = v.float().transpose(0, 1), g.float().t(), beta.float().t()  # [HV, T, V], [HV, T], [HV, T]
    o = torch.empty(hv, q.shape[0], dv, dtype=torch.float32, device=q.device)
    n = len(bounds) - 1
    ends = torch.empty(n, hv, kf.shape[-1], dv, dtype=torch.float32, device=q.device) if final else None
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        s = initial[i].float() if initial is not None else vf.new_zeros(hv, kf.shape[-1], dv)
        o[:, a:b], s = _one_sequence(qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b], s, chunk)
        if ends is not None:
            ends[i] = s
    return o.transpose(0, 1).to(v.dtype), ends


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  s: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads-first float32: q, k [H, L, K], v [H, L, V], g, beta [H, L], state
    s [H, K, V]. Returns (o [H, L, V], end state).

    Chunks of c tokens. Within a chunk with cumulative log decay G (G_i = g_1 + ... + g_i)
    and start state S0, the updates u solve the unit lower-triangular system
    ``(I + A) u = beta v - beta exp(G) K S0`` with ``A[i, j] = beta_i exp(G_i - G_j) k_i.k_j``
    (j < i), so ``u = U - W S0`` for ``U = (I + A)^-1 beta v``, ``W = (I + A)^-1 beta exp(G) K``
    (both solved for every chunk at once); then ``o = exp(G) Q S0 + (exp(G_i - G_j) q_i.k_j)_{j<=i} u``
    and ``S_end = exp(G_c) S0 + (exp(G_c - G) K)^T u``, chunk after chunk."""
    h, ln, dk = k.shape
    pad = (-ln) % c
    if pad:  # zero keys, values and decays after the end: the state passes through them unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (ln + pad) // c
    q, k, v = (x.reshape(h, m, c, -1) for x in (q, k, v))  # [H, M, C, .]
    gc = g.reshape(h, m, c).cumsum(-1)  # [H, M, C] cumulative log decay within each chunk
    bt = beta.reshape(h, m, c, 1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i (else 0; masked before exp so nothing overflows)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, M, C, C]
    a = (bt * k) @ k.transpose(-1, -2) * decay  # diagonal ignored by the unit-triangular solve
    u0 = torch.linalg.solve_triangular(a, bt * v, upper=False, unitriangular=True)  # [H, M, C, V]
    w0 = torch.linalg.solve_triangular(a, bt * gc.exp()[..., None] * k, upper=False, unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay  # [H, M, C, C]
    q_in = q * gc.exp()[..., None]  # reads the chunk's start state
    k_out = k * (gc[..., -1:] - gc).exp()[..., None]  # writes into its end state
    o = torch.empty_like(v)
    for i in range(m):
        u = u0[:, i] - w0[:, i] @ s  # [H, C, V]
        o[:, i] = q_in[:, i] @ s + attn[:, i] @ u
        s = s * gc[:, i, -1].exp()[:, None, None] + k_out[:, i].transpose(-1, -2) @ u
    return o.reshape(h, m * c, -1)[:, :ln], s


def check_fla(nk: int, nv: int, dk: int, dv: int, conv_dim: int, kernel: int, device: torch.device,
              dtype: torch.dtype) -> bool:
    """Start-up check on CUDA (it also runs fla-core's autotuning at the model's shapes on a
    serving-size step, for its kernels with and without initial and end states, before the
    first request): its convolution and rule against the torch path on a small varlen step
    with initial and end states, the rule as the layer calls it (q and k normed beforehand).
    A failure or mismatch switches fla-core off for the process (the torch path is correct,
    only slower). Returns whether fla-core is used."""
    if device.type != "cuda" or fla_ops() is None:
        return False
    lens = [70, 5]
    t, n = sum(lens), len(lens)
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    try:
        # fla-core's autotuner keys its kernels on head counts, dims and which optional tensors
        # (initial state, end state) are given, not on the token count: each variant keeps the
        # configs its first call picks. So every variant's first call is a step of serving size
        # (two 4096-token sequences), then a small step checks correctness.
        big = [4096, 4096]
        tb, bplan = sum(big), make_plan(big, torch.tensor(bounds_of(big), device=device), True, True)
        xb, wb, cb = rnd(tb, conv_dim).to(dtype), rnd(conv_dim, kernel).to(dtype), rnd(2, conv_dim, kernel).to(dtype)
        qb, kb, vb = _normed(rnd(tb, nk, dk), dtype), _normed(rnd(tb, nk, dk), dtype), rnd(tb, nv, dv).to(dtype)
        gb, bb, sb = -F.softplus(rnd(tb, nv)), torch.sigmoid(rnd(tb, nv)).to(dtype), rnd(2, nv, dk, dv)
        for init, final in ((True, True), (False, False), (False, True), (True, False)):
            causal_conv1d(xb, wb, bplan, cb if init else None, final)
            gated_delta_rule(qb, kb, vb, gb, bb, bplan, sb if init else None, final, qk_normed=True)
        del xb, qb, kb, vb
        plan = make_plan(lens, torch.tensor(bounds_of(lens), device=device), True, True)
        x, weight, c0 = rnd(t, conv_dim).to(dtype), rnd(conv_dim, kernel).to(dtype), rnd(n, conv_dim, kernel).to(dtype)
        q, k, v = _normed(rnd(t, nk, dk), dtype), _normed(rnd(t, nk, dk), dtype), rnd(t, nv, dv).to(dtype)
        g, beta, s0 = -F.softplus(rnd(t, nv)), torch.sigmoid(rnd(t, nv)).to(dtype), rnd(n, nv, dk, dv)
        pairs = [(causal_conv1d(x, weight, plan, c0, True), causal_conv1d_torch(x, weight, plan.bounds, c0, True)),
                 (gated_delta_rule(q, k, v, g, beta, plan, s0, True, qk_normed=True),
                  gated_delta_rule_torch(q, k, v, g, beta, plan.bounds, s0, True, qk_normed=True))]
        for got, ref in pairs:
            for a, b in zip(got, ref):
                err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()
                if not err < 5e-2:  # a sanity bound (a broken kernel is off by O(1)), not precision
                    raise RuntimeError(f"relative error {err:.3g} against the torch path")
    except Exception as e:
        log.warning("fla-core failed its start-up check (%s: %s); Gated DeltaNet layers run the torch path",
                    type(e).__name__, e)
        _FLA["ok"] = None
        return False
    return True


def bounds_of(lens: list[int]) -> list[int]:
    """Cumulative ends [0, l0, l0 + l1, ...] of packed lengths."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out
