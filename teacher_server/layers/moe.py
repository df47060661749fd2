"""The mixture-of-experts MLP: a float32 router, top-k routing, tokens grouped by expert and
two grouped GEMMs over all experts (gate/up, then down) with SiLU-mul between, and the
weighted combine; optionally a shared expert behind a sigmoid gate (Qwen2-MoE).

No Python loop over experts and no host sync on the forward (with torch's grouped GEMM):
the token -> expert assignment is sorted once, the group ends come from ``searchsorted`` on
the sorted expert ids, and the combine is one ``embedding_bag`` (gather the k rows of each
token from the sorted outputs, weight them, sum in float32, round once).

Tensor parallel: every rank holds all experts, each split along its intermediate dimension,
like the dense MLP (gate/up column-parallel, down row-parallel); the router and the
shared-expert gate are replicated, so each rank routes identically and makes a partial sum of
the combined output (routed and shared experts), all-reduced once per layer at the end of
``SparseMoe.forward``. Expert parallel would instead keep experts [rank * E / ep,
(rank + 1) * E / ep) whole and move the sorted rows to their owner (all-to-all) around the two
grouped GEMMs: ``ExpertWeights`` would take the expert range, ``SparseMoe.forward`` the
exchange, at the points marked.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear, Slice, copy_checked
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.ops.grouped_mm import GroupedGemm

# Checkpoint names of expert weights, after "model.layers.N.<mlp | block_sparse_moe>.experts.":
# one tensor per expert and projection (hub checkpoints; Mixtral names them w1 / w3 / w2) ...
PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# ... or the stacked [E, ...] tensors transformers 5 keeps in memory (gate_up_proj [E, 2I, H],
# down_proj [E, H, I]).
STACKED = re.compile(r"^(gate_up_proj|down_proj)$")
_PROJ = {"gate_proj": ("gate_up", "gate"), "w1": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
         "w3": ("gate_up", "up"), "down_proj": ("down", "down"), "w2": ("down", "down")}


def expert_param(rest: str) -> tuple[str, str | None] | None:
    """Where a checkpoint tensor named ``...experts.<rest>`` goes in ``ExpertWeights``:
    (parameter, part) with part "gate:E", "up:E", "down:E" for a per-expert tensor and None
    for a stacked one; None when the name is not an expert weight."""
    m = PER_EXPERT.match(rest)
    if m:
        param, part = _PROJ[m.group(2)]
        return param, f"{part}:{m.group(1)}"
    m = STACKED.match(rest)
    return (m.group(1).removesuffix("_proj"), None) if m else None


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


class ExpertWeights(nn.Module):
    """All experts' weights, stacked: ``gate_up`` [E, 2 I_local, H] (gate rows, then up rows)
    and ``down`` [E, H, I_local], I_local = I / tp (this rank's slice of every expert's
    intermediate dimension), held through the weight format (``layers.formats``; the two
    slots, each with its extras). Loads per-expert tensors (stacked here) or stacked ones."""

    role = "experts"
    slots = ("gate_up", "down")
    split_columns = ("down",)  # the slots whose input columns ranks split

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.tp = tp
        self.fmt = fmt.for_layer(self.role)
        self.num_experts = num_experts
        self.i_local = n = tp.split(intermediate, "expert intermediate")  # tensor-parallel split point
        self.fmt.check_shard("expert gate/up rows", 0, tp.rank * n, n, intermediate)
        self.fmt.check_shard("expert up rows after the gate rows", 0, n, n, 2 * n)
        self.fmt.check_shard("expert down columns", 1, tp.rank * n, n, intermediate)
        self.fmt.create(self, "gate_up", (num_experts, 2 * n, hidden), dtype, device)
        self.fmt.create(self, "down", (num_experts, hidden, n), dtype, device)
        self._stacked: set[str] = set()  # params loaded from one stacked tensor

    @staticmethod
    def _axis(param: str) -> int:
        """The weight axis of the intermediate dimension in ``param`` (a slot or one of its
        extras): rows of gate_up (0), columns of down (1)."""
        return 0 if param.startswith("gate_up") else 1

    def _local(self, param: str) -> tuple[int, int]:
        """(start, length) of this rank's intermediate slice in ``param``'s coordinates."""
        return self.fmt.span(param, self._axis(param), self.tp.rank * self.i_local, self.i_local)

    def shards(self, param: str) -> int:
        """How many checkpoint tensors fill ``param``: one stacked, or one per expert and part."""
        if param in self._stacked:
            return 1
        return self.num_experts * (2 if self._axis(param) == 0 else 1)

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        """What of a checkpoint tensor this rank reads: its slice of the intermediate dimension
        (a stacked gate_up is read whole: its gate and up halves are two slices)."""
        axis = self._axis(param)
        if self.tp.size == 1 or (part is None and axis == 0):
            return None
        return axis + (1 if part is None else 0), *self._local(param)  # a stacked tensor: after the expert dim

    def _rows(self, param: str, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice along ``dim`` of a full intermediate dimension (or all of it: read
        as ``checkpoint_slice`` says, it is that slice already)."""
        start, n = self._local(param)
        return full.narrow(dim, start, n) if full.shape[dim] == n * self.tp.size else full

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        """Copy a per-expert tensor (part "gate:E" / "up:E" / "down:E") or a stacked one."""
        dst = getattr(self, param).data
        n = self._local(param)[1]
        if part is None:  # stacked [E, 2I, H] / [E, H, I]
            self._stacked.add(param)
            if self._axis(param) == 0:
                half = loaded.shape[1] // 2
                for j, rows in enumerate((loaded[:, :half], loaded[:, half:])):
                    copy_checked(dst[:, j * n:(j + 1) * n], self._rows(param, rows, 1), name)
            else:
                copy_checked(dst, self._rows(param, loaded, 2), name)
            return
        which, e = part.split(":")
        e = int(e)
        assert 0 <= e < self.num_experts, f"{name}: expert {e} outside 0..{self.num_experts - 1}"
        if which == "down":
            copy_checked(dst[e], self._rows(param, loaded, 1), name)
        else:
            j = 0 if which == "gate" else 1
            copy_checked(dst[e, j * n:(j + 1) * n], self._rows(param, loaded, 0), name)


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
        a = self.rt.ops.silu_mul(self.gate_up_proj(h))  # [T, I_s]
        if gate is not None:
            a.mul_(torch.sigmoid(gate))  # the per-token gate, moved before the (linear) down projection
        # With tp > 1 ``out`` holds this rank's partial sum of the routed experts and this adds
        # its partial sum of the shared expert (every rank adds: nothing here is reduced); the
        # layer's one all-reduce comes after.
        return self.down_proj.add_partial(out, a)


