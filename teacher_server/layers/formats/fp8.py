"""Fp8Weights: e4m3 weights with float32 scales (``fp8_config.Fp8Scheme`` says which), for
FP8 checkpoints (``quant_method`` fp8 and compressed-tensors) and for bf16 checkpoints
quantized at load (``--quantization fp8``: per-row scales, ``quantize_weight_rows``).

Held on a layer: the slot's [..., out, in] e4m3 tensor under the slot's name, its scales as
``weight_scale_inv`` ([..., ceil(out / r), ceil(in / c)] for blocks, else one per row
[..., out, 1]: a per-tensor scale is widened to its rows as it is read, so the parts of a fused
layer keep their own scales), and for static activations ``input_scale`` (per row as read, one
per layer after loading: the largest of its parts', as vLLM takes it).

Where the products run (``process_after_load``):
- a device without FP8 matrix multiplies (the CPU; GPUs before compute capability 8.9), and
  weight-only checkpoints: the weights are dequantized once, to the model dtype, and the layer
  is held unquantized from then on (its products are the plain ones);
- CUDA: ``ops.fp8``'s scaled multiplies, the mode chosen per layer at load (``layer.fp8_mode``):
  "block" for 128 x 128 block-scaled weights whose input widths are whole 128-groups, with
  1 x 128 dynamic activation groups (torch's block-wise multiply for linear layers, sm90;
  ``ops.fp8_grouped``'s Triton kernel for experts), where the block multiply runs on this GPU
  (``product_runs``, checked once per shape); "row" for every other layer (per-token
  activations, or the static per-tensor scale; per-row weight scales), experts through
  torch's grouped row-wise multiply; a layer neither runs (widths not multiples of 16, a GPU
  without the grouped multiply) is held dequantized. Block-scaled weights that cannot run
  "block" (other block sizes, widths, GPUs) are requantized per row at load (dequantized in
  float32, then one scale per row: docs/fp8.md gives the extra error).

The checkpoint decides which layers are FP8 (``plan_load``): a layer whose checkpoint weights
are not all e4m3 (kept in bf16 by the checkpoint's ignore list, wholly or for some fused parts)
is held in the model dtype, its e4m3 parts dequantized as they are read.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.layers.formats.base import (
    WHOLE,
    Fetch,
    GroupedMM,
    Reader,
    TensorInfo,
    WeightFormat,
    extra_name,
    reformat,
)
from teacher_server.layers.formats.fp8_config import E4M3, SPELLINGS, Fp8Scheme, scale_shape, weight_scale
from teacher_server.layers.formats.fp8_dispatch import (
    ExpertInputs,
    QuantizedRows,
    fp8_compute,
    product_runs,
    quant_kernels_ok,
)
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.ops import fp8, fp8_moe
from teacher_server.unsupported import UnsupportedModelError

SCALE = "weight_scale_inv"  # the layer's name for a weight's scales, whatever the checkpoint's spelling
FLOATS = ("BF16", "F16", "F32", "F64")  # safetensors' dtypes of weights kept unquantized
INPUT_SCALE = "input_scale"
GPU_BLOCK = (128, 128)  # the block torch's block-wise scaled multiply takes
# Dummy weights: e4m3 values N(0, 1) * DUMMY_SPREAD with scale 0.02 / DUMMY_SPREAD stand for
# N(0, 0.02), as the unquantized dummy weights (the spread keeps them off the subnormals).
DUMMY_SPREAD = 64.0
DUMMY_INPUT_SCALE = 0.05  # static activation scales of dummy weights (|x| up to ~22)


def quantize_weight_rows(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], scale [..., N, 1] float32): scale = the row's
    largest magnitude (``amax`` when given: the whole row's, of which w holds some columns) /
    448 in float32, the value rounded to nearest (``--quantization fp8``)."""
    if amax is None:
        amax = w.float().abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=1e-12) / fp8.FP8_MAX
    return (w.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale


def row_amax(layer: nn.Module, slot: str, w: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each whole row of ``w`` [..., N, K] float32: with tensor
    parallel, a slot whose input columns are split over ranks (``layer.split_columns``) takes
    the maximum over the ranks, so every rank quantizes with the scales one GPU would."""
    amax = w.abs().amax(dim=-1, keepdim=True)
    tp = getattr(layer, "tp", None)
    if tp is not None and tp.size > 1 and slot in getattr(layer, "split_columns", ()):
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return amax


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A weight [..., N, K] from its e4m3 values and scales, float32: per row ([..., N, 1] or
    [..., N], as compressed-tensors' channel scales may be stored), per tensor (one element) or
    per ``block`` (any other shape)."""
    if scale.numel() == 1:  # (also one block covering the whole weight)
        return fp8.dequantize(wq, scale.reshape(1), "tensor")
    if (scale.dim() >= 2 and scale.shape[-1] == 1 and scale.shape[-2] == wq.shape[-2]) or \
            scale.shape == wq.shape[:-1]:
        return fp8.dequantize(wq, scale, "row")
    return fp8.dequantize(wq, scale, "block", block)


def _finite(name: str) -> Reader:
    """Scale tensor ``name`` as it is; a NaN or infinite value (NaN scores) is refused by name."""
    def read(t: torch.Tensor, fetch: Fetch) -> torch.Tensor:
        if not bool(torch.isfinite(t).all()):
            raise UnsupportedModelError(f"checkpoint tensor {name} holds a NaN or infinite scale")
        return t

    return read


def _per_row(rows: int, name: str) -> Reader:
    """A per-tensor ([1] or []) or per-row ([N] or [N, 1]) scale as [rows, 1] float32."""
    def read(t: torch.Tensor, fetch: Fetch) -> torch.Tensor:
        t = _finite(name)(t, fetch).float().reshape(-1, 1)
        return t.expand(rows, 1) if t.shape[0] == 1 else t

    return read


class Fp8Weights(ExpertInputs, WeightFormat):
    """FP8 weights of one scheme (see the module docstring)."""

    def __init__(self, name: str, scheme: Fp8Scheme) -> None:
        self.name = name
        self.scheme = scheme
        if scheme.serialized:
            b = scheme.block if scheme.weights == "block" else (1, WHOLE)
            self.extras = dict.fromkeys(SPELLINGS, b)
            self.aliases = {"weight_scale": SCALE}
            if scheme.activations == "static":
                self.extras[INPUT_SCALE] = (1, WHOLE)
        else:
            self.extras, self.aliases = {}, {}

    def for_layer(self, role: str) -> WeightFormat:
        """The embedding and the LM head stay in the model dtype (the FP8 releases keep them so;
        the LM head's logits are float32 either way)."""
        return UNQUANTIZED if role in ("embedding", "lm_head") else self

    # --- weights ---------------------------------------------------------------------
    def create(self, layer: nn.Module, slot: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
        layer.model_dtype = dtype  # what the products return (and dequantized weights are held in)
        s = self.scheme
        if not s.serialized:  # the checkpoint's weight as it is; quantized in process_after_load
            setattr(layer, slot, nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False))
            return
        setattr(layer, slot, nn.Parameter(torch.empty(*shape, dtype=fp8.FP8, device=device), requires_grad=False))
        setattr(layer, extra_name(slot, SCALE), nn.Parameter(
            torch.empty(*scale_shape(shape, s), dtype=torch.float32, device=device), requires_grad=False))
        if s.activations == "static":
            setattr(layer, extra_name(slot, INPUT_SCALE),
                    nn.Parameter(torch.empty(*shape[:-1], 1, dtype=torch.float32, device=device), requires_grad=False))

    def init_random(self, layer: nn.Module, param: str, gen: torch.Generator) -> None:
        p = getattr(layer, param)
        if p.dtype == fp8.FP8:  # drawn in float32 512 MiB at a time (an expert layer's whole draw: 28 GiB)
            for part in p.view(-1).split(1 << 27):
                draw = torch.empty(part.shape, dtype=torch.float32, device=p.device).normal_(0.0, 1.0, generator=gen)
                part.copy_((draw * DUMMY_SPREAD).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8))
        elif param.endswith(SCALE):
            p.fill_(0.02 / DUMMY_SPREAD)
        elif param.endswith(INPUT_SCALE):
            p.fill_(DUMMY_INPUT_SCALE)
        else:
            super().init_random(layer, param, gen)

    def weight(self, layer: nn.Module, slot: str = "weight") -> torch.Tensor:
        """The slot's weight as it multiplies, float32 [..., out, in] (tests, tools and the
        dequantized path)."""
        w = getattr(layer, slot)
        if w.dtype != fp8.FP8:
            return w.float()
        return dequantize_weight(w, getattr(layer, extra_name(slot, SCALE)), self.scheme.block)

    # --- loading ---------------------------------------------------------------------
    def plan_load(self, model: nn.Module, tensors: dict[str, TensorInfo],
                  dtype: torch.dtype) -> dict[str, Reader | None]:
        """Check every FP8 weight has its scales; hold in the model dtype each layer whose
        checkpoint weights are not all e4m3 (their e4m3 parts dequantized as read, their scales
        skipped); widen per-tensor scales to one per row."""
        owners: dict[str, list[str]] = {}  # module path -> its checkpoint weights
        for name, info in tensors.items():
            place = model.checkpoint_param(name) if name.endswith(".weight") else None
            if place is None:
                continue
            if info.dtype != E4M3 and (info.dtype.startswith("F8") or info.dtype not in FLOATS):
                raise UnsupportedModelError(f"checkpoint tensor {name} is {info.dtype}; weights must be e4m3 (FP8, "
                                            f"with their scales) or {', '.join(FLOATS)}")
            if info.dtype == E4M3 and not self.scheme.serialized:
                raise UnsupportedModelError(f"--quantization fp8 quantizes a bf16 checkpoint, and {name} is FP8 "
                                            f"already: serve this checkpoint without --quantization")
            owners.setdefault(place[0], []).append(name)
        readers: dict[str, Reader | None] = {}
        for path, names in owners.items():
            try:
                owner = model.get_submodule(path)
            except AttributeError:
                continue  # (the loader names the tensor that has no place)
            held = getattr(owner, "fmt", None) is self and self.scheme.serialized
            if held and any(tensors[n].dtype != E4M3 for n in names):
                reformat(owner, UNQUANTIZED, dtype)  # bf16 in the checkpoint (wholly or some parts): plain
                held = False
            for name in names:
                prefix, scale = name.removesuffix("weight"), weight_scale(name, tensors, self.scheme)
                if not held:
                    readers.update(dict.fromkeys(s for s in (scale, prefix + INPUT_SCALE) if s))
                    if tensors[name].dtype == E4M3:
                        readers[name] = self._dequantizing(scale)
                    continue
                if self.scheme.activations == "static":
                    if prefix + INPUT_SCALE not in tensors:
                        raise UnsupportedModelError(f"checkpoint tensor {prefix}{INPUT_SCALE} is missing: the "
                                                    f"checkpoint's activation scheme is static")
                    readers[prefix + INPUT_SCALE] = _per_row(tensors[name].shape[0], prefix + INPUT_SCALE)
                rows = self.scheme.weights != "block"
                readers[scale] = _per_row(tensors[name].shape[0], scale) if rows else _finite(scale)
        return readers

    def _dequantizing(self, scale_name: str) -> Reader:
        """An e4m3 weight read for a layer held in the model dtype: dequantized with its scales."""
        def read(t: torch.Tensor, fetch: Fetch) -> torch.Tensor:
            return dequantize_weight(t, _finite(scale_name)(fetch(scale_name), fetch).float(), self.scheme.block)

        return read

    def process_after_load(self, layer: nn.Module) -> None:
        s = self.scheme
        if not s.serialized:  # quantized here, per row
            for slot in layer.slots:
                w = getattr(layer, slot).data.float()
                q, scale = quantize_weight_rows(w, row_amax(layer, slot, w))
                setattr(layer, slot, nn.Parameter(q, requires_grad=False))
                setattr(layer, extra_name(slot, SCALE), nn.Parameter(scale, requires_grad=False))
        device = getattr(layer, layer.slots[0]).device
        mode = self._gpu_mode(layer, device) if fp8_compute(device) and s.activations != "none" else "plain"
        if mode == "plain":  # held dequantized, in the model dtype
            for slot in layer.slots:
                w = self.weight(layer, slot).to(layer.model_dtype)
                for name in (slot, extra_name(slot, SCALE), extra_name(slot, INPUT_SCALE)):
                    if name in layer._parameters:
                        delattr(layer, name)
                setattr(layer, slot, nn.Parameter(w, requires_grad=False))
            layer.fmt = UNQUANTIZED
            return
        layer.fp8_mode = mode
        self.decide_products(layer, mode, device)
        # checked at each slot's input width: an expert layer's down input (width I, made in the
        # SiLU-mul pass) as well as its gate/up input (width H)
        layer.fp8_kernel = all(quant_kernels_ok(getattr(layer, slot).shape[-1], device, layer.model_dtype)
                               for slot in layer.slots)
        for slot in layer.slots:
            if s.activations == "static":  # one scale for the layer's input: the largest of its parts'
                p = extra_name(slot, INPUT_SCALE)
                amax = getattr(layer, p).amax().reshape(1)
                ep = getattr(layer, "ep", None)
                if ep is not None and ep.size > 1:  # expert parallel: of every rank's experts, as one GPU
                    import torch.distributed as dist

                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=ep.group)
                setattr(layer, p, nn.Parameter(amax, requires_grad=False))
            scale = getattr(layer, extra_name(slot, SCALE))
            if mode == "row" and scale.shape[-1] != 1:  # block scales -> per row
                w = self.weight(layer, slot)
                q, scale = quantize_weight_rows(w, row_amax(layer, slot, w))
                setattr(layer, slot, nn.Parameter(q, requires_grad=False))
            elif mode == "block" and scale.dim() == 2:  # the layout cuBLAS reads, made once
                scale = fp8.pad_block_scale(scale.data)
            setattr(layer, extra_name(slot, SCALE), nn.Parameter(scale, requires_grad=False))

    # --- products (CUDA) -------------------------------------------------------------
    def _gpu_mode(self, layer: nn.Module, device: torch.device) -> str:
        """How ``layer`` multiplies on the GPU: "block" (128 x 128 block scales kept, 1 x 128
        activation groups: every slot's input width whole groups of 128, and the block multiply
        runs on this GPU: torch's on sm90 for linear layers, ``ops.fp8_grouped``'s for experts),
        else "row" where the row-wise multiply runs (sm89+ linear layers, sm90/sm100 experts,
        widths that are multiples of 16), else "plain" (the weights dequantized)."""
        s = self.scheme
        experts = 6 if layer.role == "experts" else 0  # the start-up check's expert count
        shapes = [tuple(getattr(layer, slot).shape[-2:]) for slot in layer.slots]  # (n, k) per slot
        if s.weights == "block" and s.block == GPU_BLOCK and not any(k % GPU_BLOCK[1] for _, k in shapes) \
                and all(product_runs("block", k, n, experts, device) for n, k in shapes):
            return "block"
        return "row" if all(product_runs("row", k, n, experts, device) for n, k in shapes) else "plain"

    def mode(self, layer: nn.Module) -> str:
        """The GPU mode ``process_after_load`` chose for ``layer`` ("block" or "row")."""
        return layer.fp8_mode

    def _act_mode(self, layer: nn.Module, slot: str = "weight") -> str:
        """How ``layer``'s ``slot`` input is quantized: 1 x 128 groups for block weights and for
        the experts' down input (``fp8_down_groups``, ``decide_products``: power-of-two scales with
        per-row weights), else per row, or with the static per-tensor scale."""
        if self.scheme.activations == "static":
            return "tensor"
        if slot == "down" and layer.fp8_down_pow2:
            return "group_pow2"
        return "group" if layer.fp8_mode == "block" or (slot == "down" and layer.fp8_down_groups) else "row"

    def _quantize_input(self, layer: nn.Module, slot: str,
                        x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, QuantizedRows):  # quantized by the pass that made it
            return x.q, x.scale
        mode, kernel = self._act_mode(layer, slot), layer.fp8_kernel
        if mode in ("group", "group_pow2"):  # [T, K / 128] M-major scales
            return fp8.quantize_groups(x, GPU_BLOCK[1], kernel=kernel, pow2=mode == "group_pow2")
        if mode == "tensor":
            return fp8.quantize_tensor(x, getattr(layer, extra_name(slot, INPUT_SCALE)), kernel=kernel)  # [1]
        return fp8.quantize_rows(x, kernel=kernel)  # [T, 1]

    def norm_input(self, layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   delta: torch.Tensor | None = None) -> tuple[torch.Tensor, QuantizedRows] | None:
        """The RMSNorm of x (+ delta) quantized as ``layer`` takes its input, in the norm's pass
        (``ops.fp8.rms_norm_quant`` / ``add_rms_norm_quant``): the q/k/v and gate/up projections
        read it without a quantizing pass of their own."""
        mode = self._act_mode(layer)
        static = getattr(layer, extra_name("weight", INPUT_SCALE)) if mode == "tensor" else None
        if delta is None:
            q, scale = fp8.rms_norm_quant(x, weight, eps, mode, static, kernel=layer.fp8_kernel)
        else:
            x, q, scale = fp8.add_rms_norm_quant(x, delta, weight, eps, mode, static, kernel=layer.fp8_kernel)
        return x, QuantizedRows(q, scale, x.dtype)

    def silu_mul_input(self, layer: nn.Module, gate_up: torch.Tensor, slot: str = "weight") -> QuantizedRows | None:
        """silu(gate) * up of gate_up [T, 2I] as the input of ``layer``'s ``slot``, quantized in
        the same pass (``ops.fp8.silu_mul_quant``): the dense MLP's down projection and the
        experts' take it without a pass of their own over the activation."""
        mode = self._act_mode(layer, slot)
        static = getattr(layer, extra_name(slot, INPUT_SCALE)) if mode == "tensor" else None
        q, scale = fp8.silu_mul_quant(gate_up, mode, static, kernel=layer.fp8_kernel)
        return QuantizedRows(q, scale, gate_up.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows,
              out: torch.Tensor | None = None) -> torch.Tensor:
        xq, xs = self._quantize_input(layer, "weight", x)
        return fp8.scaled_linear(xq, xs, layer.weight, layer.weight_scale_inv, layer.fp8_mode, x.dtype, layer.bias,
                                 out, fast_accum=layer.fp8_fast_accum)

    def apply_experts(self, layer: nn.Module, slot: str, x: torch.Tensor, offs: torch.Tensor,
                      gemm: GroupedMM) -> torch.Tensor:
        xq, xs = self._quantize_input(layer, slot, x)
        if xs.numel() == 1:  # a static per-tensor scale: the grouped multiply takes one per row
            xs = xs.reshape(1, 1).expand(x.shape[0], 1)
        elif layer.fp8_mode == "row" and xs.shape[-1] > 1:  # the down input's 1 x 128 groups, per row
            xq, xs = fp8_moe.rows_of_groups(xq, xs)  # (``decide_products``)
        y = fp8.grouped_scaled_linear(xq, xs, getattr(layer, slot), getattr(layer, extra_name(slot, SCALE)), offs,
                                      layer.fp8_mode, fast_accum=slot == "down" and layer.fp8_fast_down)
        return y.to(x.dtype)  # [M, out] (the grouped multiplies write bf16)
