"""FP8 (e4m3) prefill: activation quantization, the scaled matrix multiplies and their torch
references. The weight formats (``layers.formats``) call these; every function runs on the CPU
too, through its reference (dequantize, then a float32 matmul), so CI covers the callers.

What torch's scaled multiplies take (read from PyTorch's source for 2.11, ``ScaledBlas.cpp``,
``GroupedBlas.cpp``, ``ScaledBlasUtils.cpp``, and PR 166752 "Fix DeepSeek scaling tensor
handling", merged before 2.10; the GPU tests check each case on an H200 with torch 2.11 + CUDA 13):

- ``torch._scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)``:
  a [M, K] row-major, b [K, N] column-major (b = w.t() of a contiguous weight w [N, K]: sm90
  takes only that pair), e4m3 (e5m2 x e5m2 refused), K and N multiples of 16. The scaling is
  read from the scales' shapes: tensor-wise (both float32, one element) or row-wise (scale_a
  [M, 1], scale_b [1, N], float32, contiguous; cuBLAS >= 12.9 on sm90, else a CUTLASS kernel).
  Pairs are tensor x tensor or row x row only: a per-tensor activation scale with per-channel
  weights is expanded to [M, 1] here (and a per-tensor weight scale to [N]).
- ``F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a, swizzle_b, bias,
  output_dtype, contraction_dim, use_fast_accum)`` (``ScalingType``: TensorWise, RowWise,
  BlockWise1x128, BlockWise128x128, ...; ``SwizzleType`` matters only for MX/NV FP4 scales): the
  DeepSeek-style recipes, sm90 only (``_check_deepseek_support``: capability 9.x and cuBLASLt
  >= 12.9), e4m3 only, float32 scales, used here for ``block``:
  * activations BlockWise1x128: scale_a [M, ceil(K/128)] **M-major**, strides (1, M): the
    [ceil(K/128), M] contiguous buffer seen transposed (``quantize_groups`` writes that layout);
  * weights BlockWise128x128: scale_b [L4, ceil(N/128)] with strides (1, L4),
    L4 = round_up(ceil(K/128), 4): the weight's [ceil(N/128), ceil(K/128)] block scales in a
    buffer whose rows are padded to a multiple of 4 (cuBLASLt's rule; before PR 166752 an
    unpadded scale gave silently wrong results when ceil(K/128) % 4 != 0). ``pad_block_scale``
    builds it once at load; an unpadded scale is padded per call here.
  * also accepted by torch (not used here): 128x128 activations x 1x128 weights, 1x128 x 1x128.
- out_dtype bf16, fp16 or float32 (or FP8 with scale_result); bias bf16 with a bf16 output,
  fp16 with fp16, and no bias with a float32 output (added afterwards here, as for ``block``).
- ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
  use_fast_accum)`` (and ``F.scaled_grouped_mm``, recipes RowWise or MX/NV FP4 only): on sm90
  **row-wise only** (a CUTLASS kernel; MXFP8 needs sm100, and there is no block-wise or
  tensor-wise grouped recipe). a [M, K] e4m3 row-major, b [G, K, N] a transposed view of a
  contiguous [G, N, K], offs [G] int32 group row ends, scale_a [M] float32 (1-D, contiguous),
  scale_b [G, N] float32 (stride 1 in N), output bf16 only, no bias, K and N multiples of 16.
  ``grouped_scaled_linear`` therefore runs row (or per-expert tensor, expanded) weight scales
  through it, and 128x128-block expert weights through a Triton kernel of this project
  (``ops.fp8_grouped``) that keeps the checkpoint's block scales (``block_to_rows`` is the other
  way: requantized per row at load, one more e4m3 rounding of each weight).

Layouts of this module (e4m3 = ``FP8``; every scale is float32 and *dequantizes*: x ~= xq * s):

- activation scales: ``row`` [T, 1] contiguous; ``group`` [T, K/128] M-major (strides (1, T));
  ``tensor`` [1].
- weight scales: ``tensor`` [1] (or []); ``row`` [N, 1]; ``block`` [ceil(N/128), ceil(K/128)],
  row stride ceil(K/128) or L4 (``pad_block_scale``). Expert weights [E, N, K] take [E, N, 1]
  (or [E, 1, 1] / [E]: per-expert tensor scales), or [E, ceil(N/128), K/128] block scales.
- quantization: s = max(amax, ``AMAX_FLOOR``) / 448 (an all-zero row gets a tiny scale and
  zeros), xq = round_to_nearest_even(clamp(x / s, -448, 448)); division correctly rounded, so
  the Triton kernels (``ops.fp8_quant``) give the references' bits.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from teacher_server.ops import fp8_grouped, fp8_quant
from teacher_server.ops.grouped_mm import grouped_mm_reference
from teacher_server.ops.silu_mul import silu_mul_reference

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# the smallest amax a scale is computed from: a zero row quantizes to zeros with a finite scale
AMAX_FLOOR = 1e-12
BLOCK = 128
MODES = ("tensor", "row", "block")  # weight scales
ACT_MODES = ("row", "group", "tensor")  # activation scales
_SCALING = getattr(F, "ScalingType", None)  # torch >= 2.10: F.scaled_mm and its recipes


# ---------------------------------------------------------------- torch references


def _to_fp8(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y float32 / scale (broadcast), clamped to the e4m3 range and rounded to nearest even."""
    return (y / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=AMAX_FLOOR) / FP8_MAX


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, 1] float32): one scale per row."""
    xf = x.float()
    scale = _scale_of(xf.abs().amax(-1, keepdim=True))
    return _to_fp8(xf, scale), scale


def quantize_groups_reference(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, K/group] float32 M-major): one scale per 1 x group."""
    t, k = x.shape
    _check_groups(k, group)
    xf = x.float().view(t, k // group, group)
    scale = _scale_of(xf.abs().amax(-1))  # [T, G]
    xq = _to_fp8(xf, scale[..., None]).view(t, k)
    return xq, scale.t().contiguous().t()


def quantize_tensor_reference(x: torch.Tensor,
                              static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (xq e4m3, scale [1] float32): the given scale, else amax(x) / 448."""
    xf = x.float()
    scale = (static_scale.float().reshape(1) if static_scale is not None
             else _scale_of(xf.abs().amax().reshape(1)))
    return _to_fp8(xf, scale), scale


def _quantize_reference(y: torch.Tensor, mode: str, static_scale: torch.Tensor | None,
                        group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if mode == "row":
        return quantize_rows_reference(y)
    if mode == "group":
        return quantize_groups_reference(y, group)
    if static_scale is None:
        raise ValueError("a fused tensor-wise quantization needs a static scale (the whole tensor's amax is not "
                         "known in the pass that produces it)")
    return quantize_tensor_reference(y, static_scale)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.norm.rms_norm``'s rounding, written out (its CUDA path is torch's fused kernel)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def dequantize(wq: torch.Tensor, wscale: torch.Tensor, mode: str, block: tuple[int, int] = (BLOCK, BLOCK),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """wq [..., N, K] e4m3 and its scales (module docstring's layouts) -> the weight in ``dtype``
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
        scale = _scale_of(wf.abs().amax((-2, -1), keepdim=True))
        return _to_fp8(wf, scale), scale.reshape(*lead, 1, 1) if lead else scale.reshape(1)
    if mode == "row":
        scale = _scale_of(wf.abs().amax(-1, keepdim=True))
        return _to_fp8(wf, scale), scale
    if mode == "block":
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = F.pad(wf, (0, kb * bk - k, 0, nb * bn - n))  # zeros do not change an amax
        tiles = padded.reshape(*lead, nb, bn, kb, bk)
        scale = _scale_of(tiles.abs().amax((-3, -1)))  # [..., nb, kb]
        q = _to_fp8(tiles, scale[..., :, None, :, None]).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
        return q.contiguous(), scale
    raise ValueError(f"weight scale mode {mode!r}: expected one of {MODES}")


def block_to_rows(wq: torch.Tensor, wscale: torch.Tensor,
                  block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block weights [..., N, K] requantized with one scale per row, for torch's
    row-wise grouped multiply instead of the block kernel: one more e4m3 rounding per weight."""
    return quantize_weight(dequantize(wq, wscale, "block", block), "row")


# ---------------------------------------------------------------- activation quantization


def _check_groups(k: int, group: int) -> None:
    if k % group:
        raise ValueError(f"1x{group} group quantization needs K a multiple of {group}, got K={k}")


def _quantize(x: torch.Tensor, mode: str, producer: str, static_scale: torch.Tensor | None = None,
              group: int = BLOCK, kernel: bool = True,
              **kw: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The Triton kernel's result, or None where it does not apply (or ``kernel`` is off).
    Refuses a mode it does not know and a group width that does not divide the row."""
    if mode not in ACT_MODES:
        raise ValueError(f"activation quantization mode {mode!r}: expected one of {ACT_MODES}")
    if mode == "group":
        _check_groups(x.shape[-1] // 2 if producer == "silu" else x.shape[-1], group)
    if not kernel or (mode == "tensor" and static_scale is None):
        return None
    scale = static_scale.float().reshape(1).to(x.device).contiguous() if static_scale is not None else None
    return fp8_quant.quantize(x, mode, producer, fp8_max=FP8_MAX, amax_floor=AMAX_FLOOR, group=group, scale=scale,
                              **kw)  # type: ignore[arg-type]


# Each function below runs the Triton kernel where it applies (CUDA, bf16/fp16, K <= 32768) and
# ``kernel`` is on (a caller whose start-up check failed passes False), else its torch reference.


def quantize_rows(x: torch.Tensor, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] bf16/fp16 -> (xq [T, K] e4m3, scale [T, 1] float32): per-token dynamic."""
    got = _quantize(x, "row", "plain", kernel=kernel)
    return got[:2] if got is not None else quantize_rows_reference(x)


def quantize_groups(x: torch.Tensor, group: int = BLOCK, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, K/group] float32, M-major: strides (1, T), the
    layout cuBLAS's 1x128 recipe reads). K must be a multiple of ``group`` (ValueError)."""
    got = _quantize(x, "group", "plain", group=group, kernel=kernel)
    return got[:2] if got is not None else quantize_groups_reference(x, group)


def quantize_tensor(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                    kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq e4m3, scale [1] float32): with ``static_scale`` (a checkpoint's
    ``input_scale``) one pass; without, amax(x) / 448 (a torch reduction, then the pass)."""
    if static_scale is None and x.is_cuda and kernel:
        static_scale = _scale_of(x.abs().amax().float().reshape(1))
    got = _quantize(x, "tensor", "plain", static_scale, kernel=kernel)
    return got[:2] if got is not None else quantize_tensor_reference(x, static_scale)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str = "row",
                   static_scale: torch.Tensor | None = None, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, K] (``ops.norm.rms_norm``'s rounding) quantized in the same pass:
    (xq, scale) as ``quantize_rows`` / ``quantize_groups`` / ``quantize_tensor`` (mode ``row``,
    ``group``, ``tensor`` with its static scale)."""
    got = _quantize(x, mode, "norm", static_scale, kernel=kernel, weight=weight.contiguous(), eps=eps)
    if got is not None:
        return got[:2]
    return _quantize_reference(rms_norm_reference(x, weight, eps), mode, static_scale, BLOCK)


def add_rms_norm_quant(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, mode: str = "row",
                       static_scale: torch.Tensor | None = None,
                       kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s = x + delta, xq, scale): the residual stream (as ``ops.norm.add_rms_norm`` returns it)
    and its RMSNorm quantized, in one pass."""
    got = _quantize(x, mode, "norm", static_scale, kernel=kernel, weight=weight.contiguous(), eps=eps, delta=delta)
    if got is not None:
        xq, sc, s = got
        return s, xq, sc  # type: ignore[return-value]
    s = x + delta
    return (s, *_quantize_reference(rms_norm_reference(s, weight, eps), mode, static_scale, BLOCK))


def silu_mul_quant(gate_up: torch.Tensor, mode: str = "row", static_scale: torch.Tensor | None = None,
                   kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] (``ops.silu_mul``'s rounding) quantized in the
    same pass: (hq [T, I] e4m3, scale)."""
    got = _quantize(gate_up, mode, "silu", static_scale, kernel=kernel)
    if got is not None:
        return got[:2]
    return _quantize_reference(silu_mul_reference(gate_up), mode, static_scale, BLOCK)


def check_quant_kernels(hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Start-up check at a model's widths: each quantization kernel (plain, RMSNorm with and
    without the residual add, SiLU-mul; per row and per 1x128 group) against its reference on
    random rows, at 1 and 200 tokens. False where the kernels do not apply (no Triton, not
    CUDA, a width over ``fp8_quant.MAX_K``): the references run instead; RuntimeError when a
    kernel's scales differ from the reference's by more than a bf16 step or more than 1% of its
    codes differ (the norm sums in another order; the rest give the reference's bits)."""
    if not (device.type == "cuda" and fp8_quant.applies(torch.empty(1, 16, device=device, dtype=dtype),
                                                        max(hidden, intermediate))):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(dtype)
    for t in (1, 200):
        x = torch.randn(t, hidden, device=device, generator=gen).to(dtype)
        d = torch.randn(t, hidden, device=device, generator=gen).to(dtype)
        gu = (4 * torch.randn(t, 2 * intermediate, device=device, generator=gen)).to(dtype)
        for mode in ("row", "group") if hidden % BLOCK == 0 and intermediate % BLOCK == 0 else ("row",):
            q = quantize_rows if mode == "row" else quantize_groups
            cases = {"quantize": (q(x), q(x, kernel=False)),
                     "rms_norm_quant": (rms_norm_quant(x, w, 1e-6, mode),
                                        rms_norm_quant(x, w, 1e-6, mode, kernel=False)),
                     "add_rms_norm_quant": (add_rms_norm_quant(x, d, w, 1e-6, mode)[1:],
                                            add_rms_norm_quant(x, d, w, 1e-6, mode, kernel=False)[1:]),
                     "silu_mul_quant": (silu_mul_quant(gu, mode), silu_mul_quant(gu, mode, kernel=False))}
            for name, ((xq, s), (rq, rs)) in cases.items():
                differ = (xq.view(torch.uint8) != rq.view(torch.uint8)).float().mean().item()
                if not ((s - rs).abs() <= 2 ** -7 * rs).all() or differ > 0.01:
                    raise RuntimeError(f"FP8 {name} ({mode}) differs from its torch reference at {t} tokens: "
                                       f"{differ:.2%} of codes, scales by up to {(s - rs).abs().max().item():.3g}")
    return True


# ---------------------------------------------------------------- scaled multiplies


def pad_block_scale(wscale: torch.Tensor) -> torch.Tensor:
    """A weight's block scales [Nb, Kb] as cuBLAS's 128x128 recipe reads them: the same values
    in a buffer whose rows hold round_up(Kb, 4) floats (a [Nb, Kb] view of it). Done once at
    load, it saves ``scaled_linear`` a small copy per call when Kb % 4 != 0."""
    nb, kb = wscale.shape
    l4 = -(-kb // 4) * 4
    buf = torch.ones(nb, l4, dtype=torch.float32, device=wscale.device)
    buf[:, :kb] = wscale
    return buf[:, :kb]


def _block_scale_b(wscale: torch.Tensor) -> torch.Tensor:
    """[Nb, Kb] weight scales -> scale_b [L4, Nb] strides (1, L4) (module docstring)."""
    nb, kb = wscale.shape
    l4 = -(-kb // 4) * 4
    # pad_block_scale's view (or Kb % 4 == 0, contiguous): read in place; else a padded copy
    in_place = (wscale.dtype == torch.float32 and wscale.stride(1) == 1 and wscale.stride(0) == l4
                and wscale.untyped_storage().nbytes() >= 4 * (wscale.storage_offset() + nb * l4))
    if not in_place:
        wscale = pad_block_scale(wscale)
    return wscale.as_strided((l4, nb), (1, l4))


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
    (K, N multiples of 16; ``block`` on sm90 only); on the CPU the float32 reference."""
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
    # a float32 output takes no bias in the kernel (torch refuses it), nor, to be safe, the block
    # recipe (cuBLASLt's bias epilogue with block scales is unverified here): added after
    kbias = bias if bias is not None and out_dtype != torch.float32 and mode != "block" else None
    if mode == "block":
        y = _block_mm(xq, xscale, wq, wscale, out_dtype, None, fast_accum)
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
              out_dtype: torch.dtype, bias: torch.Tensor | None, fast_accum: bool) -> torch.Tensor:
    t, k = xq.shape
    n = wq.shape[0]
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    if _cc(xq)[0] != 9:
        raise NotImplementedError(f"block-wise FP8 (1x128 x 128x128) runs on sm90 only in torch {torch.__version__}; "
                                  f"this GPU is sm{_sm(xq)}")
    if xscale.shape != (t, kb) or (t > 1 and kb > 1 and xscale.stride() != (1, t)):
        raise ValueError(f"block-wise FP8 needs activation scales [T, K/128] = [{t}, {kb}] M-major (strides "
                         f"(1, {t}): quantize_groups), got {tuple(xscale.shape)} strides {xscale.stride()}")
    if wscale.shape != (nb, kb):
        raise ValueError(f"block-wise FP8 weight scales must be [ceil(N/128), ceil(K/128)] = [{nb}, {kb}], "
                         f"got {tuple(wscale.shape)}")
    sb = _block_scale_b(wscale)
    if _SCALING is None:  # torch < 2.10: the old entry point reads the recipe from the shapes (unpadded only)
        if kb % 4:
            raise NotImplementedError(f"block-wise FP8 with ceil(K/128) = {kb} not a multiple of 4 needs torch >= 2.10")
        return torch._scaled_mm(xq, wq.t(), scale_a=xscale, scale_b=sb, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return F.scaled_mm(xq, wq.t(), xscale, _SCALING.BlockWise1x128, sb, _SCALING.BlockWise128x128, bias=bias,
                       output_dtype=out_dtype, use_fast_accum=fast_accum)


def grouped_scaled_linear(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                          offs: torch.Tensor, mode: str = "row", out_dtype: torch.dtype = torch.bfloat16,
                          fast_accum: bool = False) -> torch.Tensor:
    """The experts' multiply -> [M, N] bf16. xq [M, K] e4m3 with rows sorted by expert, wq
    [E, N, K] e4m3 contiguous, offs [E] int32 cumulative row ends (offs[-1] == M, empty experts
    allowed), and by ``mode``:

    - ``row``: xscale [M, 1] (or [M]), wscale [E, N, 1] (or [E, 1, 1] / [E]: one scale per
      expert, expanded): torch's grouped row-wise kernel (sm90/sm100; ``fast_accum`` passed on);
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
    if mode == "block":
        return _grouped_block(xq, xscale, wq, wscale, offs)
    if mode != "row":
        raise ValueError(f"grouped_scaled_linear mode {mode!r}: expected 'row' or 'block'")
    if wscale.numel() not in (e, e * n):
        raise ValueError(f"row-wise expert weight scales must be [E, N, 1] or [E, 1, 1] ({e}, {n}), got "
                         f"{tuple(wscale.shape)} (block scales: mode='block')")
    if xscale.numel() != m:
        raise ValueError(f"row-wise grouped_scaled_linear takes activation scales [M, 1] ({m}), "
                         f"got {tuple(xscale.shape)}")
    sb = wscale.float().reshape(e, -1)
    sb = sb.expand(e, n).contiguous() if sb.shape[1] == 1 and n > 1 else sb  # [E, N]: per-expert scales expanded
    if not xq.is_cuda:
        return grouped_scaled_linear_reference(xq, xscale, wq, sb[..., None], offs, "row", out_dtype)
    if k % 16 or n % 16:
        raise ValueError(f"torch's grouped FP8 multiply needs K and N multiples of 16, got K={k}, N={n}")
    if _cc(xq)[0] not in (9, 10):
        raise NotImplementedError(f"torch's grouped FP8 multiply runs on sm90/sm100, this GPU is sm{_sm(xq)}")
    if offs.dtype != torch.int32:
        raise ValueError(f"offs must be int32, got {offs.dtype}")
    return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xscale.float().reshape(m).contiguous(), sb,
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
        got = fp8_grouped.grouped_block_mm(xq, xscale.float(), wq, wscale, offs)
        if got is not None:
            return got
        log.warning("grouped block-FP8 kernel does not apply (no Triton, or strided operands): a loop over experts")
    return grouped_scaled_linear_reference(xq, xscale, wq, wscale, offs, "block")
