"""Which FP8 products run on this device, and an FP8 layer's input quantized by the pass that
made it: ``fp8_compute`` (FP8 multiplies at all), ``product_runs`` (a scaled multiply's mode at a
layer's shape, checked once against its float32 reference), ``quant_kernels_ok`` (the Triton
activation quantization), ``QuantizedRows``. ``layers.formats.fp8`` decides with them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from teacher_server.ops import fp8

log = logging.getLogger(__name__)


def fp8_compute(device: torch.device) -> bool:
    """Whether ``device`` multiplies in FP8 (CUDA compute capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


_RUNS: dict[tuple, bool] = {}  # (mode, k, n, experts, device) -> whether that multiply runs there


def product_runs(mode: str, k: int, n: int, experts: int, device: torch.device) -> bool:
    """Whether ``ops.fp8``'s multiply in ``mode`` ("block": 128 x 128 weight blocks, "row"),
    grouped over ``experts`` when not 0, runs on ``device`` at width k -> n and matches its
    float32 reference (``check_scaled_linear``, once per shape). Where not, the layer takes the
    next mode (block, row, then its weights dequantized), with one line logged."""
    key = (mode, k, n, experts, str(device))
    if key not in _RUNS:
        try:
            fp8.check_scaled_linear(mode, k, n, device, experts)
            _RUNS[key] = True
        except (RuntimeError, ValueError, NotImplementedError) as e:
            log.warning("the FP8 %s multiply at %d -> %d%s does not run here (%s): the next mode is used", mode, k,
                        n, " (experts)" if experts else "", str(e)[:200])
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
