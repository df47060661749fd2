"""Activations to FP8 (e4m3) in one pass over each row, on CUDA with Triton: the row is read
once, its scale(s) computed, and the FP8 values and scales written; the activation itself may
be produced in the same pass, so it is never written in bf16 and read back:

- ``plain``: x [T, K] as it is;
- ``norm``: RMSNorm of x (optionally of ``x + delta``, the residual stream, which is then
  written too), rounded as ``ops.norm`` rounds (the sum in the activation dtype, the norm in
  float32, a bf16/fp16 weight applied after rounding, a float32 weight before it);
- ``silu``: ``silu(gate) * up`` of a gate/up product [T, 2I], rounded as
  ``ops.silu_mul.silu_mul_reference`` (silu rounded, then the product rounded).

Scales (``ops.fp8`` documents the layouts): per row (``row``: amax / 448 over the row),
per 1x128 group (``group``: written M-major, as cuBLAS reads them; ``group_pow2``: each rounded
up to a power of two), or one given float32 scale (``tensor``). The quantization itself matches
``ops.fp8``'s torch references bit for bit: correctly rounded divisions (``div_rn``), a clamp to
+-448 and round-to-nearest-even to e4m3.
What may differ is the norm's sum of squares (another summation order).

Plain rows up to ``CHUNKED_K`` wide and the norm: one program per row holds the whole row in
registers (``BLOCK`` the next power of two of K), so K is at most ``MAX_K``. SiLU-mul and wider
plain rows: one program per row walks it in ``CHUNK``-wide steps (``quant_chunks``); SiLU-mul
per row: each gate/up row read once (``ops.fp8_silu_rows``). Group
scales and codes are written into buffers padded to ``padded_rows(T)`` rows (cuBLAS's 1x128
recipe takes M a multiple of 4 only). ``quantize`` returns None where the kernel does not apply
(no Triton, not CUDA, a dtype or width it does not take) and the caller takes the reference.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import logging
from typing import Any

import torch

from teacher_server.ops import fp8_silu_rows
from teacher_server.ops.guarded import FirstLaunch

log = logging.getLogger(__name__)

MAX_K = 32768  # the widest row one program holds (Qwen3-32B's intermediate 25600 rounds up to it)
PRODUCERS = {"plain": 0, "norm": 1, "silu": 2}
# rows wider than this are walked in CHUNK-wide steps (``quant_chunks``), as SiLU-mul's always are:
# one program holding a whole 12288- or 25600-wide row in registers fits one program per SM, whose
# loads then wait on its arithmetic (SiLU-mul measured 0.93 TB/s that way on an H200)
CHUNKED_K = 8192
CHUNK = 2048
MODES = {"row": 0, "group": 1, "tensor": 2, "group_pow2": 3}
_K: dict[str, Any] = {}
pow2_ceil: Any = None  # a scale rounded up to a power of two (``ops.fp8.pow2_ceil``'s bits), set by ``_kernels``
language: Any = None  # triton.language, where Triton's interpreter looks for it (a jit function's module globals)
# keyed (chunked or "one_read", producer, mode, K, dtype): a key whose first launch failed goes to
# the reference (one_read's: to the two-pass kernel)
LAUNCHES = FirstLaunch("FP8 quantization kernel")


def _kernels() -> dict[str, Any]:
    """The kernel, compiled on first use ({"missing": True} without Triton)."""
    if _K:
        return _K
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
    except Exception as e:  # the CPU wheel has no triton: the torch references run instead
        log.info("FP8 activation kernels unavailable: %s: %s", type(e).__name__, e)
        _K["missing"] = True
        return _K

    global pow2_ceil, language
    language = tl

    @triton.jit
    def pow2_ceil(s):  # s positive, finite, normal: its exponent, one up where any mantissa bit is set (NaN kept)
        b = s.to(tl.int32, bitcast=True)
        p = ((((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
        return tl.where(s != s, s, p)

    # T (the step's tokens) differs from step to step: not specialised on. Rows T..R-1 (R the
    # grid) are the padding of a group layout: read as zeros, written as zero codes.
    @triton.jit(do_not_specialize=["T", "ST"])
    def quant_rows(x_ptr, sx, d_ptr, sd, s_ptr, ss, w_ptr, q_ptr, sq, scale_ptr, T, ST, K, eps, fp8_max,
                   amax_floor, PRODUCER: tl.constexpr, HAS_DELTA: tl.constexpr, W_F32: tl.constexpr,
                   MODE: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < K
        ml = m & (row < T)
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=ml, other=0.0)
        if PRODUCER == 1:
            if HAS_DELTA:  # the residual stream: rounded to the activation dtype, and kept
                d = tl.load(d_ptr + row * sd + cols, mask=ml, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(dt)
                tl.store(s_ptr + row * ss + cols, x, mask=ml)
            xf = x.to(tl.float32)
            r = libdevice.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
            if W_F32:  # a weight in another dtype (float32: the zero-centred norm): scaled in float32, rounded once
                y = (xf * r * w).to(dt).to(tl.float32)
            else:  # rounded, then the weight in the activation dtype
                y = (w * (xf * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:
            y = x.to(tl.float32)
        if MODE == 0:  # one scale per row
            scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor), fp8_max)
            q = tl.div_rn(y, scale)
            tl.store(scale_ptr + row, scale)
        elif MODE == 1 or MODE == 3:  # one scale per GROUP columns, M-major: group g of row t at g * ST + t
            yg = tl.reshape(y, (BLOCK // GROUP, GROUP))
            scale = tl.div_rn(tl.maximum(tl.max(tl.abs(yg), axis=1), amax_floor), fp8_max)
            if MODE == 3:  # a power of two
                scale = pow2_ceil(scale)
            q = tl.reshape(tl.div_rn(yg, scale[:, None]), (BLOCK,))
            gi = tl.arange(0, BLOCK // GROUP)
            tl.store(scale_ptr + gi.to(tl.int64) * ST + row, scale, mask=gi * GROUP < K)
        else:  # the given scale
            q = tl.div_rn(y, tl.load(scale_ptr))
        q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
        tl.store(q_ptr + row * sq + cols, q.to(tl.float8e4nv), mask=m)

    # A row walked in CHUNK-wide steps (a few registers per thread, so many programs per SM keep
    # loads in flight): SiLU-mul's rows, and plain rows wider than ``CHUNKED_K``. Per row (MODE 0)
    # it takes two passes, the amax, then the codes (the row read again, mostly from L2, and its
    # values recomputed: the same bits); per group (1) and with a given scale (2), one.
    # (K, a layer's width, is a compile-time constant: the loop's trip count and the tail's mask)
    @triton.jit(do_not_specialize=["T", "ST"])
    def quant_chunks(x_ptr, sx, q_ptr, sq, scale_ptr, T, ST, K: tl.constexpr, fp8_max, amax_floor,
                     SILU: tl.constexpr, MODE: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        live = row < T
        cols = tl.arange(0, CHUNK)
        xrow = x_ptr + row * sx
        dt = x_ptr.dtype.element_ty
        if MODE == 0:
            amax = tl.zeros((CHUNK,), dtype=tl.float32)
            for c in range(0, K, CHUNK):
                ml = (c + cols < K) & live
                if SILU:  # silu(gate) * up: gate the first K columns, up the next K
                    g = tl.load(xrow + c + cols, mask=ml, other=0.0).to(tl.float32)
                    u = tl.load(xrow + K + c + cols, mask=ml, other=0.0).to(tl.float32)
                    a = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
                    # the product of two 16-bit values is exact in float32; rounding is monotonic,
                    # so the largest rounded product is the largest product rounded (after the loop)
                    amax = tl.maximum(amax, tl.abs(a * u))
                else:
                    amax = tl.maximum(amax, tl.abs(tl.load(xrow + c + cols, mask=ml, other=0.0).to(tl.float32)))
            top = tl.max(amax, axis=0)
            if SILU:
                top = top.to(dt).to(tl.float32)
            scale = tl.div_rn(tl.maximum(top, amax_floor), fp8_max)
            tl.store(scale_ptr + row, scale)
        elif MODE == 2:
            scale = tl.load(scale_ptr)
        nc: tl.constexpr = (K + CHUNK - 1) // CHUNK
        for i in range(nc):
            # per row the second pass goes backwards: the chunks read last are the likeliest in L2
            c = (nc - 1 - i) * CHUNK if MODE == 0 else i * CHUNK
            m = c + cols < K
            ml = m & live
            if SILU:
                g = tl.load(xrow + c + cols, mask=ml, other=0.0).to(tl.float32)
                u = tl.load(xrow + K + c + cols, mask=ml, other=0.0).to(tl.float32)
                a = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
                y = (a * u).to(dt).to(tl.float32)
            else:
                y = tl.load(xrow + c + cols, mask=ml, other=0.0).to(tl.float32)
            if MODE == 1 or MODE == 3:
                yg = tl.reshape(y, (CHUNK // GROUP, GROUP))
                s = tl.div_rn(tl.maximum(tl.max(tl.abs(yg), axis=1), amax_floor), fp8_max)
                if MODE == 3:
                    s = pow2_ceil(s)
                q = tl.reshape(tl.div_rn(yg, s[:, None]), (CHUNK,))
                gi = c // GROUP + tl.arange(0, CHUNK // GROUP)
                tl.store(scale_ptr + gi.to(tl.int64) * ST + row, s, mask=gi * GROUP < K)
            else:
                q = tl.div_rn(y, scale)
            q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
            tl.store(q_ptr + row * sq + c + cols, q.to(tl.float8e4nv), mask=m)

    _K.update(quant_rows=quant_rows, quant_chunks=quant_chunks, next_pow2=triton.next_power_of_2)
    return _K


def fail(chunked: bool, producer: str, mode: str, k: int, dtype: torch.dtype) -> None:
    """Leave that kernel's calls to the torch reference from now on (its start-up check failed)."""
    LAUNCHES.fail((chunked, producer, mode, k, dtype))


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def padded_rows(t: int) -> int:
    """The rows a 1x128 group layout is allocated with: cuBLASLt's 1x128 recipe takes M (the
    tokens) a multiple of 4 only (cuBLAS docs, "128-element 1D and 128x128 2D block scaling":
    M and N multiples of 4, scale starts 16-byte aligned), so the codes [T, K] and the M-major
    scales (strides (1, round_up(T, 4))) are views of buffers with zero rows up to it, which
    ``ops.fp8_mm.scaled_linear`` hands to cuBLAS without a copy."""
    return -(-t // 4) * 4


def group_buffers(t: int, k: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [T, K], scales [T, K/group] strides (1, R)) views of [R, K] / [K/group, R] buffers,
    R = ``padded_rows(T)``."""
    r = padded_rows(t)
    xq = torch.empty(r, k, device=device, dtype=torch.float8_e4m3fn)
    sc = torch.empty(k // group, r, device=device, dtype=torch.float32)
    return xq[:t], sc.t()[:t]


def applies(x: torch.Tensor, k: int) -> bool:
    """Does the kernel take rows of x (CUDA bf16/fp16, unit column stride) of width k."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.stride(1) == 1
            and 0 < k <= MAX_K and "quant_rows" in _kernels())


