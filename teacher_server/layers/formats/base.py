"""WeightFormat: how a layer holds its weights and multiplies by them.

Every layer with a weight matrix (the fused column-parallel and row-parallel linears, the
embedding and LM head, the stacked expert weights) makes its weights through its format,
loads and shards them through it, and calls it for the product: ``fmt.apply(layer, x)``. A
format is one class: ``create`` (the layer's parameters for an [out, in] weight), the
checkpoint tensors it reads beside each ``.weight`` (``extras``, e.g. ``weight_scale_inv``)
with the block of the weight each of their elements covers, ``process_after_load``, and the
products (``apply``, ``add_into``, ``apply_experts``).

Names. A layer's weight lives in a *slot*: ``weight`` for the linears and vocab layers,
``gate_up`` and ``down`` for the experts. The format's tensor for the slot keeps the slot's
name; an extra tensor with checkpoint suffix ``s`` is named ``s`` on a ``weight`` slot (as
in the checkpoint) and ``<slot>_<s>`` on another (``gate_up_weight_scale_inv``).
The loader routes ``<prefix>.<s>`` to the layer of ``<prefix>.weight`` under that name.

Shards. A block-scaled tensor holds one element per block of weight rows/columns, so a
tensor-parallel slice (or the place of a fused part) must start on a block and span whole
blocks (or end the axis): ``check_shard`` refuses others when the layer is built, and
``span`` turns a slice of the weight into the matching slice of any of the layer's tensors.
A block of 0 along an axis (``WHOLE``) is one element for the whole axis (a per-row scale
[out, 1] has one column, whatever slice of the input columns a rank holds).

Loading. ``plan_load`` sees every checkpoint tensor's dtype and shape before any is read and
may say how some are to be read (``Reader``: e.g. a per-tensor scale widened to one per row,
an FP8 weight of a layer held in the model dtype dequantized) or skipped.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from teacher_server.unsupported import UnsupportedModelError

# A grouped GEMM: [M, K] rows sorted by expert x [E, K, N] by expert, with the experts' row
# ends [E] int32 -> [M, N] (``ops.grouped_mm.GroupedGemm``).
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

WHOLE = 0  # a block size: one element covers the whole axis


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor as its file's header describes it (safetensors dtype, e.g.
    "BF16", "F8_E4M3")."""

    dtype: str
    shape: tuple[int, ...]
    file: Path


# Reads another checkpoint tensor, whole, by name (on the loading device).
Fetch = Callable[[str], torch.Tensor]
# How a checkpoint tensor is read: (the whole tensor, fetch) -> what the layer's load_weight
# gets (it cuts this rank's slice itself).
Reader = Callable[[torch.Tensor, Fetch], torch.Tensor]


def extra_name(slot: str, suffix: str) -> str:
    """The attribute of the extra tensor ``suffix`` of ``slot`` (see the module docstring)."""
    return suffix if slot == "weight" else f"{slot}_{suffix}"