class SparseMoe(RuntimeModule):
    """The expert MLP of one decoder layer: [T, hidden] normed input -> [T, hidden] output
    (without the residual). ``gemm`` is the model's grouped GEMM (shared by its layers)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk: bool,
                 shared_intermediate: int, gemm: GroupedGemm, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk = norm_topk
        self.gemm = gemm
        self.gate = ReplicatedLinear(hidden, num_experts, dtype, device)  # the router
        self.experts = ExpertWeights(num_experts, hidden, intermediate, dtype, device, tp, fmt)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden, shared_intermediate, dtype, device, tp, fmt)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device)
        # [E] 1..E: searchsorted of the sorted expert ids against it gives each expert's row end
        self.register_buffer("expert_ends", torch.arange(1, num_experts + 1, device=device), persistent=False)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of h [T, hidden]: (weights [T, k] float32, expert ids [T, k] int64).
        Softmax over all experts in float32, top-k, renormalised when norm_topk (as
        transformers' Qwen-MoE and Mixtral routers)."""
        probs = torch.softmax(self.gate(h), dim=-1)  # [T, E] float32
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t, k = h.shape[0], self.top_k
        w, ids = self.route(h)
        # Group the T*k (token, slot) rows by expert: slot s = t * k + j.
        sorted_ids, order = torch.sort(ids.view(-1), stable=True)  # [T*k]
        offs = torch.searchsorted(sorted_ids, self.expert_ends, out_int32=True)  # [E] cumulative row ends
        # (expert parallel: exchange the sorted rows with their experts' owners here)
        x = h.index_select(0, order // k)  # [T*k, H] rows sorted by expert
        ex = self.experts
        gu = ex.fmt.apply_experts(ex, "gate_up", x, offs, self.gemm)  # [T*k, 2 I_local]
        a = self.rt.ops.silu_mul(gu)  # [T*k, I_local]
        y = ex.fmt.apply_experts(ex, "down", a, offs, self.gemm)  # [T*k, H] (partial sums with tp > 1)
        # (expert parallel: and back here)
        # Combine: token t sums w[t, j] * y[pos of slot (t, j)] over j, accumulated in float32.
        pos = torch.empty_like(order)
        pos[order] = torch.arange(t * k, device=h.device)
        out = F.embedding_bag(pos.view(t, k), y, mode="sum", per_sample_weights=w.to(y.dtype))  # [T, H]
        if self.shared_expert is not None:
            gate = None if self.shared_expert_gate is None else self.shared_expert_gate(h)
            out = self.shared_expert.add_into(out, h, gate)
        return self.experts.tp.all_reduce(out)  # tensor parallel: the sum of the ranks' partial sums

    @torch.no_grad()
    def reference(self, h: torch.Tensor) -> torch.Tensor:
        """The same output by a loop over experts, transformers' way (tests and checks; plain
        expert weights only)."""
        w, ids = self.route(h)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        ex = self.experts
        n, gate_up, down = ex.i_local, ex.fmt.dense(ex, "gate_up"), ex.fmt.dense(ex, "down")
        assert gate_up is not None and down is not None, f"the loop reference needs plain weights, not {ex.fmt.name}"
        for e in range(ex.num_experts):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            gu = h[tok] @ gate_up[e].t()
            y = (F.silu(gu[:, :n]) * gu[:, n:]) @ down[e].t()
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        if self.shared_expert is not None:
            s = self.shared_expert
            gu = s.gate_up_proj(h)
            half = gu.shape[1] // 2
            shared = s.down_proj(F.silu(gu[:, :half]) * gu[:, half:])
            g = self.shared_expert_gate
            out += (1.0 if g is None else torch.sigmoid(g(h))) * shared.float()
        return out.to(h.dtype)
