"""The dense 1x128 x 128x128 block-scaled FP8 multiply on sm90, through torch's ``F.scaled_mm``
(cuBLASLt), as cuBLASLt takes it: its documentation ("128-element 1D and 128x128 2D block
scaling for FP8 data types") asks M and N multiples of 4 and scale starts aligned to 16 bytes,
the 1x128 scales M-major [M, ceil(K/128)] with column stride M, the 128x128 scales K-major in
columns of round_up(ceil(K/128), 4). The H200 run with torch 2.11 + CUDA 13 refused M = 1 and
M = 77 (CUBLAS_STATUS_NOT_SUPPORTED from its heuristic) and took M = 32 and M = 1000: the rows are
padded here to a multiple of 4 (``quantize_groups`` writes buffers that are, so nothing is copied
then). cuBLAS 12.9's notes give the block recipes "limited support for fused epilogues": a bias
goes into the epilogue, and where that is refused it is added to a float32 product; a shape
refused outright runs through ``ops.fp8_grouped``'s Triton kernel as one expert. Either way the
output is rounded once, as ``ops.fp8_mm.scaled_linear_reference`` rounds it."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from teacher_server.ops import fp8_grouped
from teacher_server.ops.fp8_quant import padded_rows

log = logging.getLogger(__name__)

BLOCK = 128
_SCALING = getattr(F, "ScalingType", None)  # torch >= 2.10: F.scaled_mm and its recipes


def pad_block_scale(wscale: torch.Tensor) -> torch.Tensor:
    """A weight's block scales [Nb, Kb] as cuBLAS's 128x128 recipe reads them: the same values
    in a buffer whose rows hold round_up(Kb, 4) floats (a [Nb, Kb] view of it). Done once at
    load, it saves ``scaled_linear`` a small copy per call when Kb % 4 != 0."""
    nb, kb = wscale.shape
    l4 = -(-kb // 4) * 4
    buf = torch.ones(nb, l4, dtype=torch.float32, device=wscale.device)
    buf[:, :kb] = wscale
    return buf[:, :kb]


def block_scale_b(wscale: torch.Tensor) -> torch.Tensor:
    """[Nb, Kb] weight scales -> scale_b [L4, Nb] strides (1, L4) (module docstring)."""
    nb, kb = wscale.shape
    l4 = -(-kb // 4) * 4
    # pad_block_scale's view (or Kb % 4 == 0, contiguous): read in place; else a padded copy
    in_place = (wscale.dtype == torch.float32 and wscale.stride(1) == 1 and wscale.stride(0) == l4
                and wscale.untyped_storage().nbytes() >= 4 * (wscale.storage_offset() + nb * l4))
    if not in_place:
        wscale = pad_block_scale(wscale)
    return wscale.as_strided((l4, nb), (1, l4))


# (N, K, out dtype, bias) combinations cuBLASLt refused (CUBLAS_STATUS_NOT_SUPPORTED): the
# block recipe's support on sm90 is narrower than the other recipes' (cuBLAS 12.9's notes:
# "limited support for fused epilogues"); each is tried once, then run the other way
_REFUSED: set[tuple] = set()


def _refused(e: RuntimeError) -> bool:
    return "CUBLAS_STATUS_NOT_SUPPORTED" in str(e)


def pad_rows(xq: torch.Tensor, xscale: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """xq [T, K] and its M-major scales [T, Kb] as [R, K] / [R, Kb] strides (1, R): views where
    they already sit in buffers of R rows (``quantize_groups``' layout), else padded copies
    (zero codes, unit scales: the extra output rows are dropped)."""
    t, k = xq.shape
    kb = xscale.shape[1]
    x_room = xq.stride(0) == k and xq.untyped_storage().nbytes() >= xq.storage_offset() + r * k
    s_room = (xscale.dtype == torch.float32 and xscale.stride(0) == 1 and (xscale.stride(1) == r or kb == 1)
              and xscale.untyped_storage().nbytes() >= 4 * (xscale.storage_offset() + kb * r))
    if x_room:
        xp = xq.as_strided((r, k), (k, 1))
    else:
        xp = xq.new_zeros(r, k)
        xp[:t] = xq
    if s_room:
        return xp, xscale.as_strided((r, kb), (1, r))
    sp = torch.ones(kb, r, dtype=torch.float32, device=xscale.device)
    sp[:, :t] = xscale.t()
    return xp, sp.t()


def block_mm(xq: torch.Tensor, xscale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The 1x128 x 128x128 product: cuBLASLt (M padded to a multiple of 4, its rule; bias in its
    epilogue where it takes it, else added to a float32 output), or, for a combination it
    refuses, ``ops.fp8_grouped``'s Triton kernel as one expert (None where that does not apply
    either: the caller's reference runs). No fast accumulation (torch refuses it with block
    scales)."""
    t, k = xq.shape
    n = wq.shape[0]
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    r = padded_rows(t)
    if xscale.shape != (t, kb) or (t > 1 and kb > 1 and (xscale.stride(0) != 1 or xscale.stride(1) not in (t, r))):
        raise ValueError(f"block-wise FP8 needs activation scales [T, K/128] = [{t}, {kb}] M-major (strides "
                         f"(1, {r}) or (1, {t}): quantize_groups), got {tuple(xscale.shape)} strides {xscale.stride()}")
    if wscale.shape != (nb, kb):
        raise ValueError(f"block-wise FP8 weight scales must be [ceil(N/128), ceil(K/128)] = [{nb}, {kb}], "
                         f"got {tuple(wscale.shape)}")
    if t == 0:
        return torch.empty(0, n, device=xq.device, dtype=out_dtype)
    if _SCALING is None:  # torch < 2.10: the old entry point reads the recipe from the shapes (unpadded only)
        if kb % 4:
            raise NotImplementedError(f"block-wise FP8 with ceil(K/128) = {kb} not a multiple of 4 needs torch >= 2.10")
    key = (n, k, out_dtype, bias is not None)
    if key not in _REFUSED:
        xp, sp = pad_rows(xq, xscale, r)
        sb = block_scale_b(wscale)
        try:
            if bias is not None and (n, k, out_dtype, "epilogue") not in _REFUSED:
                try:
                    return _cublas_block(xp, sp, wq, sb, out_dtype, bias.to(out_dtype))[:t]
                except RuntimeError as e:
                    if not _refused(e):
                        raise
                    _REFUSED.add((n, k, out_dtype, "epilogue"))
                    log.warning("cuBLASLt refused the bias epilogue with block-wise FP8 at %d -> %d: the bias is "
                                "added to a float32 product", k, n)
            if bias is None:
                return _cublas_block(xp, sp, wq, sb, out_dtype, None)[:t]
            y = _cublas_block(xp, sp, wq, sb, torch.float32, None)[:t]
            return (y + bias.float()).to(out_dtype)  # rounded once, as the epilogue would
        except RuntimeError as e:
            if not _refused(e):
                raise
            _REFUSED.add(key)
            log.warning("cuBLASLt refused block-wise FP8 at %d -> %d (%s%s): the Triton block kernel runs it", k, n,
                        out_dtype, ", bias" if bias is not None else "")
    offs = torch.full((1,), t, dtype=torch.int32, device=xq.device)
    y = fp8_grouped.grouped_block_mm(xq, xscale, wq[None], wscale[..., :kb][None], offs, bm=64,
                                     out_dtype=torch.float32 if bias is not None else out_dtype)
    if y is None:
        return None
    return (y + bias.float()).to(out_dtype) if bias is not None else y


def _cublas_block(xp: torch.Tensor, sp: torch.Tensor, wq: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
    if _SCALING is None:
        return torch._scaled_mm(xp, wq.t(), scale_a=sp, scale_b=sb, bias=bias, out_dtype=out_dtype)
    return F.scaled_mm(xp, wq.t(), sp, _SCALING.BlockWise1x128, sb, _SCALING.BlockWise128x128, bias=bias,
                       output_dtype=out_dtype)
