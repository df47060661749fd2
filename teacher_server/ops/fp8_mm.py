"""The FP8 matrix multiplies and the weight side of the format: torch's scaled multiplies for
tensor-, row- and 128x128-block weight scales (``scaled_linear``; the block one as cuBLASLt
takes it in ``ops.fp8_block``), the experts' grouped multiply (``grouped_scaled_linear``:
``ops.fp8_grouped``'s Triton kernel with row or block scales, or torch's row-wise kernel),
weight quantization and dequantization, and the float32 references every one of them takes on
the CPU. What torch takes, and the layouts: ``ops.fp8``'s docstring (the API is imported from
there)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from teacher_server.ops import fp8_block, fp8_grouped
from teacher_server.ops.checks import error_stats
from teacher_server.ops.fp8_block import pad_block_scale  # noqa: F401  (the API: ops.fp8)
from teacher_server.ops.grouped_mm import grouped_mm_reference

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# the smallest amax a scale is computed from: a zero row quantizes to zeros with a finite scale
AMAX_FLOOR = 1e-12
BLOCK = 128
MODES = ("tensor", "row", "block")  # weight scales


def to_fp8(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y float32 / scale (broadcast), clamped to the e4m3 range and rounded to nearest even."""
    return (y / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The dequantizing scale of values whose largest magnitude is amax: amax / 448, floored,
    correctly rounded on every device. (On CUDA torch turns a division by a Python number into a
    multiplication by its reciprocal, one ulp off now and then: the divisor is a tensor here.)"""
    a = amax.float().clamp(min=AMAX_FLOOR)
    return a / a.new_full((), FP8_MAX)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= s (positive, finite, normal float32), on the bits, as the
    kernels compute it (``fp8_quant.pow2_ceil``): scales whose ratios are exact (``group_pow2``).
    NaN stays NaN (a NaN activation's scale)."""
    s = s.float().contiguous()
    b = s.view(torch.int32)
    return torch.where(s.isnan(), s, ((((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).int()) << 23).view(torch.float32))


def dequantize(wq: torch.Tensor, wscale: torch.Tensor, mode: str, block: tuple[int, int] = (BLOCK, BLOCK),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """wq [..., N, K] e4m3 and its scales (``ops.fp8``'s layouts) -> the weight in ``dtype``
    (float32 by default: the CPU path and the references). ``block`` is the block's
    (rows, columns) for ``block``; partial edge blocks take their block's scale."""
    w = wq.float()
    s = wscale.float()
    n, k = w.shape[-2:]
    if mode == "tensor":
        s = s.reshape(*w.shape[:-2], 1, 1) if s.numel() > 1 else s.reshape(())
    elif mode == "row":
        s = s.reshape(*w.shape[:-2], n, 1)
    elif mode == "block":
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        s = s[..., :nb, :kb]  # a padded scale (pad_block_scale's buffer): its meaningful columns
        s = s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    else:
        raise ValueError(f"weight scale mode {mode!r}: expected one of {MODES}")
    return (w * s).to(dtype)


def _dequantize_activation(xq: torch.Tensor, xscale: torch.Tensor) -> torch.Tensor:
    """xq [T, K] with a tensor [1], row [T, 1] or group [T, K/g] scale -> float32 [T, K]."""
    x, s = xq.float(), xscale.float()
    if s.numel() == 1:
        return x * s.reshape(())
    if s.shape == (x.shape[0], 1):
        return x * s
    g = x.shape[1] // s.shape[1]
    return x * s.repeat_interleave(g, 1)


def scaled_linear_reference(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                            mode: str, out_dtype: torch.dtype = torch.bfloat16,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized product in float32, rounded to ``out_dtype``: the CPU path and the tests'
    reference."""
    y = _dequantize_activation(xq, xscale) @ dequantize(wq, wscale, mode).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def grouped_scaled_linear_reference(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                                    offs: torch.Tensor, mode: str = "row",
                                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The grouped product of the dequantized operands in float32 (a loop over groups)."""
    x = _dequantize_activation(xq, xscale)
    w = dequantize(wq, wscale, mode)  # [E, N, K]
    return grouped_mm_reference(x, w.transpose(1, 2), offs).to(out_dtype)


def quantize_weight(w: torch.Tensor, mode: str,
                    block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [..., N, K] -> (wq e4m3, scale) in ``mode``'s layout (tensor [1] per matrix, row
    [..., N, 1], block [..., ceil(N/bn), ceil(K/bk)]): what a bf16 checkpoint is quantized to at
    load, and the tests' and benchmark's weights."""
    wf = w.float()
    n, k = wf.shape[-2:]
    lead = wf.shape[:-2]
    if mode == "tensor":
        scale = scale_from_amax(wf.abs().amax((-2, -1), keepdim=True))
        return to_fp8(wf, scale), scale.reshape(*lead, 1, 1) if lead else scale.reshape(1)
    if mode == "row":
        scale = scale_from_amax(wf.abs().amax(-1, keepdim=True))
        return to_fp8(wf, scale), scale
    if mode == "block":
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = F.pad(wf, (0, kb * bk - k, 0, nb * bn - n))  # zeros do not change an amax
        tiles = padded.reshape(*lead, nb, bn, kb, bk)
        scale = scale_from_amax(tiles.abs().amax((-3, -1)))  # [..., nb, kb]
        q = to_fp8(tiles, scale[..., :, None, :, None]).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
        return q.contiguous(), scale
    raise ValueError(f"weight scale mode {mode!r}: expected one of {MODES}")


def block_to_rows(wq: torch.Tensor, wscale: torch.Tensor,
                  block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block weights [..., N, K] requantized with one scale per row, for torch's
    row-wise grouped multiply instead of the block kernel: one more e4m3 rounding per weight."""
    return quantize_weight(dequantize(wq, wscale, "block", block), "row")


# ---------------------------------------------------------------- scaled multiplies


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cc(t: torch.Tensor) -> tuple[int, int]:
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _sm(t: torch.Tensor) -> str:
    return "".join(map(str, _cc(t)))


def _check_mm(xq: torch.Tensor, wq: torch.Tensor) -> tuple[int, int, int]:
    if xq.dtype != FP8 or wq.dtype != FP8:
        raise ValueError(f"scaled_linear takes e4m3 operands, got {xq.dtype} and {wq.dtype}")
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"scaled_linear: x [T, K] and w [N, K], got {tuple(xq.shape)} and {tuple(wq.shape)}")
    t, k = xq.shape
    return t, k, wq.shape[0]


def scaled_linear(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor, mode: str,
                  out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """y [T, N] = (xq * xscale) @ (wq * wscale)^T (+ bias), in ``out_dtype`` (or into ``out``).

    xq [T, K] e4m3 row-major; wq [N, K] e4m3 contiguous; ``mode`` names wscale's layout:
    ``tensor`` [1], ``row`` [N, 1], ``block`` [ceil(N/128), ceil(K/128)] (128x128). xscale:
    [1] or [T, 1] with ``tensor``/``row`` weights (a tensor x row pair is run as row x row);
    [T, K/128] M-major (``quantize_groups``) with ``block``. On CUDA torch's scaled multiply
    (K, N multiples of 16; ``block`` on sm90 only, its rows padded to a multiple of 4 and the
    Triton block kernel where cuBLASLt refuses a shape: ``_block_mm``); on the CPU the float32
    reference. A bias is added before the one rounding to ``out_dtype`` (in the epilogue, or to
    a float32 product), as the reference adds it."""
    t, k, n = _check_mm(xq, wq)
    if mode not in MODES:
        raise ValueError(f"weight scale mode {mode!r}: expected one of {MODES}")
    if not xq.is_cuda:
        y = scaled_linear_reference(xq, xscale, wq, wscale, mode, out_dtype, bias)
        return out.copy_(y) if out is not None else y
    if k % 16 or n % 16:
        raise ValueError(f"torch's scaled matrix multiply needs K and N multiples of 16, got K={k}, N={n}")
    if not wq.is_contiguous() or xq.stride(1) != 1:
        raise ValueError("scaled_linear takes x row-major and a contiguous weight [N, K]")
    # a float32 output takes no bias in the kernel (torch refuses it): added after, in float32
    kbias = bias if bias is not None and out_dtype != torch.float32 else None
    if mode == "block":
        y = _block_mm(xq, xscale, wq, wscale, out_dtype, kbias)
    else:
        sa, sb = xscale.float(), wscale.float()
        if not (sa.numel() == 1 and sb.numel() == 1):  # row x row: expand whichever is per-tensor
            sa = sa.reshape(1, 1).expand(t, 1) if sa.numel() == 1 else sa.reshape(t, 1)
            sb = sb.reshape(1, 1).expand(n, 1) if sb.numel() == 1 else sb.reshape(n, 1)
            sa, sb = sa.contiguous(), sb.contiguous()  # torch takes contiguous row scales only
            sb = sb.t()  # [1, N]
        else:
            sa, sb = sa.reshape(()), sb.reshape(())
        y = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, bias=kbias, out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
    if bias is not None and kbias is None:
        y = y + bias.to(y.dtype)
    return out.copy_(y) if out is not None else y


def _block_mm(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    if _cc(xq)[0] != 9:
        raise NotImplementedError(f"block-wise FP8 (1x128 x 128x128) runs on sm90 only in torch {torch.__version__}; "
                                  f"this GPU is sm{_sm(xq)}")
    y = fp8_block.block_mm(xq, xscale, wq, wscale, out_dtype, bias)
    if y is None:
        log.warning("block-wise FP8 at %d -> %d runs dequantized in float32 (no kernel takes it)", xq.shape[1],
                    wq.shape[0])
        return scaled_linear_reference(xq, xscale, wq, wscale, "block", out_dtype, bias)
    return y


def grouped_scaled_linear(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                          offs: torch.Tensor, mode: str = "row", out_dtype: torch.dtype = torch.bfloat16,
                          fast_accum: bool = False, backend: str = "auto") -> torch.Tensor:
    """The experts' multiply -> [M, N] bf16. xq [M, K] e4m3 with rows sorted by expert, wq
    [E, N, K] e4m3 contiguous, offs [E] int32 cumulative row ends (offs[-1] == M, empty experts
    allowed), and by ``mode``:

    - ``row``: xscale [M, 1] (or [M]; or 1x128 groups [M, K/128]),
      wscale [E, N, 1] (or [E, 1, 1] / [E]: one scale per expert, expanded): ``ops.fp8_grouped``'s
      Triton kernel with row scales (K a multiple of 128), or torch's grouped row-wise kernel
      (``backend="torch"``, with ``fast_accum``, or where the Triton kernel does not apply;
      sm90/sm100): measured at 0.59x the bf16 grouped GEMM without fast accumulation (``ops.fp8``'s
      docstring);
    - ``block``: xscale [M, K/128] (``quantize_groups``), wscale [E, ceil(N/128), K/128]: the
      Triton kernel of ``ops.fp8_grouped`` (the checkpoint's block scales kept; K a multiple of 128).

    On the CPU the float32 reference (a loop over experts)."""
    if xq.dtype != FP8 or wq.dtype != FP8 or xq.dim() != 2 or wq.dim() != 3 or xq.shape[1] != wq.shape[2]:
        raise ValueError(f"grouped_scaled_linear takes x [M, K] and w [E, N, K] in e4m3, got "
                         f"{tuple(xq.shape)} {xq.dtype} and {tuple(wq.shape)} {wq.dtype}")
    m, (e, n, k) = xq.shape[0], wq.shape
    if offs.shape != (e,):
        raise ValueError(f"offs must hold one row end per expert ({e}), got shape {tuple(offs.shape)}")
    if out_dtype != torch.bfloat16:
        raise NotImplementedError(f"the grouped FP8 multiplies write bf16 only, asked for {out_dtype}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"grouped_scaled_linear backend {backend!r}: expected 'auto', 'triton' or 'torch'")
    if mode == "block":
        return _grouped_block(xq, xscale, wq, wscale, offs)
    if mode != "row":
        raise ValueError(f"grouped_scaled_linear mode {mode!r}: expected 'row' or 'block'")
    if wscale.numel() not in (e, e * n):
        raise ValueError(f"row-wise expert weight scales must be [E, N, 1] or [E, 1, 1] ({e}, {n}), got "
                         f"{tuple(wscale.shape)} (block scales: mode='block')")
    groups = xscale.dim() == 2 and k % BLOCK == 0 and xscale.shape == (m, k // BLOCK) and k > BLOCK
    if xscale.numel() != m and not groups:
        raise ValueError(f"row-wise grouped_scaled_linear takes activation scales [M, 1] ({m}) or 1x128 groups "
                         f"[M, K/128], got {tuple(xscale.shape)}")
    sb = wscale.float().reshape(e, -1)
    sb = sb.expand(e, n).contiguous() if sb.shape[1] == 1 and n > 1 else sb  # [E, N]: per-expert scales expanded
    if not xq.is_cuda:
        return grouped_scaled_linear_reference(xq, xscale, wq, sb[..., None], offs, "row", out_dtype)
    if offs.dtype != torch.int32:
        raise ValueError(f"offs must be int32, got {offs.dtype}")
    if groups:  # 1x128 activation groups with per-channel weights: the Triton kernel
        got = fp8_grouped.grouped_block_mm(xq, xscale.float(), wq, sb, offs, x_groups=True, w_blocks=False)
        if got is None:
            raise ValueError(f"the Triton grouped kernel does not take these operands (K={k}, x row-major, "
                             "w contiguous), and no other kernel takes 1x128 activation groups with row weights")
        return got
    sa = xscale.float().reshape(m)
    if backend == "triton" or (backend == "auto" and not fast_accum):
        got = fp8_grouped.grouped_block_mm(xq, sa, wq, sb, offs, row=True)
        if got is not None:
            return got
        if backend == "triton":
            raise ValueError(f"the Triton grouped kernel does not take these operands (K={k} a multiple of 128, "
                             "x row-major, w contiguous)")
    if k % 16 or n % 16:
        raise ValueError(f"torch's grouped FP8 multiply needs K and N multiples of 16, got K={k}, N={n}")
    if _cc(xq)[0] not in (9, 10):
        raise NotImplementedError(f"torch's grouped FP8 multiply runs on sm90/sm100, this GPU is sm{_sm(xq)}")
    return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), sa.contiguous(), sb,
                                    offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _grouped_block(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
    m, (e, n, k) = xq.shape[0], wq.shape
    kb, nb = k // BLOCK, -(-n // BLOCK)
    if k % BLOCK:
        raise ValueError(f"block-scaled experts need K a multiple of {BLOCK}, got K={k}")
    if xscale.shape != (m, kb):
        raise ValueError(f"block-scaled experts take 1x128 activation scales [M, K/128] = [{m}, {kb}], "
                         f"got {tuple(xscale.shape)}")
    if wscale.shape != (e, nb, kb):
        raise ValueError(f"block-scaled expert weight scales must be [E, ceil(N/128), K/128] = [{e}, {nb}, {kb}], "
                         f"got {tuple(wscale.shape)}")
    if xq.is_cuda:
        if offs.dtype != torch.int32:
            raise ValueError(f"offs must be int32, got {offs.dtype}")
        got = fp8_grouped.grouped_block_mm(xq, xscale.float(), wq, wscale, offs)  # 64-row tiles: fp8_grouped
        if got is not None:
            return got
        log.warning("grouped block-FP8 kernel does not apply (no Triton, or strided operands): a loop over experts")
    return grouped_scaled_linear_reference(xq, xscale, wq, wscale, offs, "block")


def check_scaled_linear(mode: str, k: int, n: int, device: torch.device, experts: int = 0,
                        bias: bool = False, fast_accum: bool = False) -> None:
    """Start-up check of the multiply a layer will run: ``scaled_linear`` in ``mode`` at width
    k -> n (a token count not a multiple of 4, with a bf16 ``bias`` if the layer has one), or,
    with ``experts``, ``grouped_scaled_linear`` with uneven and empty experts and rows past the
    last end (expert parallel), against its float32 reference on random operands. A combination
    cuBLAS refuses runs the other way from here on (``_block_mm``); raises what torch raises
    otherwise, and RuntimeError on a mismatch beyond a bf16 step of the output's scale.
    ``fast_accum``: Hopper's fast FP8 sums keep fewer bits (H100, K = 2,048-25,600: relative RMS
    0.0019-0.0044, slope -1e-4 to -7e-4; a 1% scale error: slope +0.0093 or more): bounded by a
    relative RMS of 2^-6, 2^-5 of the largest output, a slope (output on reference) 2^-8 from 1."""
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 19, 1, 0, 7][:experts] if experts else [33]
    past = 3 if experts else 0  # expert parallel: rows past offs[-1] (other ranks' experts), not compared
    m = sum(counts) + past
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(max(experts, 1), n, k, generator=gen) * k ** -0.5
    b = torch.randn(n, generator=gen).bfloat16() if bias and not experts else None
    wq, ws = quantize_weight(w if experts else w[0], mode)
    xf = x.float()  # activation scales as the layer makes them: 1x128 groups for block weights, else rows
    if mode == "block":
        s = scale_from_amax(xf.view(m, -1, BLOCK).abs().amax(-1))
        xs = (to_fp8(xf.view(m, -1, BLOCK), s[..., None]).view(m, k), s.t().contiguous().t())
    else:
        s = scale_from_amax(xf.abs().amax(-1, keepdim=True))
        xs = (to_fp8(xf, s), s)
    xq, sx, wq, ws = (t.to(device) for t in (*xs, wq, ws))
    if experts:
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        got = grouped_scaled_linear(xq, sx, wq, ws, offs, mode, fast_accum=fast_accum)
        ref = grouped_scaled_linear_reference(xq.cpu(), sx.cpu(), wq.cpu(), ws.cpu(), offs.cpu(), mode, torch.float32)
    else:
        got = scaled_linear(xq, sx, wq, ws, mode, bias=None if b is None else b.to(device), fast_accum=fast_accum)
        ref = scaled_linear_reference(xq.cpu(), sx.cpu(), wq.cpu(), ws.cpu(), mode, torch.float32, b)
    got, ref = got[:m - past].float().cpu(), ref[:m - past]
    err = (got - ref).abs()
    rel, worst, slope = error_stats(got, ref)  # (fast: docstring)
    ok = (rel <= 2 ** -6 and worst <= 2 ** -5 and abs(slope) <= 2 ** -8) if fast_accum \
        else bool((err <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all())
    if not ok:
        raise RuntimeError(f"FP8 {mode} multiply at {k} -> {n}{f' ({experts} experts)' if experts else ''}"
                           f"{' (fast accumulation)' if fast_accum else ''} differs from its float32 reference "
                           f"by up to {err.max().item():.3g} (relative RMS {rel:.3g})")
