"""The small parts of an expert layer (``layers.moe.SparseMoe``): the replicated float32
projections (the router, the shared expert's gate, and the two as one GEMM) and the shared
expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear, copy_checked
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole (the router, the shared-expert gate); its
    output is float32: routing decisions are made on unrounded logits. It stays in the model
    dtype whatever the weight format (the formats are for the projections and experts)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    # Whether this torch has CUDA mm(out_dtype=float32) for half inputs (tried once per process).
    mm_out_dtype: bool | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out] float32 (bf16 products accumulated in float32, not rounded)."""
        if h.is_cuda and h.dtype != torch.float32 and ReplicatedLinear.mm_out_dtype is not False:
            try:
                out = torch.mm(h, self.weight.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):  # a torch without it: upcast instead
                ReplicatedLinear.mm_out_dtype = False
            else:
                ReplicatedLinear.mm_out_dtype = True
                return out
        return F.linear(h.float(), self.weight.float())

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.weight.data, loaded, name)


class RouterAndGate(ReplicatedLinear):
    """The router [E, H] and the shared expert's gate [1, H] as one GEMM: [T, E + 1] float32
    logits, the gate's in the last column (one read of the layer's input instead of two). Its
    one weight tensor holds both: the two modules' weights become views of its rows, so they load
    (and serve alone: ``route``, the references) as before; it has no checkpoint tensor of its own."""

    def __init__(self, router: ReplicatedLinear, gate: ReplicatedLinear) -> None:
        e = router.weight.shape[0]
        super().__init__(router.weight.shape[1], e + gate.weight.shape[0], router.weight.dtype, router.weight.device)
        router.weight = nn.Parameter(self.weight.data[:e], requires_grad=False)
        gate.weight = nn.Parameter(self.weight.data[e:], requires_grad=False)

    def shards(self, param: str) -> int:
        return 0  # (the router's and the gate's tensors fill it)


class SharedExpert(RuntimeModule):
    """The dense expert every token takes (fused gate/up, SiLU-mul, down), scaled per token by
    sigmoid(gate); same tensor-parallel split as the dense MLP."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden, {"gate": intermediate, "up": intermediate}, False, dtype,
                                               device, tp, fmt=fmt)
        self.down_proj = RowLinear(intermediate, hidden, dtype, device, tp, fmt)

    def add_into(self, out: torch.Tensor, h: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """out += sigmoid(gate) * shared(h), in place (gate [T, 1] float32; None: ungated, as
        DeepSeek's shared experts); returns out."""
        p, d = self.gate_up_proj, self.down_proj
        w = p.fmt.dense(p)  # the gate/up GEMM and SiLU-mul in one kernel where it runs (plain weights, Hopper)
        a = self.rt.ops.gate_up_act(h, w) if w is not None else None
        if a is None:
            gu = p(h)
            a = d.fmt.silu_mul_input(d, gu) if gate is None else None  # (FP8: quantized in the SiLU-mul pass)
            if a is None:
                a = self.rt.ops.silu_mul(gu)  # [T, I_s]
        if gate is not None:
            a.mul_(torch.sigmoid(gate))  # the per-token gate, moved before the (linear) down projection
        # With tp > 1 ``out`` holds this rank's partial sum of the routed experts and this adds
        # its partial sum of the shared expert (every rank adds: nothing here is reduced); the
        # layer's one all-reduce comes after.
        return self.down_proj.add_partial(out, a)