class WeightFormat(ABC):
    """How the weights of a layer are stored and applied (one instance per model, shared by
    its layers: it keeps no per-layer state; the layer's tensors are the layer's)."""

    name: ClassVar[str]
    # Checkpoint tensors beside each ``<prefix>.weight`` and the [rows, columns] block of the
    # weight one of their elements covers (ceil-divided at the ends), e.g.
    # {"weight_scale_inv": (128, 128)}; set per instance where the checkpoint's config says.
    extras: dict[str, tuple[int, int]] = {}
    # Checkpoint suffixes (of ``extras``) held on the layer under another suffix: two
    # spellings of one tensor (``weight_scale`` read as ``weight_scale_inv``).
    aliases: dict[str, str] = {}

    def for_layer(self, role: str) -> WeightFormat:
        """The format of a layer of ``role`` ("linear", "experts", "embedding", "lm_head"):
        this one, or another where the checkpoint keeps that kind of layer unquantized
        (block-wise FP8 checkpoints keep the embedding and the LM head in bf16)."""
        return self

    def accumulating(self, fast: bool) -> WeightFormat:
        """This format with its FP8 products' fast accumulation on or off (``Config.fp8_fast_accum``);
        a format without FP8 products is itself."""
        return self

    @property
    def shard_unit(self) -> tuple[int, int]:
        """The rows and columns a shard must be whole multiples of (1, 1: any slice)."""
        return (math.lcm(1, *(b[0] for b in self.extras.values() if b[0] != WHOLE)),
                math.lcm(1, *(b[1] for b in self.extras.values() if b[1] != WHOLE)))

    def fits(self, axis: int, start: int, n: int, full: int) -> bool:
        """Whether the slice [start, start + n) of a weight axis of ``full`` (0: output rows, 1:
        input columns) is whole blocks of this format (or ends the axis)."""
        b = self.shard_unit[axis]
        return b == 1 or not (start % b or (n % b and start + n != full))

    def check_shard(self, what: str, axis: int, start: int, n: int, full: int, hint: str | None = None) -> None:
        """Refuse (UnsupportedModelError), when the layer is built, the slice [start, start + n)
        of a weight axis of ``full`` that cuts one of this format's blocks (``fits``); ``hint``
        says what to do (default: a smaller tensor-parallel size)."""
        if not self.fits(axis, start, n, full):
            hint = hint or "a smaller tensor-parallel size keeps them whole"
            b, kind = self.shard_unit[axis], ("rows", "columns")[axis]
            raise UnsupportedModelError(f"{what}: {kind} [{start}, {start + n}) of {full} are not whole "
                                        f"{b}-{kind[:-1]} blocks of the {self.name} weight format ({hint})")

    def block(self, param: str) -> tuple[int, int]:
        """The block of weight rows and columns one element of the layer's tensor ``param``
        covers: (1, 1) for the weight itself and tensors not the format's (a bias)."""
        for suffix, b in self.extras.items():
            if param == suffix or param.endswith("_" + suffix):
                return b
        return (1, 1)

    def span(self, param: str, axis: int, start: int, n: int) -> tuple[int, int]:
        """The slice [start, start + n) of weight axis ``axis`` as (start, length) in the
        layer's tensor ``param`` (block indices for a block-scaled one; ``check_shard``
        made sure the slice is whole blocks)."""
        b = self.block(param)[axis]
        if b == WHOLE:
            return (0, 1)
        return (start, n) if b == 1 else (start // b, -(-n // b))

    @abstractmethod
    def create(self, layer: nn.Module, slot: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
        """Register on ``layer`` the parameters (what the checkpoint fills) of the weight
        ``slot`` of ``shape`` ([out, in], or [E, out, in] for experts) in the model's
        ``dtype``: the slot's tensor and one per extra."""

    def init_random(self, layer: nn.Module, param: str, gen: torch.Generator) -> None:
        """Fill the layer's tensor ``param`` with random values in place (dummy weights, drawn
        from ``gen`` in parameter order): N(0, 0.02) here; a format whose tensors are not
        plain weights (scales, packed integers) draws its own."""
        getattr(layer, param).normal_(0.0, 0.02, generator=gen)

    def plan_load(self, model: nn.Module, tensors: dict[str, TensorInfo],
                  dtype: torch.dtype) -> dict[str, Reader | None]:
        """Before any tensor is read (not for dummy weights): how checkpoint tensors are read
        where not as they are (name -> ``Reader``, or None: skipped), after checking them
        (a missing tensor: UnsupportedModelError naming it). Layers may be switched to
        another format here (``reformat``). None here."""
        return {}

    def process_after_load(self, layer: nn.Module) -> None:
        """Called once on each of the format's layers after every tensor is loaded (or made
        at random): repack, transpose or check the loaded tensors (none here)."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> x W^T (+ ``layer.bias``) [T, out], written into ``out`` when given (a
        layer without a bias: the row-parallel parts)."""

    def add_into(self, layer: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """out += x W^T in place, the sum made in the GEMM's epilogue and rounded once;
        returns out, or None where the format cannot (the caller then adds ``apply``'s)."""
        return None

    def epilogue_add(self, layer: nn.Module) -> bool:
        """Whether ``add_into`` makes the sum in the GEMM's epilogue for ``layer``. Where it
        does not, a residual add is better left to the next norm's pass (``add_rms_norm``:
        x + delta read once) than made as a pass of its own before the norm reads x again."""
        return False

    def norm_input(self, layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   delta: torch.Tensor | None = None) -> tuple[torch.Tensor, object] | None:
        """(the residual stream x (+ delta), its RMSNorm with ``weight`` as ``layer``'s product
        takes its input) made in one pass, or None where the format takes the plain normed
        activation (the caller runs the norm). None here."""
        return None

    def silu_mul_input(self, layer: nn.Module, gate_up: torch.Tensor, slot: str = "weight") -> object | None:
        """silu(gate) * up of gate_up [T, 2I] made in one pass with what ``layer``'s product
        (of ``slot``: an expert layer's "down") takes as its input (``apply``'s or
        ``apply_experts``' x), or None where the format takes the plain activation (the caller
        runs SiLU-mul). None here."""
        return None

    def gather_input(self, layer: nn.Module, slot: str, x: torch.Tensor, index: torch.Tensor) -> object | None:
        """The rows ``index`` of x [T, K] as ``layer``'s ``slot`` takes its input (an expert
        layer's gathered (token, slot) rows), or None where the format takes the plain gathered
        rows (the caller gathers them). None here."""
        return None

    def fused_gate_up(self, layer: nn.Module, h: torch.Tensor, tokens: torch.Tensor,
                      offs: torch.Tensor) -> object | None:
        """An expert layer's down input made from h by one kernel of the format's own (the
        gather, gate/up product and activation; ``check_fused_gate_up`` passed), or None where
        it has none (the caller takes ``dense``'s kernel or the passes). None here."""
        return None

    def check_fused_gate_up(self, layer: nn.Module, top_k: int) -> bool:
        """Whether ``fused_gate_up`` runs for ``layer``, checked at its weights (at warm-up;
        False here). RuntimeError where the kernel runs and disagrees with the passes."""
        return False

    def dense(self, layer: nn.Module, slot: str = "weight") -> torch.Tensor | None:
        """The weight of ``slot`` as a plain tensor in the activation dtype, for kernels that
        read it directly (the fused gate/up kernel, the float32 logits, the embedding
        lookup); None where the format holds none (those paths are then skipped)."""
        return None

    @abstractmethod
    def apply_experts(self, layer: nn.Module, slot: str, x: torch.Tensor, offs: torch.Tensor,
                      gemm: GroupedMM) -> torch.Tensor:
        """The grouped product of rows x [M, in] sorted by expert with each expert's weight
        of ``slot`` ([E, out, in]; ``offs`` [E] int32 row ends): [M, out]. ``gemm`` is the
        model's grouped GEMM for plain weights."""


def reformat(layer: nn.Module, fmt: WeightFormat, dtype: torch.dtype) -> None:
    """Hold ``layer``'s weights in ``fmt`` from now on (before they are loaded): each of its
    slots (``layer.slots``) made again by ``fmt`` at the same shape, the old format's tensors
    dropped."""
    old = layer.fmt
    for slot in layer.slots:
        w = getattr(layer, slot)
        shape, device = tuple(w.shape), w.device
        for name in [slot, *(extra_name(slot, s) for s in old.extras)]:
            if name in layer._parameters:
                delattr(layer, name)
        fmt.create(layer, slot, shape, dtype, device)
    layer.fmt = fmt
