"""DeepSeekMoE: the expert layer of ``layers.moe`` (grouped GEMMs over all experts, no loop)
with DeepSeek's routing and its shared experts.

Routing (float32 throughout, as transformers keeps the router in float32):
- V3 (``sigmoid``, ``noaux_tc``): scores = sigmoid(logits); the experts are *picked* on
  scores + e_score_correction_bias, first the ``topk_group`` groups whose two best biased
  scores sum highest, then the top-k experts inside them; the weights are the unbiased
  scores of the picked experts, renormalised when ``norm_topk_prob``, times
  ``routed_scaling_factor``.
- V2 (``softmax``): probabilities over all experts; ``greedy`` takes the top-k,
  ``group_limited_greedy`` first the ``topk_group`` groups with the highest single
  probability; weights times ``routed_scaling_factor``, never renormalised (as transformers
  reads V2 configs, whatever ``norm_topk_prob`` says; no published V2 config sets it).

The ``n_shared_experts`` shared experts are one MLP of their summed width that every token
takes, ungated (``SharedExpert`` with no gate). Tensor parallel as ``SparseMoe``: the router
replicated, experts and the shared MLP split along their intermediate dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import copy_checked
from teacher_server.layers.moe import SharedExpert, SparseMoe
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.ops import moe_router, softmax_topk, split_gemm
from teacher_server.ops.grouped_mm import GroupedGemm
from teacher_server.ops.moe_router import sigmoid_route
from teacher_server.ops.softmax_topk import sigmoid_topk, top_k_weighed
from teacher_server.ops.split_gemm import split_bf16, split_logits


@dataclass(frozen=True)
class ExpertRouting:
    """How DeepSeekMoE picks and weighs a token's experts (``models.deepseek_spec`` reads it)."""

    scoring: str  # "sigmoid" (V3: the bias only picks) or "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)
    n_group: int  # experts split into n_group groups; a token's experts come from topk_group of them
    topk_group: int
    routed_scaling_factor: float
    correction_bias: bool  # V3's e_score_correction_bias (added to the scores for picking only)

    @property
    def grouped(self) -> bool:
        """Whether a token's experts come from its best groups only (V3's 8 groups, 4 kept)."""
        return self.n_group > 1 and self.topk_group < self.n_group


class Float32Router(nn.Module):
    """The router's weight [E, H] (and V3's score-correction bias [E]) held in float32: the
    routing decision is made on float32 logits of float32 weights, as transformers does
    (its ``_keep_in_fp32_modules``)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device),
                                                     requires_grad=False) if bias else None)
        self.parts: torch.Tensor | None = None  # the weight as bf16 parts (``ops.split_gemm``), once picked

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E] float32 logits."""
        return F.linear(h.float(), self.weight)

    def logits(self, h: torch.Tensor, split: bool) -> torch.Tensor:
        """``forward``, from the weight's bf16 parts in one bf16 GEMM (``split``: where the
        warm-up picked it) for bf16 rows on the GPU."""
        if split and h.dtype == torch.bfloat16 and h.is_cuda:
            if self.parts is None:  # (made by the warm-up's check; a layer after the first: here, once)
                self.parts = split_bf16(self.weight)
            return split_logits(h, self.parts)
        return self(h)

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(getattr(self, param).data, loaded.float(), name)
        self.parts = None  # (of the weight before: made again from this one)


def group_mask(choice: torch.Tensor, n_group: int, topk_group: int, top2: bool) -> torch.Tensor:
    """[T, E] bool: the experts of the ``topk_group`` best groups of each token, a group
    scored by the sum of its two best ``choice`` values (``top2``) or its best one."""
    t, e = choice.shape
    g = choice.view(t, n_group, e // n_group)
    score = g.topk(2, dim=-1).values.sum(-1) if top2 else g.amax(-1)  # [T, n_group]
    keep = torch.zeros_like(score, dtype=torch.bool)
    keep.scatter_(1, score.topk(topk_group, dim=-1).indices, True)
    return keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)


