"""FP8 (e4m3) prefill: the API the weight formats (``layers.formats``) call. Activation
quantization lives here (per row, per 1x128 group, per tensor; fused into RMSNorm and SiLU-mul
through ``ops.fp8_quant``'s Triton kernel); the multiplies and the weight side (quantize,
dequantize, ``scaled_linear``, ``grouped_scaled_linear``) in ``ops.fp8_mm``, imported here.
Every function runs on the CPU too, through its reference (dequantize, then a float32 matmul),
so CI covers the callers.

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
    [ceil(K/128), M] contiguous buffer seen transposed (``quantize_groups`` writes that layout).
    cuBLASLt also takes only M and N multiples of 4 (its documentation; torch checks neither:
    M = 1 and M = 77 failed on the H200 with CUBLAS_STATUS_NOT_SUPPORTED): ``ops.fp8_block``;
  * weights BlockWise128x128: scale_b [L4, ceil(N/128)] with strides (1, L4),
    L4 = round_up(ceil(K/128), 4): the weight's [ceil(N/128), ceil(K/128)] block scales in a
    buffer whose rows are padded to a multiple of 4 (cuBLASLt's rule; before PR 166752 an
    unpadded scale gave silently wrong results when ceil(K/128) % 4 != 0). ``pad_block_scale``
    builds it once at load; an unpadded scale is padded per call here.
  * also accepted by torch (not used here): 128x128 activations x 1x128 weights, 1x128 x 1x128.
- out_dtype bf16, fp16 or float32 (or FP8 with scale_result); bias bf16 with a bf16 output,
  fp16 with fp16, and no bias with a float32 output (added afterwards here, in float32). A bias
  added to a bf16 output instead rounds twice (the block path did: 0.031 off where one rounding
  allows 0.031 at |y| ~ 3 on the H200).
- ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
  use_fast_accum)`` (and ``F.scaled_grouped_mm``, recipes RowWise or MX/NV FP4 only): on sm90
  **row-wise only** (a CUTLASS kernel; MXFP8 needs sm100, and there is no block-wise or
  tensor-wise grouped recipe). a [M, K] e4m3 row-major, b [G, K, N] a transposed view of a
  contiguous [G, N, K], offs [G] int32 group row ends, scale_a [M] float32 (1-D, contiguous),
  scale_b [G, N] float32 (stride 1 in N), output bf16 only, no bias, K and N multiples of 16.
  Its sm90 tile is picked from the average shape per group: Qwen3-30B-A3B's experts (1,024 rows
  each, N x K = 1536 x 2048 and 2048 x 768) fall in neither its "large" nor its "small" case and
  get a 128x256x64 tile with a float32 promotion every few K steps (no fast accumulation), which
  measured 0.59x the bf16 grouped GEMM (below). Nothing of ours was in the way (the scales are
  views, no copies), so ``grouped_scaled_linear`` runs row (or per-expert tensor, expanded)
  weight scales through a Triton kernel of this project (``ops.fp8_grouped``, row scales) by
  default, torch's kernel on request (``backend="torch"``, or ``fast_accum``), and 128x128-block
  expert weights through the same Triton kernel keeping the checkpoint's block scales
  (``block_to_rows`` is the other way: requantized per row at load, one more e4m3 rounding).

Layouts of this module (e4m3 = ``FP8``; every scale is float32 and *dequantizes*: x ~= xq * s):

- activation scales: ``row`` [T, 1] contiguous; ``group`` [T, K/128] M-major, strides (1, R)
  with R = round_up(T, 4) (``fp8_quant.padded_rows``): the scales and the codes [T, K] are views
  of buffers of R rows (zeros past T), because cuBLASLt's 1x128 recipe takes M a multiple of 4
  only; ``scaled_linear`` hands the R rows to cuBLAS and keeps the first T of its output;
  ``tensor`` [1].
- weight scales: ``tensor`` [1] (or []); ``row`` [N, 1]; ``block`` [ceil(N/128), ceil(K/128)],
  row stride ceil(K/128) or L4 (``pad_block_scale``). Expert weights [E, N, K] take [E, N, 1]
  (or [E, 1, 1] / [E]: per-expert tensor scales), or [E, ceil(N/128), K/128] block scales.
- quantization: s = max(amax, ``AMAX_FLOOR``) / 448 (an all-zero row gets a tiny scale and
  zeros), xq = round_to_nearest_even(clamp(x / s, -448, 448)); division correctly rounded, so
  the Triton kernels (``ops.fp8_quant``) give the references' bits (``scale_from_amax`` divides
  by a tensor: torch on CUDA multiplies by the reciprocal of a Python number, one ulp off now
  and then, which made ``quantize_tensor``'s scale differ from the reference's on the H200).

Measured on an H200 (torch 2.11 + CUDA 13, Triton 3.6; ``bench/bench_fp8.py``, 16,384 tokens,
3 s per case at the 700 W cap), against bf16 (same kind of case):

- dense layers (Qwen3-8B / 32B, the four projections): GEMMs alone tensor x1.82 / x1.82, row
  x1.74 / x1.78, block x1.62 / x1.64; with the fused quantization passes tensor x1.66 / x1.66,
  row x1.58 / x1.61, block x1.52 / x1.51 (passes separate: x1.54, x1.46, x1.40 at 8B). Relative
  RMS error against the bf16 product: 3.7-3.8% for every mode.
- quantization alone, GB/s moved at Qwen3-8B's widths: per row 3,427, per group 3,201, add +
  RMSNorm per row 3,703; SiLU-mul 927 (rows) and 954 (groups) with one program holding a whole
  12,288-wide row (one program per SM): now walked in 2,048-wide steps (``quant_chunks``),
  not yet measured.
- Qwen3-30B-A3B's experts (131,072 rows over 128 experts): bf16 grouped 2.355 ms; torch's
  grouped row-wise FP8 3.974 ms (x0.59); the Triton block kernel with 128-row tiles 2.838 ms
  (x0.83), with 64-row tiles 2.016 ms (x1.17): 64 rows are the default now, for the row-wise
  experts too (the bench times the others as ``fp8_block_gemm_bm128`` and ``fp8_row_gemm_torch``).
"""

