"""Which FP8 products run on this device, and an FP8 layer's input quantized by the pass that
made it: ``fp8_compute`` (FP8 multiplies at all), ``product_runs`` (a scaled multiply's mode at a
layer's shape, checked once against its float32 reference), ``quant_kernels_ok`` (the Triton
activation quantization), ``QuantizedRows``, and ``ExpertInputs``, an expert layer's inputs (the
gathered rows; the down input by ``ops.fp8_moe``'s fused kernel). ``layers.formats.fp8`` decides
with them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from teacher_server.ops import fp8, fp8_moe

log = logging.getLogger(__name__)


def fp8_compute(device: torch.device) -> bool:
    """Whether ``device`` multiplies in FP8 (CUDA compute capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


_RUNS: dict[tuple, bool] = {}  # (mode, k, n, experts, device, fast_accum) -> whether that multiply runs there


def product_runs(mode: str, k: int, n: int, experts: int, device: torch.device, fast_accum: bool = False) -> bool:
    """Whether ``ops.fp8``'s multiply in ``mode`` ("block": 128 x 128 weight blocks, "row"),
    grouped over ``experts`` when not 0, runs on ``device`` at width k -> n and matches its
    float32 reference (``check_scaled_linear``, once per shape). Where not, the layer takes the
    next mode (block, row, then its weights dequantized), with one line logged. ``fast_accum``:
    the row-wise multiply with Hopper's fast FP8 accumulation (linear layers: where not, the
    promoted one; the experts' down product, torch's grouped kernel: where not, the Triton one)."""
    key = (mode, k, n, experts, str(device), fast_accum)
    if key not in _RUNS:
        try:
            fp8.check_scaled_linear(mode, k, n, device, experts, fast_accum=fast_accum)
            _RUNS[key] = True
        except (RuntimeError, ValueError, NotImplementedError) as e:
            log.warning("the FP8 %s multiply at %d -> %d%s does not run here (%s): %s", mode, k, n,
                        " (experts)" if experts else "", str(e)[:200],
                        "it accumulates in float32" if fast_accum else "the next mode is used")
            _RUNS[key] = False
    return _RUNS[key]


_KERNELS: dict[tuple, bool] = {}  # (width, device, dtype) -> whether ops.fp8's quantization kernels may run


def quant_kernels_ok(k: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``ops.fp8``'s activation quantization kernels may run at width ``k`` (checked
    once against their references: ``check_quant_kernels``); False: the references run."""
    key = (k, str(device), dtype)
    if key not in _KERNELS:
        try:
            fp8.check_quant_kernels(k, k, device, dtype)
            _KERNELS[key] = True
        except RuntimeError as e:
            log.warning("FP8 activation quantization kernels at width %d fail their check (%s): torch references",
                        k, str(e)[:200])
            _KERNELS[key] = False
    return _KERNELS[key]


@dataclass(frozen=True)
class QuantizedRows:
    """An FP8 layer's input quantized by the pass that made it (``Fp8Weights.silu_mul_input``):
    e4m3 rows [T, K], their scales as the layer's mode takes them, and the dtype the product
    returns. Rows slice as a tensor's do."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, rows: slice) -> QuantizedRows:
        if self.scale.numel() == 1:
            return QuantizedRows(self.q[rows], self.scale, self.dtype)
        s = self.scale[rows]
        return QuantizedRows(self.q[rows], s if s.shape[1] == 1 else s.t().contiguous().t(), self.dtype)  # M-major


class ExpertInputs:
    """``Fp8Weights``' choice of products at load and its expert-layer inputs, on its
    ``_quantize_input`` and ``_act_mode``."""

    def gather_input(self, layer: nn.Module, slot: str, x: torch.Tensor, index: torch.Tensor) -> QuantizedRows:
        """x's T rows quantized, then the rows ``index`` gathered as codes and scales: T rows
        quantized instead of the T * k gathered ones, and the gather moves 1 byte a value instead
        of 2. A row's codes depend on that row alone (per row, per 1 x 128 group, or one static
        scale), so the result is the gathered rows' quantization, bit for bit."""
        xq, xs = self._quantize_input(layer, slot, x)
        q = xq.view(torch.uint8).index_select(0, index).view(xq.dtype)  # (index_select of bytes: any device)
        static = self._act_mode(layer) == "tensor"  # (one scale for every row; not numel: a 1-row [1, 1])
        return QuantizedRows(q, xs if static else xs.index_select(0, index), x.dtype)

    def fused_gate_up(self, layer: nn.Module, h: torch.Tensor, tokens: torch.Tensor,
                      offs: torch.Tensor) -> QuantizedRows | None:
        """The experts' down input by ``ops.fp8_moe``'s kernel, where ``check_fused_gate_up``
        passed at this layer's shapes: h's T rows quantized, then each sorted row's gate/up
        product, SiLU-mul and 1 x 128 quantization in one pass (what ``gather_input``, the product
        and ``silu_mul_input`` make)."""
        if not _FUSED.get(_fused_key(layer)):
            return None
        block = layer.fp8_mode == "block"
        xq, xs = self._quantize_input(layer, "gate_up", h)
        got = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, layer.gate_up, layer.gate_up_weight_scale_inv,
                                         x_groups=block, w_blocks=block, dtype=h.dtype, pow2=layer.fp8_down_pow2)
        return None if got is None else QuantizedRows(*got, h.dtype)

    fast_accum = True  # row-wise products in Hopper's fast FP8 accumulation where they check (``accumulating``)

    def accumulating(self, fast: bool) -> ExpertInputs:
        self.fast_accum = fast  # (each model makes its own format; ``decide_products``)
        return self

    def decide_products(self, layer: nn.Module, mode: str, device: torch.device) -> None:
        """A linear layer's row-wise products in fast accumulation where they check at its widths
        (``fp8_fast_accum``; else promoted), and how an expert layer takes its down input, set at
        load (``fp8_down_groups``, ``fp8_down_pow2``, ``fp8_fast_down``): with dynamic
        activations and I a multiple of 128 it is made in 1 x 128 groups (``fp8_down_groups``:
        what ``ops.fp8_moe``'s kernel makes, so the SiLU-mul pass makes it too); block weights
        multiply the groups; per-row weights take groups with power-of-two scales
        (``group_pow2``, ``fp8_down_pow2``; where I > 128), then per row
        (``ops.fp8_moe.rows_of_groups``: the ratios powers of two, exact but below e4m3's normal
        range) and multiply them by torch's grouped kernel with fast accumulation where it checks
        at these widths (``fp8_fast_down``; 1.31x bf16 where the Triton kernel on 1x128 groups
        ran 0.90x, ``bench/bench_fp8_down.py``), else by the Triton row kernel."""
        layer.fp8_fast_accum = mode == "row" and layer.role != "experts" and self.fast_accum and all(
            product_runs("row", *getattr(layer, slot).shape[::-1], 0, device, fast_accum=True) for slot in layer.slots)
        dynamic = layer.role == "experts" and self.scheme.activations != "static"
        n, k = layer.down.shape[-2:] if dynamic else (0, 0)
        layer.fp8_down_groups = dynamic and k % 128 == 0  # (128: the group, ``fp8.GPU_BLOCK``'s columns)
        # one group (I = 128, also a tensor-parallel slice of a wider I) is per row already: no power of two
        layer.fp8_down_pow2 = layer.fp8_down_groups and mode == "row" and k > 128
        layer.fp8_fast_down = layer.fp8_down_groups and mode == "row" and self.fast_accum and product_runs(
            "row", k, n, 6, device, fast_accum=True)

    def check_fused_gate_up(self, layer: nn.Module, top_k: int) -> bool:
        """``ops.fp8_moe.check`` at the layer's weights, where its activations are dynamic and its
        down input is made in 1 x 128 groups; the answer holds for every expert layer of its
        shapes, mode and dtype on its device (the warm-up checks one layer of a model)."""
        block, key = layer.fp8_mode == "block", _fused_key(layer)
        _FUSED[key] = False  # (a check that raises leaves it off)
        pow2 = layer.fp8_down_pow2
        _FUSED[key] = on = key[-1] == ("group_pow2" if pow2 else "group") and fp8_moe.check(
            layer.gate_up, layer.gate_up_weight_scale_inv, top_k, x_groups=block, w_blocks=block,
            dtype=layer.model_dtype, pow2=pow2)
        return on


_FUSED: dict[tuple, bool] = {}  # _fused_key -> whether ops.fp8_moe's kernel passed its check there


def _fused_key(layer: nn.Module) -> tuple:
    """An expert layer's shapes, mode, dtype, device and down input's quantization: what
    ``ops.fp8_moe.check`` and whether it applies depend on (the last); fixed once the layer is
    loaded, so made once per layer (it is looked up at every forward)."""
    key = getattr(layer, "fp8_fused_key", None)
    if key is None:
        w = layer.gate_up
        layer.fp8_fused_key = key = (tuple(w.shape), tuple(layer.down.shape), layer.fp8_mode, layer.model_dtype,
                                     str(w.device), layer.fmt._act_mode(layer, "down"))
    return key