def deepseek_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, n_group: int,
                   topk_group: int, norm_topk: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from router logits [T, E] float32."""
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias  # the bias picks; it never weighs
        top2 = True
    else:
        scores = choice = logits.softmax(dim=-1)
        top2 = False
    if n_group > 1 and topk_group < n_group:
        choice = choice.masked_fill(~group_mask(choice, n_group, topk_group, top2), float("-inf"))
    return top_k_weighed(scores, choice, top_k, norm_topk, scale)


class DeepseekMoe(SparseMoe):
    """``SparseMoe`` with DeepSeek's router and ungated shared experts."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk: bool,
                 shared_intermediate: int, routing: ExpertRouting, gemm: GroupedGemm, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(hidden, num_experts, top_k, intermediate, norm_topk, 0, gemm, dtype, device, tp, fmt)
        self.routing = routing
        self.gate = Float32Router(hidden, num_experts, routing.correction_bias, device)
        if shared_intermediate:  # every token, no gate (SparseMoe adds it where shared_expert_gate is None)
            self.shared_expert = SharedExpert(hidden, shared_intermediate, dtype, device, tp, fmt)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        kernel = r.scoring == "sigmoid" and self.rt.ops.router_kernel  # where the warm-up checked it
        if kernel and r.grouped:  # the logits' GEMM and the group-limited pick in one kernel
            out = sigmoid_route(h, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, r.n_group,
                                r.topk_group, self.norm_topk, r.routed_scaling_factor)
            if out is not None:
                return out
        logits = self.gate.logits(h, self.rt.ops.router_gemm_split)
        if kernel and not r.grouped:  # cuBLAS's logits, the pick in one pass (``ops.softmax_topk``)
            out = sigmoid_topk(logits, self.gate.e_score_correction_bias, self.top_k, self.norm_topk,
                               r.routed_scaling_factor)
            if out is not None:
                return out
        return self.route_logits(logits)

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path's routing of float32 router logits [T, E]."""
        r = self.routing
        return deepseek_route(logits, self.gate.e_score_correction_bias, self.top_k, r.scoring, r.n_group,
                              r.topk_group, self.norm_topk, r.routed_scaling_factor)

    def check_router_gemm(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether to take the router's logits from bf16 parts of its weight (``ops.split_gemm``):
        bf16 rows on the GPU, the logits agree with the float32 GEMM's (RuntimeError where not),
        and faster at 16,384 tokens."""
        if device.type != "cuda" or dtype != torch.bfloat16:
            return False
        self.gate.parts = split_gemm.check(self.gate.weight, self.gate.weight.shape[1], device)
        return split_gemm.faster(self.gate.weight, self.gate.parts)

    def check_router_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether to route with a kernel: it agrees with the torch path at this layer's router
        (three token counts; RuntimeError where it does not) and is faster than it at 16,384
        tokens. Group-limited routing: the logits and the pick in one kernel (``ops.moe_router``);
        one group (Moonlight, GLM-4.5, Kimi-K2): the pick from cuBLAS's logits in one pass
        (``ops.softmax_topk.pick``, its sigmoid routing). The kind follows from the config, so
        every rank asks the same question."""
        r = self.routing
        if r.scoring != "sigmoid":
            return False
        if not r.grouped:
            return softmax_topk.pick(self.gate, self.gate.weight.shape[1], self.top_k, self.norm_topk, device, dtype,
                                     sigmoid=(self.gate.e_score_correction_bias, r.routed_scaling_factor))
        g = torch.Generator(device="cpu").manual_seed(2)
        args = (self.gate.weight, self.gate.e_score_correction_bias, self.top_k, r.n_group, r.topk_group,
                self.norm_topk, r.routed_scaling_factor, self.route_logits)
        for t in (16, 300, 16384):  # (the last one fills an H100's or H200's SMs: the one timed)
            h = torch.randn(t, self.gate.weight.shape[1], generator=g).to(device, dtype)
            if not moe_router.check(h, *args):
                return False
        return moe_router.faster(h, *args)
