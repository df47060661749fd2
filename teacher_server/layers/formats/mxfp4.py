"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints ship their expert weights
(``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}``): per weight
``<name>_blocks`` uint8 [..., out, in / 32, 16], two FP4 e2m1 values a byte (the low nibble
first), and ``<name>_scales`` uint8 [..., out, in / 32], a power-of-two (e8m0) scale per block
of 32 values along the input dimension, ``2 ** (s - 127)``.

Here the experts are dequantized at load to the model dtype (bf16) and multiplied as
unquantized weights: no MXFP4 kernel runs (torch has no FP4 grouped GEMM on the H200; bf16
experts take 4x the memory of the packed ones: gpt-oss-20b's ~12 GB of experts are ~38 GB). Only
the expert layers are packed in the checkpoints; every other layer is read as unquantized.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED, Unquantized

BLOCK = 32  # values per scale
# FP4 e2m1 codes 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED = ("blocks", "scales")  # checkpoint suffixes of one packed weight (``<name>_blocks``)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "MXFP4 weight") -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 (or float8_e8m0fnu: the same exponent bytes)
    [..., G] -> [..., G * 32] in ``dtype`` (exact: every FP4 value times a power of two is
    representable in bf16 and float32). Another layout, or a NaN scale (255), is a ValueError
    naming ``name``."""
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        scales = scales.view(torch.uint8)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8 (scales also float8_e8m0fnu), got "
                         f"{blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{name}: MXFP4 blocks [..., G, {BLOCK // 2}] with scales [..., G] (one per {BLOCK} "
                         f"values), got blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    if bool((scales == 255).any()):
        raise ValueError(f"{name}: a scale of 255, which the MX format reserves for NaN")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    vals = vals.flatten(-2) * torch.exp2(scales.float() - 127.0)[..., None]  # [..., G, 32]
    return vals.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference packing of w [..., in] (in a multiple of 32): (blocks, scales) as above.
    Each block's scale is the power of two that brings its largest magnitude to at most 6,
    values round to the nearest e2m1 value (tests write checkpoints with it)."""
    *lead, n = w.shape
    assert n % BLOCK == 0, f"{n} input columns: a multiple of {BLOCK}"
    g = w.float().reshape(*lead, n // BLOCK, BLOCK)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [..., G]
    scaled = g / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1[:8])
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude, 0..7
    code = code + 8 * ((scaled < 0) & (code > 0))
    code = code.to(torch.uint8).reshape(*lead, n // BLOCK, BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exp + 127).to(torch.uint8)


class Mxfp4Experts(Unquantized):
    """The expert layers' format: their weights are plain tensors in the model dtype after
    load (``Unquantized``'s products), filled from the packed pair by ``load_packed``."""

    name = "mxfp4"

    def load_packed(self, layer: nn.Module, slot: str, which: str,
                    loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keep one of a weight's packed pair (``which`` in PACKED) on the layer until the
        other comes; then (blocks, scales), which the layer dequantizes piece by piece
        (``dequantize``: a whole stack of experts at once would take 8x its packed bytes in
        float32), else None."""
        pending: dict[tuple[str, str], torch.Tensor] = layer.__dict__.setdefault("_mxfp4_pending", {})
        pending[(slot, which)] = loaded
        if (slot, "blocks") not in pending or (slot, "scales") not in pending:
            return None
        return pending.pop((slot, "blocks")), pending.pop((slot, "scales"))


class Mxfp4(Unquantized):
    """The model's format: ``Mxfp4Experts`` for the expert layers, unquantized for the rest
    (what gpt-oss's ``modules_to_not_convert`` keeps in bf16: attention, router, embedding,
    LM head)."""

    name = "mxfp4"

    def __init__(self) -> None:
        self.experts = Mxfp4Experts()

    def for_layer(self, role: str) -> WeightFormat:
        return self.experts if role == "experts" else UNQUANTIZED
