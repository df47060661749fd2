"""FP8 (e4m3) activation quantization and scaled matrix multiplies: the plain-torch
definitions (any device; the CPU path and the references of the GPU kernels).

Scales multiply: a quantized value q with scale s stands for q * s. Dynamic scales are
amax / FP8_MAX over their group (a row, a 1 x ``group`` slice of a row, or the tensor), so the
largest magnitude maps to FP8_MAX. Weight scales of a [N, K] weight, by ``mode``:
"tensor" [1], "row" [N, 1], "block" [ceil(N / 128), ceil(K / 128)] (128 x 128 blocks, ceil-divided
at the ends).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12  # amax floor: an all-zero group gets a tiny scale, not a division by zero


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturated at +-FP8_MAX."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic: x [T, K] -> (xq [T, K] fp8, scale [T, 1] float32)."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return _cast(x, scale), scale


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x ``group`` dynamic: x [T, K] (K a multiple of group) -> (xq [T, K] fp8, scale
    [T, K / group] float32, row-major: scale[t, g] covers columns [g * group, (g + 1) * group))."""
    t, k = x.shape
    assert k % group == 0, f"K={k} is not a multiple of the group {group}"
    xg = x.float().view(t, k // group, group)
    scale = xg.abs().amax(dim=-1).clamp(min=_TINY) / FP8_MAX  # [T, K / group]
    return _cast(xg, scale[..., None]).view(t, k), scale


def quantize_tensor(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor: with ``static_scale`` (a checkpoint's input_scale) that one, else dynamic:
    (xq fp8 like x, scale [1] float32)."""
    if static_scale is None:
        scale = x.float().abs().amax().clamp(min=_TINY).reshape(1) / FP8_MAX
    else:
        scale = static_scale.float().reshape(1)
    return _cast(x, scale), scale


def dequantize(wq: torch.Tensor, wscale: torch.Tensor, mode: str,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """wq [..., N, K] fp8 with its scales (``mode``: see the module docstring; leading
    dims, e.g. experts, on both) -> [..., N, K] float32."""
    w = wq.float()
    if mode in ("tensor", "row"):
        return w * wscale.float()
    assert mode == "block", f"unknown scale mode {mode!r}"
    n, k = w.shape[-2:]
    s = wscale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w * s[..., :n, :k]


def _expand_activation_scale(xscale: torch.Tensor, k: int) -> torch.Tensor:
    """An activation scale ([1], [T, 1] or [T, K / g]) as a multiplier of [T, K]."""
    if xscale.dim() == 2 and xscale.shape[1] > 1:
        return xscale.repeat_interleave(k // xscale.shape[1], dim=1)
    return xscale


def scaled_linear(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor, mode: str,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(xq * xscale) [T, K] x (wq * wscale)^T [K, N] (+ bias) -> [T, N] in ``out_dtype``, the
    product in float32 (written into ``out`` when given)."""
    x = xq.float() * _expand_activation_scale(xscale.float(), xq.shape[1])
    y = x @ dequantize(wq, wscale, mode).t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype)
    return y if out is None else out.copy_(y)


def grouped_scaled_linear(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                          offs: torch.Tensor) -> torch.Tensor:
    """Rows xq [M, K] sorted by expert (``offs`` [E] int32 row ends), per-row scales [M, 1],
    times each expert's row-scaled weight wq [E, N, K] / wscale [E, N, 1] -> [M, N] bf16 (a
    loop over experts: the definition)."""
    x = xq.float() * xscale.float()
    out = torch.zeros(xq.shape[0], wq.shape[1], dtype=torch.float32, device=xq.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ dequantize(wq[e], wscale[e], "row").t()
        start = end
    return out.to(torch.bfloat16)
