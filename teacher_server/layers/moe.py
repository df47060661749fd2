"""The mixture-of-experts MLP: a float32 router, top-k routing, tokens grouped by expert and
two grouped GEMMs over all experts (gate/up, then down) with SiLU-mul between, and the
weighted combine; optionally a shared expert behind a sigmoid gate (Qwen2-MoE).

No Python loop over experts and no host sync on the forward (with torch's grouped GEMM): the
token -> expert assignment is grouped once (a stable sort's order: ``ops.moe_group``), and the
combine is one pass (``ops.moe_combine``: gather the k rows of each token from the grouped
outputs, weight them, sum in float32, round once).

Tensor parallel (``moe`` "tensor" of ``TensorParallel``): every rank holds all experts, each
split along its intermediate dimension, like the dense MLP (gate/up column-parallel, down
row-parallel); the router and the shared-expert gate are replicated, so each rank routes
identically and makes a partial sum of the combined output (routed and shared experts),
all-reduced once per layer at the end of ``SparseMoe.forward``.

Expert parallel (``moe`` "expert", on the same ranks): rank r holds experts [r * E / size,
(r + 1) * E / size) whole (their GEMMs at the full intermediate width). The layer's input is
the same on every rank (after the attention's all-reduce), so every rank routes every token,
groups the (token, slot) rows of its own experts first (``ExpertWeights.group``: the others'
rows sort after them, past the last row end, where the grouped GEMMs write nothing and the
combine reads nothing), and combines them into its partial sum of [T, H]: the same one
all-reduce as tensor parallel sums the ranks' parts (no all-to-all; the shared expert stays
split along its intermediate dimension). No host sync either way: the row count is T * k (+1,
the row the combine skips) on every rank; the activation between the GEMMs reads the last row
end on the device (``ExpertRows.end``) and skips the rows after it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import Slice, copy_checked
from teacher_server.layers.moe_parts import ReplicatedLinear, RouterAndGate, SharedExpert
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.ops import moe_group
from teacher_server.ops.grouped_mm import GroupedGemm
from teacher_server.ops.moe_combine import moe_combine
from teacher_server.ops.moe_gate_up import moe_gate_up_silu
from teacher_server.ops.softmax_topk import pick as softmax_topk_pick
from teacher_server.ops.softmax_topk import softmax_topk, softmax_topk_torch

if TYPE_CHECKING:
    from teacher_server.layers.formats.fp8_dispatch import QuantizedRows

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


class ExpertRows(NamedTuple):
    """A step's (token, slot) rows grouped by this rank's experts (``ExpertWeights.group``)."""

    tokens: torch.Tensor  # [M] the token of each sorted row: the experts' input is h[tokens]
    experts: torch.Tensor  # [M] the local expert of each sorted row (rows of no local expert: the last)
    offs: torch.Tensor  # [E_local] int32 the local experts' cumulative row ends
    pos: torch.Tensor  # [T, k] the sorted row of each slot (``pad`` for another rank's expert)
    pad: int | None  # the row the combine skips (expert parallel), else None

    @property
    def end(self) -> torch.Tensor | None:
        """Expert parallel: int32 [1] on the device, the last row end (offs[-1]): the rows
        after it (another rank's experts') are never read, so the activation skips them
        (``ops.row_end``); None where every row is this rank's."""
        return None if self.pad is None else self.offs[-1:]

    def combine(self, y: torch.Tensor, w: torch.Tensor, kernel: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: token t's sum of w[t, j] * (y[pos[t, j]] + its expert's ``bias`` row, if given) over
        its slots j, in float32, rounded once (a slot at ``pad`` adds nothing; ``ops.moe_combine``)."""
        return moe_combine(y, self.pos, w, self.pad, bias, None if bias is None else self.experts, kernel)


class ExpertWeights(nn.Module):
    """This rank's experts' weights, stacked: ``gate_up`` [E_local, 2 I_local, H] (gate rows,
    then up rows) and ``down`` [E_local, H, I_local]. Tensor parallel: all experts (E_local = E),
    I_local = I / tp (this rank's slice of every expert's intermediate dimension); expert
    parallel: experts [first, first + E_local), E_local = E / size, I_local = I. Held through
    the weight format (``layers.formats``; the two slots, each with its extras). Loads
    per-expert tensors (stacked here; another rank's are not read) or stacked ones."""

    role = "experts"
    slots = ("gate_up", "down")
    split_columns = ("down",)  # the slots whose input columns ranks split

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        whole = tp.moe == "expert"
        self.ep = tp if whole else SINGLE  # the ranks the experts are dealt to
        self.tp = SINGLE if whole else tp  # the ranks each expert's intermediate dimension is split over
        self.fmt = fmt.for_layer(self.role)
        self.num_experts = num_experts
        self.num_local = self.ep.split(num_experts, "experts")  # (the start-up check names the setting)
        self.first = self.ep.rank * self.num_local
        self.i_local = n = self.tp.split(intermediate, "expert intermediate")  # tensor-parallel split point
        self.fmt.check_shard("expert gate/up rows", 0, self.tp.rank * n, n, intermediate)
        self.fmt.check_shard("expert up rows after the gate rows", 0, n, n, 2 * n, hint=None if self.tp.size > 1 else
                             f"the experts' intermediate size {n} is not whole blocks: not supported in this format")
        self.fmt.check_shard("expert down columns", 1, self.tp.rank * n, n, intermediate)
        self.fmt.create(self, "gate_up", (self.num_local, 2 * n, hidden), dtype, device)
        self.fmt.create(self, "down", (self.num_local, hidden, n), dtype, device)
        self._stacked: set[str] = set()  # params loaded from one stacked tensor

    def group(self, ids: torch.Tensor, kernel: bool = False) -> ExpertRows:
        """The rows of routing ``ids`` [T, k] (global expert ids) sorted by this rank's experts
        (a stable sort's order; ``kernel``: by the counting kernels, ``ops.moe_group``): slot
        s = t * k + j is row pos[t, j]. Expert parallel: another rank's expert sorts last (past
        offs[-1]) and its slots point at the extra row M = T * k, which the combine skips."""
        t, k = ids.shape
        m = t * k
        flat = ids.reshape(-1)
        mine = None
        if self.ep.size > 1:
            local = flat - self.first
            mine = (local >= 0) & (local < self.num_local)
            flat = torch.where(mine, local, self.num_local)
        keys, tokens, ends, pos = moe_group.group(flat, self.num_local + (mine is not None), k, kernel)
        offs = ends[:self.num_local]
        if mine is None:
            return ExpertRows(tokens, keys, offs, pos.view(t, k), None)
        # the others' rows and the extra row (never read) gather token 0: one row, read from cache;
        # their bias lookups kept in range
        tokens = torch.cat([torch.where(keys < self.num_local, tokens, 0), tokens.new_zeros(1)])
        keys = torch.cat([keys, keys.new_zeros(1)]).clamp_max_(self.num_local - 1)
        return ExpertRows(tokens, keys, offs, torch.where(mine, pos, m).view(t, k), m)

    @staticmethod
    def _axis(param: str) -> int:
        """The weight axis of the intermediate dimension in ``param`` (a slot or one of its
        extras): rows of gate_up (0), columns of down (1)."""
        return 0 if param.startswith("gate_up") else 1

    def _local(self, param: str) -> tuple[int, int]:
        """(start, length) of this rank's intermediate slice in ``param``'s coordinates."""
        return self.fmt.span(param, self._axis(param), self.tp.rank * self.i_local, self.i_local)

    def local_expert(self, e: int, name: str) -> int | None:
        """Global expert e's index among this rank's experts, None where another rank holds it."""
        if not 0 <= e < self.num_experts:  # (not an assert: python -O would read it as another rank's)
            raise ValueError(f"checkpoint tensor {name}: expert {e} outside 0..{self.num_experts - 1} "
                             "(config.json's expert count)")
        e -= self.first
        return e if 0 <= e < self.num_local else None

    def local_stack(self, loaded: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's experts of a stacked [E, ...] tensor (read whole, or already cut to them)."""
        if loaded.shape[0] == self.num_experts and self.num_local != self.num_experts:
            return loaded.narrow(0, self.first, self.num_local)
        if loaded.shape[0] != self.num_local:
            raise ValueError(f"checkpoint tensor {name}: {loaded.shape[0]} experts, expected {self.num_experts}")
        return loaded

    def shards(self, param: str) -> int:
        """How many checkpoint tensors fill ``param``: one stacked, or one per expert and part
        (every expert's: another rank's are passed over)."""
        if param in self._stacked:
            return 1
        return self.num_experts * (2 if self._axis(param) == 0 else 1)

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        """What of a checkpoint tensor this rank reads: its slice of the intermediate dimension
        (a stacked gate_up is read whole: its gate and up halves are two slices); expert
        parallel: its experts of a stacked tensor, nothing of another rank's expert."""
        if self.ep.size > 1:
            if part is None:
                return 0, self.first, self.num_local
            return None if self.local_expert(int(part.split(":")[1]), param) is not None else (0, 0, 0)
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
            loaded = self.local_stack(loaded, name)
            if self._axis(param) == 0:
                half = loaded.shape[1] // 2
                for j, rows in enumerate((loaded[:, :half], loaded[:, half:])):
                    copy_checked(dst[:, j * n:(j + 1) * n], self._rows(param, rows, 1), name)
            else:
                copy_checked(dst, self._rows(param, loaded, 2), name)
            return
        which, e = part.split(":")
        e = self.local_expert(int(e), name)
        if e is None:  # another rank's expert
            return
        if which == "down":
            copy_checked(dst[e], self._rows(param, loaded, 1), name)
        else:
            j = 0 if which == "gate" else 1
            copy_checked(dst[e, j * n:(j + 1) * n], self._rows(param, loaded, 0), name)


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
        self.tp = tp  # the ranks whose partial sums the layer's all-reduce adds
        self.gate = ReplicatedLinear(hidden, num_experts, dtype, device)  # the router
        self.experts = ExpertWeights(num_experts, hidden, intermediate, dtype, device, tp, fmt)
        self.shared_expert = self.shared_expert_gate = self.router_and_gate = None
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden, shared_intermediate, dtype, device, tp, fmt)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device)
            self.router_and_gate = RouterAndGate(self.gate, self.shared_expert_gate)  # (their weights: its rows)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of h [T, hidden]: (weights [T, k] float32, expert ids [T, k] int64)."""
        return self.select(self.gate(h))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of float32 router logits [T, E]: softmax over all experts, top-k, renormalised
        when norm_topk (as transformers' Qwen-MoE and Mixtral routers); one kernel where the
        warm-up picked it."""
        kernel = self.rt is not None and self.rt.ops.router_kernel  # (unbound: the torch path)
        out = softmax_topk(logits, self.top_k, self.norm_topk) if kernel else None
        return out if out is not None else softmax_topk_torch(logits, self.top_k, self.norm_topk)

    def route_and_gate(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``route(h)`` and the shared expert's gate logit [T, 1] (None: no gate), from one GEMM
        where the layer has both."""
        if self.router_and_gate is None:
            gate = None if self.shared_expert_gate is None else self.shared_expert_gate(h)
            return *self.route(h), gate
        logits = self.router_and_gate(h)  # [T, E + 1]
        e = logits.shape[1] - 1
        return *self.select(logits[:, :e]), logits[:, e:]

    def check_router_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether to select with ``ops.softmax_topk``: right at this layer's router and faster."""
        return softmax_topk_pick(self.gate, self.gate.weight.shape[1], self.top_k, self.norm_topk, device, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w, ids, gate = self.route_and_gate(h)
        ex = self.experts
        rows = ex.group(ids, self.rt.ops.group_kernel)  # the (token, slot) rows sorted by (this rank's) expert
        a = self.gate_up_act(h, rows)  # [M, I_local] (expert parallel: rows past the end unwritten)
        y = ex.fmt.apply_experts(ex, "down", a, rows.offs, self.gemm)  # [M, H] (partial sums with tp > 1)
        out = rows.combine(y, w, self.rt.ops.combine_kernel)  # [T, H]
        if self.shared_expert is not None:
            out = self.shared_expert.add_into(out, h, gate)
        return self.tp.all_reduce(out)  # the sum of the ranks' partial sums

    def gate_up_act(self, h: torch.Tensor, rows: ExpertRows) -> torch.Tensor | QuantizedRows:
        """The down product's input: silu(gate) * up of each sorted row's token, one fused kernel
        where the warm-up picked it, else the gathered rows, the grouped GEMM and SiLU-mul."""
        ex, ops = self.experts, self.rt.ops
        w = ex.fmt.dense(ex, "gate_up") if ops.moe_gate_up_kernel else None
        a = moe_gate_up_silu(h, rows.tokens, rows.offs, w, ops.moe_gate_up_config) if w is not None else None
        if a is None and ops.fp8_moe_kernel:  # FP8: its own kernel, the down input quantized in it
            a = ex.fmt.fused_gate_up(ex, h, rows.tokens, rows.offs)
        if a is not None:
            return a
        x = ex.fmt.gather_input(ex, "gate_up", h, rows.tokens)  # FP8: h quantized, then its codes gathered
        if x is None:
            x = h.index_select(0, rows.tokens)  # [M, H]
        gu = ex.fmt.apply_experts(ex, "gate_up", x, rows.offs, self.gemm)  # [M, 2 I_local]
        # FP8 experts: the down product's input quantized in the SiLU-mul pass (over every row: a
        # row's codes and scale are its own, so rows past an expert-parallel end are never read)
        a = ex.fmt.silu_mul_input(ex, gu, "down")
        return self.rt.ops.silu_mul(gu, rows.end) if a is None else a

    def reference(self, h: torch.Tensor) -> torch.Tensor:
        """The same output by a loop over experts, transformers' way (``layers.moe_reference``)."""
        from teacher_server.layers.moe_reference import loop_reference

        return loop_reference(self, h)