from __future__ import annotations

import functools
import logging

import torch

from teacher_server.ops import fp8_quant, fp8_silu_rows
from teacher_server.ops.checks import faster
from teacher_server.ops.fp8_mm import (  # noqa: F401  (the API, in one place: ops.fp8)
    AMAX_FLOOR,
    BLOCK,
    FP8,
    FP8_MAX,
    MODES,
    block_to_rows,
    check_scaled_linear,
    dequantize,
    grouped_scaled_linear,
    grouped_scaled_linear_reference,
    pad_block_scale,
    pow2_ceil,
    quantize_weight,
    scale_from_amax,
    scaled_linear,
    scaled_linear_reference,
    to_fp8,
)
from teacher_server.ops.silu_mul import silu_mul_reference

# activation scales; ``group_pow2``: 1 x 128 groups whose scales are powers of two (amax / 448
# rounded up to one), so that ``ops.fp8_moe.rows_of_groups`` takes them per row without a second rounding
ACT_MODES = ("row", "group", "tensor", "group_pow2")
log = logging.getLogger(__name__)


# ---------------------------------------------------------------- torch references


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, 1] float32): one scale per row."""
    xf = x.float()
    scale = scale_from_amax(xf.abs().amax(-1, keepdim=True))
    return to_fp8(xf, scale), scale


def quantize_groups_reference(x: torch.Tensor, group: int = BLOCK,
                              pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, K/group] float32 M-major): one scale per 1 x group
    (``pow2``: rounded up to a power of two), in the kernel's layout (views of buffers of
    ``fp8_quant.padded_rows(T)`` rows, the padding quantized from zero rows)."""
    t, k = x.shape
    _check_groups(k, group)
    r = fp8_quant.padded_rows(t)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, r - t)).view(r, k // group, group)
    scale = scale_from_amax(xf.abs().amax(-1))  # [R, G]
    scale = pow2_ceil(scale) if pow2 else scale
    xq = to_fp8(xf, scale[..., None]).view(r, k)
    buf = torch.empty(k // group, r, device=x.device)  # strides (1, R) even where a dimension is 1
    buf.copy_(scale.t())
    return xq[:t], buf.t()[:t]


def quantize_tensor_reference(x: torch.Tensor,
                              static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (xq e4m3, scale [1] float32): the given scale, else amax(x) / 448."""
    xf = x.float()
    scale = (static_scale.float().reshape(1) if static_scale is not None
             else scale_from_amax(xf.abs().amax().reshape(1)))
    return to_fp8(xf, scale), scale


def _quantize_reference(y: torch.Tensor, mode: str, static_scale: torch.Tensor | None,
                        group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if mode == "row":
        return quantize_rows_reference(y)
    if mode in ("group", "group_pow2"):
        return quantize_groups_reference(y, group, pow2=mode == "group_pow2")
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
    if mode in ("group", "group_pow2"):
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


def quantize_groups(x: torch.Tensor, group: int = BLOCK, kernel: bool = True,
                    pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, K/group] float32, M-major: strides (1, R), R =
    round_up(T, 4), the layout cuBLAS's 1x128 recipe reads; module docstring). K must be a
    multiple of ``group`` (ValueError). ``pow2``: the scales rounded up to powers of two."""
    got = _quantize(x, "group_pow2" if pow2 else "group", "plain", group=group, kernel=kernel)
    return got[:2] if got is not None else quantize_groups_reference(x, group, pow2)


def quantize_tensor(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                    kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq e4m3, scale [1] float32): with ``static_scale`` (a checkpoint's
    ``input_scale``) one pass; without, amax(x) / 448 (a torch reduction, then the pass)."""
    if static_scale is None and x.is_cuda and kernel:
        static_scale = scale_from_amax(x.abs().amax().float().reshape(1))
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
    random rows, at 1 and 200 tokens (first the one-read SiLU-mul per row, ``_check_one_read``).
    False where the kernels do not apply (no Triton, not CUDA, a width over
    ``fp8_quant.MAX_K``): the references run instead; RuntimeError when a
    kernel's scales differ from the reference's by more than a bf16 step or more than 1% of its
    codes differ (the norm sums in another order; the rest give the reference's bits). The
    SiLU-mul pass with power-of-two group scales (``group_pow2``) that fails leaves that mode
    alone to its reference (logged)."""
    if not (device.type == "cuda" and fp8_quant.applies(torch.empty(1, 16, device=device, dtype=dtype),
                                                        max(hidden, intermediate))):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    _check_one_read(intermediate, device, dtype, gen)
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
            for name, got in cases.items():
                if err := _differs(*got):
                    raise RuntimeError(f"FP8 {name} ({mode}) differs from its torch reference at {t} tokens: {err}")
            # the experts' down input with per-channel weights, apart: its failure turns off that mode alone
            pow2 = "group_pow2"
            if mode == "group" and (err := _differs(silu_mul_quant(gu, pow2), silu_mul_quant(gu, pow2, kernel=False),
                                                    pow2=True)):
                fp8_quant.fail(True, "silu", pow2, intermediate, dtype)
                log.warning("FP8 silu_mul_quant (%s) differs from its torch reference at %d tokens (%s): its "
                            "reference runs instead", pow2, t, err)
    return True


def _check_one_read(intermediate: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    """The one-read SiLU-mul per row, its persistent programs each walking more than one row:
    where it differs from the reference, or does not time 3% faster than the two-pass kernel at
    a step's rows (``checks.faster``), the two-pass kernel takes its calls (logged)."""
    key = fp8_silu_rows.one_read_key(intermediate, dtype)
    progs = fp8_silu_rows.programs(1 << 30, intermediate, torch.empty((), dtype=dtype).element_size(), device)
    gu = (4 * torch.randn(progs + 7, 2 * intermediate, device=device, generator=gen)).to(dtype)
    if err := _differs(silu_mul_quant(gu, "row"), silu_mul_quant(gu, "row", kernel=False)):
        fp8_quant.LAUNCHES.fail(key)
        log.warning("FP8 one-read silu_mul_quant (row) differs from its torch reference at %d tokens (%s): the "
                    "two-pass kernel runs instead", progs + 7, err)
        return
    gu = torch.randn(max(4096, 4 * progs), 2 * intermediate, device=device, generator=gen).to(dtype)
    run = functools.partial(fp8_quant.quantize, gu, "row", "silu", fp8_max=FP8_MAX, amax_floor=AMAX_FLOOR)
    if not faster("FP8 silu_mul_quant (row), one read,", functools.partial(run, one_read=True),
                  functools.partial(run, one_read=False), "the two-pass kernel", f"I={intermediate}, {len(gu)} rows"):
        fp8_quant.LAUNCHES.fail(key)


def _differs(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
             pow2: bool = False) -> str:
    """How a quantization kernel's (codes, scales) differ from its reference's beyond the
    check's bounds (scales a bf16 step; with power-of-two scales also the next power, where an
    amax a rounding apart crosses one; 1% of the codes), or ''."""
    (xq, s), (rq, rs) = got, ref
    differ = (xq.view(torch.uint8) != rq.view(torch.uint8)).float().mean().item()
    near = (s - rs).abs() <= 2 ** -7 * rs
    if pow2:
        near = near | (s == 2 * rs) | (2 * s == rs)
    if near.all() and differ <= 0.01:
        return ""
    return f"{differ:.2%} of codes, scales by up to {(s - rs).abs().max().item():.3g}"
