"""The Gated DeltaNet layers' input stage on CUDA in one Triton pass: the causal depthwise
convolution + SiLU over the in-projection's q | k | v columns (read in place, strided), the
per-head L2 norm of q and k, q, k and v written as contiguous tensors of their own, and both
gates. It replaces fla-core's convolution (a pass that writes the convolution's output) and
the compiled stage that then reads it back (``ops.gated_delta.linear_prep``): the columns
are read once and q, k, v written once.

Numerics as the two passes it replaces: float32 sums, the convolution's output rounded to
the input's dtype after SiLU, then q and k normed in float32 (``x / sqrt(sum(x^2) + 1e-6)``)
and rounded once; beta = sigmoid(b) in b's dtype; g = -exp(A_log) softplus(a + dt_bias)
float32. A sequence's end state (its last W inputs, ``[N, D, W]``, entry W - 1 the newest)
comes from a second, small kernel. Triton is imported on first use; ``check_conv_prep`` is
the start-up check against the two-pass path.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from teacher_server.ops.gated_delta import LinearPlan

_K: dict[str, Any] = {}
# q, k, v, beta, g, end states (None unless asked for)
Prepped = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
BLOCK_T = 32  # tokens per program (one head of channels each)


def _kernels() -> dict[str, Any]:
    if _K:
        return _K
    import triton
    import triton.language as tl

    # T (tokens, or listed tokens) differs from step to step: not specialised on (no compile
    # for a new remainder mod 16 in the middle of serving)
    @triton.jit(do_not_specialize=["T"])
    def conv_heads(x_ptr, sx, w_ptr, seq_ptr, start_ptr, init_ptr, si_n, si_c, tok_ptr, out_ptr, T, c_base,
                   b_ptr, a_ptr, sab, alog_ptr, dtb_ptr, beta_ptr, g_ptr, nv,
                   W: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, HAS_INIT: tl.constexpr,
                   NORM: tl.constexpr, GATES: tl.constexpr):
        # program (token block, head): out[t, head, :] for the head's D channels of x. HAS_INIT:
        # the tokens are the T listed at tok_ptr (-1: none), and taps before a sequence's start
        # read its stored state; else tokens 0..T-1, and those taps read zeros
        pid_t, h = tl.program_id(0), tl.program_id(1)
        heads = tl.num_programs(1)
        i = pid_t * BT + tl.arange(0, BT)
        if HAS_INIT:
            t = tl.load(tok_ptr + i, mask=i < T, other=-1)
            tm = t >= 0
            t = tl.maximum(t, 0)
        else:
            t = i
            tm = i < T
        d = tl.arange(0, D)
        c = c_base + h * D + d  # the head's channels among the convolution's
        seq = tl.load(seq_ptr + t, mask=tm, other=0)
        st = tl.load(start_ptr + seq, mask=tm, other=0)
        acc = tl.zeros((BT, D), dtype=tl.float32)
        for j in tl.static_range(W):  # tap j reads the input W - 1 - j tokens back
            src = t - (W - 1 - j)
            mine = src >= st  # in this step's rows of the sequence; else its stored state
            xv = tl.load(x_ptr + src[:, None].to(tl.int64) * sx + c[None, :], mask=(tm & mine)[:, None],
                         other=0.0).to(tl.float32)
            if HAS_INIT:
                idx = W - (st - src)
                iv = tl.load(init_ptr + seq[:, None].to(tl.int64) * si_n + c[None, :] * si_c + idx[:, None],
                             mask=(tm & (src < st))[:, None], other=0.0).to(tl.float32)
                xv += iv
            wj = tl.load(w_ptr + c * W + j).to(tl.float32)
            acc += xv * wj[None, :]
        y = acc * tl.sigmoid(acc)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the convolution's output, rounded
        if NORM:
            y = y * tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)[:, None]
        row = t.to(tl.int64) * (heads * D)
        tl.store(out_ptr + row[:, None] + h * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=tm[:, None])
        if GATES:  # value head h: its beta and log decay for these tokens
            bv = tl.load(b_ptr + t.to(tl.int64) * sab + h, mask=tm, other=0.0)
            tl.store(beta_ptr + t.to(tl.int64) * nv + h, tl.sigmoid(bv.to(tl.float32)).to(bv.dtype), mask=tm)
            av = tl.load(a_ptr + t.to(tl.int64) * sab + h, mask=tm, other=0.0).to(tl.float32)
            av += tl.load(dtb_ptr + h).to(tl.float32)
            sp = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(tl.minimum(av, 20.0))))
            g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
            tl.store(g_ptr + t.to(tl.int64) * nv + h, g, mask=tm)

    @triton.jit
    def conv_end(x_ptr, sx, start_ptr, init_ptr, si_n, si_c, end_ptr, C,
                 W: tl.constexpr, BC: tl.constexpr, HAS_INIT: tl.constexpr):
        # program (sequence, channel block): its end state [C, W], entry W - 1 the last input
        n, pid_c = tl.program_id(0), tl.program_id(1)
        c = pid_c * BC + tl.arange(0, BC)
        cm = c < C
        st = tl.load(start_ptr + n)
        en = tl.load(start_ptr + n + 1)
        for w in tl.static_range(W):
            src = en - (W - w)
            if src >= st:
                v = tl.load(x_ptr + src.to(tl.int64) * sx + c, mask=cm, other=0.0)
            else:
                if HAS_INIT:
                    v = tl.load(init_ptr + n.to(tl.int64) * si_n + c * si_c + (W - (st - src)), mask=cm, other=0.0)
                else:
                    v = tl.zeros((BC,), dtype=end_ptr.dtype.element_ty)
            tl.store(end_ptr + n.to(tl.int64) * C * W + c * W + w, v.to(end_ptr.dtype.element_ty), mask=cm)

    _K.update(conv_heads=conv_heads, conv_end=conv_end, triton=triton)
    return _K


def conv_prep(x: torch.Tensor, weight: torch.Tensor, plan: LinearPlan, initial: torch.Tensor | None, final: bool,
              b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, nk: int, dk: int, nv: int,
              dv: int, block_t: int = BLOCK_T) -> Prepped:
    """x [T, 2 nk dk + nv dv] (q | k | v columns; rows may be strided, columns contiguous),
    weight [D, W] contiguous, ``plan`` the step's (``gated_delta.make_plan``), initial [N, D, W]
    (None: zeros), b, a [T, nv] (rows strided alike).
    Returns (q, k [T, nk, dk] normed, v [T, nv, dv], beta [T, nv], g [T, nv] float32, end
    states [N, D, W] or None), as ``causal_conv1d`` then ``linear_prep``. ``block_t``: tokens
    per program (a power of two)."""
    k_ = _kernels()
    t, dim = x.shape
    w = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and b.stride(1) == 1 and a.stride(1) == 1
    assert b.stride(0) == a.stride(0)
    cu = plan.cu
    has_init = initial is not None
    if has_init:
        assert initial.stride(2) == 1
        si_n, si_c = initial.stride(0), initial.stride(1)
    else:
        initial, si_n, si_c = x, 0, 0  # not read
    q = torch.empty(t, nk, dk, dtype=x.dtype, device=x.device)
    kk = torch.empty(t, nk, dk, dtype=x.dtype, device=x.device)
    v = torch.empty(t, nv, dv, dtype=x.dtype, device=x.device)
    beta = torch.empty(t, nv, dtype=b.dtype, device=x.device)
    g = torch.empty(t, nv, dtype=torch.float32, device=x.device)
    # Every token with zeros before its sequence's start, then (with stored states) the first
    # W - 1 tokens of each sequence again, reading the states: the pass over all tokens does
    # not carry the state's gather (it costs the whole pass twice its time on the H200).
    passes = [(plan.seq_of, t, False, block_t)] if t else []  # (token list: not read by this pass, ...)
    if has_init and t:
        first = plan.heads(w - 1)
        passes.append((first, first.shape[0], True, 16))
    for tok, count, init_pass, bt in passes:
        blocks = k_["triton"].cdiv(count, bt)
        for out, base, heads, hd, norm in ((q, 0, nk, dk, True), (kk, nk * dk, nk, dk, True),
                                           (v, 2 * nk * dk, nv, dv, False)):
            k_["conv_heads"][(blocks, heads)](x, x.stride(0), weight, plan.seq_of, cu, initial, si_n, si_c, tok, out,
                                              count, base, b, a, b.stride(0), a_log, dt_bias, beta, g, nv, W=w,
                                              D=hd, BT=bt, HAS_INIT=init_pass, NORM=norm, GATES=not norm,
                                              num_warps=4)
    end = None
    if final:
        n = cu.shape[0] - 1
        end = torch.empty(n, dim, w, dtype=x.dtype, device=x.device)
        if n:
            bc = 256
            k_["conv_end"][(n, k_["triton"].cdiv(dim, bc))](x, x.stride(0), cu, initial, si_n, si_c, end, dim,
                                                            W=w, BC=bc, HAS_INIT=has_init, num_warps=4)
    return q, kk, v, beta, g, end


def conv_prep_reference(x: torch.Tensor, weight: torch.Tensor, bounds: list[int], initial: torch.Tensor | None,
                        final: bool, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                        nk: int, dk: int, nv: int, dv: int) -> Prepped:
    """The same from the torch paths of the two passes it replaces (``bounds``: host [N + 1])."""
    from teacher_server.ops.gated_delta import causal_conv1d_torch, linear_prep

    y, end = causal_conv1d_torch(x, weight, bounds, initial, final)
    return (*linear_prep(y, b, a, a_log, dt_bias, nk, dk, nv, dv), end)


def random_inputs(lens: list[int], nk: int, dk: int, nv: int, dv: int, w: int, dtype: torch.dtype,
                  device: torch.device, init: bool, seed: int = 0) -> tuple:
    """Random inputs as the layer hands them over: x, b, a strided views into one in-projection
    row (q | k | v | z | b | a), the convolution weight, A_log, dt_bias and (``init``) stored
    states [N, D, W]. Returns (x, weight, initial, b, a, a_log, dt_bias)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    t, dim = sum(lens), 2 * nk * dk + nv * dv
    wide = rnd(t, dim + nv * dv + 2 * nv).to(dtype)
    x, b, a = wide[:, :dim], wide[:, dim + nv * dv:dim + nv * dv + nv], wide[:, dim + nv * dv + nv:]
    weight, a_log, dt_bias = rnd(dim, w).to(dtype), rnd(nv).to(dtype), rnd(nv).to(dtype)
    initial = rnd(len(lens), dim, w).to(dtype) if init else None
    return x, weight, initial, b, a, a_log, dt_bias


def check_conv_prep(nk: int, dk: int, nv: int, dv: int, kernel: int, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Start-up check at the model's shapes: a small varlen step (sequences shorter than the
    kernel, ones starting from stored states, strided inputs) against the torch path. Raises
    on a mismatch."""
    from teacher_server.ops.checks import assert_close
    from teacher_server.ops.gated_delta import bounds_of, make_plan

    lens = [70, 1, 2, 37, 5]
    bounds = bounds_of(lens)
    for init in (False, True):
        x, weight, initial, b, a, a_log, dt_bias = random_inputs(lens, nk, dk, nv, dv, kernel, dtype, device, init)
        plan = make_plan(lens, torch.tensor(bounds, device=device), init, True)
        got = conv_prep(x, weight, plan, initial, True, b, a, a_log, dt_bias, nk, dk, nv, dv)
        ref = conv_prep_reference(x, weight, bounds, initial, True, b, a, a_log, dt_bias, nk, dk, nv, dv)
        for name, gv, rv in zip(("q", "k", "v", "beta", "g", "end"), got, ref):
            assert_close(f"conv_prep {name}", gv, rv)