def quantize(x: torch.Tensor, mode: str, producer: str = "plain", *, fp8_max: float, amax_floor: float,
             group: int = 128, weight: torch.Tensor | None = None, eps: float = 0.0,
             delta: torch.Tensor | None = None, scale: torch.Tensor | None = None, one_read: bool = True,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(xq [T, K] e4m3, scale, residual or None) of ``producer`` applied to x, or None where the
    kernel does not apply. ``mode``: ``row`` (scale [T, 1]), ``group`` (scale [T, K / group]
    M-major, strides (1, R), R = ``padded_rows(T)``: xq and the scales are views of buffers of
    R rows, the rows past T zeros), ``tensor`` (``scale`` given, float32, one element; returned
    as is). ``norm`` takes ``weight`` [K] and ``eps`` (and ``delta``: x + delta is normed and
    returned as the residual); ``silu`` takes x = [T, 2K]. ``one_read``: False takes SiLU-mul per
    row to the two-pass kernel (``fp8_silu_rows.ONE_READ`` off: always)."""
    t = x.shape[0]
    k = x.shape[1] // 2 if producer == "silu" else x.shape[1]
    if not applies(x, k) or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1
                                                     or delta.dtype != x.dtype)):
        return None
    if producer == "norm" and (weight is None or weight.numel() != k or not weight.is_contiguous()
                               or weight.device != x.device):
        return None
    kern = _kernels()
    block = kern["next_pow2"](k)
    grouped = mode in ("group", "group_pow2")
    if grouped and (k % group or block < group):
        return None
    dev = x.device
    resid = torch.empty_like(x) if delta is not None else None
    rows = t
    if mode == "row":
        xq = torch.empty(t, k, device=dev, dtype=torch.float8_e4m3fn)
        sc = torch.empty(t, 1, device=dev, dtype=torch.float32)
    elif grouped:
        xq, sc = group_buffers(t, k, group, dev)
        rows = padded_rows(t)  # the padding rows are written too (zeros)
    else:
        assert scale is not None and scale.numel() == 1 and scale.dtype == torch.float32, \
            f"tensor mode takes one float32 scale, got {None if scale is None else (scale.shape, scale.dtype)}"
        xq = torch.empty(t, k, device=dev, dtype=torch.float8_e4m3fn)
        sc = scale
    if rows == 0:
        return xq, sc, resid
    st = padded_rows(t)  # the group scales' column stride
    # (where the one-read kernel's first launch fails, the two-pass kernel runs)
    if producer == "silu" and mode == "row" and one_read and fp8_silu_rows.run(x, xq, sc, k, fp8_max, amax_floor,
                                                                                  LAUNCHES):
        return xq, sc, resid
    chunked = producer == "silu" or (producer == "plain" and block > CHUNKED_K)
    key = (chunked, producer, mode, k, x.dtype)
    if not LAUNCHES.usable(key):
        return None
    chunk = min(CHUNK, block)
    w = weight if weight is not None else x  # unused unless producer == "norm"
    d = delta if delta is not None else x
    s = resid if resid is not None else x

    def launch() -> None:
        if chunked:
            kern["quant_chunks"][(rows,)](
                x, x.stride(0), xq, xq.stride(0), sc, t, st, k, float(fp8_max), float(amax_floor),
                SILU=producer == "silu", MODE=MODES[mode], CHUNK=chunk, GROUP=group,
                num_warps=8 if chunk >= 2048 else 4)
        else:
            kern["quant_rows"][(rows,)](
                x, x.stride(0), d, d.stride(0), s, s.stride(0), w, xq, xq.stride(0), sc, t, st, k, float(eps),
                float(fp8_max), float(amax_floor), PRODUCER=PRODUCERS[producer], HAS_DELTA=delta is not None,
                W_F32=weight is not None and weight.dtype != x.dtype, MODE=MODES[mode], BLOCK=block, GROUP=group,
                num_warps=_warps(block))
    # a kernel that does not compile here: the torch reference takes its calls
    return (xq, sc, resid) if LAUNCHES.run(launch, key) else None
