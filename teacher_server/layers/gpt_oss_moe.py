"""gpt-oss's expert layer: the grouped-GEMM expert layer of ``layers.moe`` (its stacked
weights, token grouping and combine) with gpt-oss's router, biases and activation.

- Router: logits = h W^T + b (float32), the top-k logits picked, their softmax the weights
  (the same as a softmax over all experts renormalised over the top k).
- Experts: gate/up and down products with a bias per expert, and the clamped SwiGLU
  (``ops.clamped_swiglu``, a compiled stage on the GPU; under expert parallel a CUDA kernel
  over the rank's own rows): gate = min(gate, limit), up = clamp(up, -limit, limit), out =
  (up + 1) * gate * sigmoid(alpha * gate) (limit 7, alpha 1.702), in float32, rounded once.
- Checkpoints: gate/up is one tensor whose rows (or, in transformers' in-memory layout
  [E, H, 2I], columns) interleave gate and up (gate at even, up at odd indices); they are
  split into the stacked [gate rows | up rows] here at load. The expert weights come plain
  (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]) or MXFP4-packed
  (``gate_up_proj_blocks`` [E, 2I, H / 32, 16] with ``_scales``: ``layers.formats.mxfp4``,
  dequantized at load).

Tensor parallel as ``SparseMoe``: each rank holds every expert's slice of the intermediate
dimension (and of the gate/up bias); the down bias is added by rank 0 only, before the
all-reduce of the partial sums. Expert parallel as ``SparseMoe``: each rank holds its experts
whole, biases included (read sliced to them), and adds the down bias of the rows it makes:
each row's once.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.mxfp4 import PACKED, dequantize
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import Slice, copy_checked
from teacher_server.layers.moe import ExpertWeights, ReplicatedLinear
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.ops.grouped_mm import GroupedGemm


class BiasedRouter(ReplicatedLinear):
    """The router with its bias: float32 logits [T, E]."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hidden, num_experts, dtype, device)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) + self.bias.float()

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(getattr(self, param).data, loaded, name)


class GptOssExperts(ExpertWeights):
    """Stacked expert weights (``ExpertWeights``) plus a bias per expert for each product:
    ``gate_up_bias`` [E_local, 2 I_local] (gate, then up, as the weight) and ``down_bias``
    [E_local, H].
    Checkpoint tensors are read whole (the interleaved rows are taken apart here); part
    "hf" marks transformers' transposed layout, "blocks" / "scales" the packed MXFP4 pair."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(num_experts, hidden, intermediate, dtype, device, tp, fmt)
        n = self.i_local
        self.gate_up_bias = nn.Parameter(torch.empty(self.num_local, 2 * n, dtype=dtype, device=device),
                                         requires_grad=False)
        self.down_bias = nn.Parameter(torch.empty(self.num_local, hidden, dtype=dtype, device=device),
                                      requires_grad=False)
        self._packed: set[str] = set()

    def shards(self, param: str) -> int:
        return 2 if param in self._packed else 1  # the packed pair, or one tensor

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        """Whole (gate and up rows interleave, MXFP4 blocks span 32 columns); expert parallel:
        this rank's experts (every tensor here is stacked [E, ...])."""
        return (0, self.first, self.num_local) if self.ep.size > 1 else None

    def _gate_up_rows(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """[..., 2I, in] with interleaved gate/up rows -> this rank's [..., gate | up, in]."""
        start, n = self.tp.rank * self.i_local, self.i_local
        if w.shape[-2] != 2 * n * self.tp.size:  # (whole rows: a wider tensor is another model's, not cut)
            raise ValueError(f"checkpoint tensor {name} has {w.shape[-2]} gate/up rows, expected "
                             f"{2 * n * self.tp.size} (2 x intermediate_size) (config/weights mismatch)")
        gate, up = w[..., 0::2, :], w[..., 1::2, :]
        return torch.cat([gate[..., start:start + n, :], up[..., start:start + n, :]], dim=-2)

    def _copy_expert(self, param: str, e: int, w: torch.Tensor, name: str, packed: bool = False) -> None:
        """Expert e's whole weight w ([out, in]) -> this rank's part of it."""
        start, n = self.tp.rank * self.i_local, self.i_local
        dst = getattr(self, param).data[e]
        if param == "gate_up":
            copy_checked(dst, self._gate_up_rows(w, name), name)
            return
        # down [H, I]: this rank's columns; MXFP4 packs I in blocks of 32, the last one zero-padded
        full = n * self.tp.size
        pad = -full % 32 if packed else 0
        if w.shape[1] not in (full, full + pad) or (w.shape[1] > full and bool(w[:, full:].any())):
            raise ValueError(f"checkpoint tensor {name} has {w.shape[1]} input columns, expected {full} "
                             f"(intermediate_size){f', or {full + pad} zero-padded' if pad else ''} "
                             "(config/weights mismatch)")
        copy_checked(dst, w[:, start:start + n], name)

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        loaded = self.local_stack(loaded, name)
        if param == "gate_up_bias":  # [E, 2I] interleaved
            copy_checked(self.gate_up_bias.data, self._gate_up_rows(loaded[..., None], name)[..., 0], name)
        elif param == "down_bias":
            copy_checked(self.down_bias.data, loaded, name)
        elif part in PACKED:  # one of the MXFP4 pair: the weight once both are here, expert by expert
            self._packed.add(param)
            pair = self.fmt.load_packed(self, param, part, loaded)
            if pair is not None:
                blocks, scales = pair
                if blocks.shape[0] != self.num_local:
                    raise ValueError(f"checkpoint tensor {name} holds {blocks.shape[0]} experts, expected "
                                     f"{self.num_local}")
                for e in range(self.num_local):
                    self._copy_expert(param, e, dequantize(blocks[e], scales[e], name=name), name, packed=True)
        else:  # transformers' [E, in, out]
            assert part == "hf", (name, part, tuple(loaded.shape))
            for e in range(self.num_local):
                self._copy_expert(param, e, loaded[e].t(), name)


class GptOssMoe(RuntimeModule):
    """gpt-oss's expert MLP of one decoder layer: [T, hidden] -> [T, hidden] (no shared expert;
    the token grouping and combine as ``SparseMoe``'s). ``gemm``: the model's grouped GEMM."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, alpha: float, limit: float,
                 gemm: GroupedGemm, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
                 fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit, self.gemm = top_k, alpha, limit, gemm
        self.gate = BiasedRouter(hidden, num_experts, dtype, device)
        self.experts = GptOssExperts(num_experts, hidden, intermediate, dtype, device, tp, fmt)
        self.tp = tp  # the ranks whose partial sums the layer's all-reduce adds

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): the softmax of the top-k logits."""
        top, ids = torch.topk(self.gate(h), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w, ids = self.route(h)
        ex = self.experts
        rows = ex.group(ids, self.rt.ops.group_kernel)  # the (token, slot) rows sorted by (this rank's) expert
        x = h.index_select(0, rows.tokens)
        gu = ex.fmt.apply_experts(ex, "gate_up", x, rows.offs, self.gemm)  # [M, 2 I_local]
        # bias added in it; expert parallel: the rows past the end unwritten
        a = self.rt.ops.expert_swiglu(gu, ex.gate_up_bias, rows.experts, self.alpha, self.limit, rows.end)
        y = ex.fmt.apply_experts(ex, "down", a, rows.offs, self.gemm)  # [M, H] partial sums with tp > 1
        # each row's expert's bias added in the combine; once, not once per rank (expert parallel: ex.tp is one rank)
        bias = ex.down_bias if ex.tp.rank == 0 else None
        return self.tp.all_reduce(rows.combine(y, w, self.rt.ops.combine_kernel, bias))  # [T, H] summed over the ranks
