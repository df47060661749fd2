"""What the mixture-of-experts families share: the decoder layer whose MLP is the expert
layer (``layers.moe.SparseMoe``) or, where ``spec.is_moe_layer`` says no, the dense MLP; and
``MoeModel``, the mixin that maps expert checkpoint names (per-expert or stacked) onto the
stacked expert weights and checks the grouped GEMM at start-up."""

from __future__ import annotations

import re

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.moe import SparseMoe, expert_param
from teacher_server.layers.parallel import TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.llama import LlamaDecoderLayer
from teacher_server.models.norm import add_norm
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import GroupedGemm

# The grouped GEMM every expert layer of this process calls; its check result is a fact of
# (torch, device, dtype, shape), so one per process.
GROUPED_GEMM = GroupedGemm()

# "model.layers.N.<mlp | block_sparse_moe>.<rest>": Mixtral's hub checkpoints say block_sparse_moe.
_MLP = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)$")
_MLP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # any tensor of decoder layer N


class MoeDecoderLayer(LlamaDecoderLayer):
    """Attention then the expert layer (or the dense MLP in the model's dense layers)."""

    def make_mlp(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel, fmt: WeightFormat) -> nn.Module:
        self.sparse = spec.is_moe_layer(layer_id)
        if not self.sparse:
            return super().make_mlp(spec, layer_id, dtype, device, tp, fmt)
        return SparseMoe(spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                         spec.norm_topk_prob, spec.shared_expert_intermediate_size, GROUPED_GEMM, dtype, device, tp,
                         fmt)

    def mlp_residual(self, x: torch.Tensor, h: torch.Tensor,
                     ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sparse:  # the experts' output is combined already: a plain residual add
            return add_norm(x, self.mlp(h), self.next_norm, ops, self.next_reader)
        return super().mlp_residual(x, h, ops)


def warm_up_experts(ops: FusedOps, sparse: nn.Module, hidden: int, device: torch.device, dtype: torch.dtype) -> None:
    """An expert layer's start-up checks and picks: SiLU-mul and the combine, the shared expert's
    fused gate/up, torch's grouped GEMM at both expert shapes, then the fused expert gate/up, the
    grouping kernels and the router kernel where they are right and faster (each falls back
    alone, with one log line)."""
    i = sparse.experts.i_local
    ops.check_experts(i, hidden, sparse.top_k, device, dtype)
    check_shared_expert(ops, sparse, hidden, device, dtype)
    GROUPED_GEMM.use_torch(device, dtype, shapes=((hidden, 2 * i), (i, hidden)))
    pick_gate_up(ops, sparse, dtype)


def check_shared_expert(ops: FusedOps, sparse: nn.Module, hidden: int, device: torch.device,
                        dtype: torch.dtype) -> None:
    """The fused gate/up kernel at the shared expert's width, where the layer has one."""
    shared = getattr(sparse, "shared_expert", None)
    if shared is not None:
        ops.check_gate_up_width(hidden, shared.gate_up_proj.parts["gate"][1], device, dtype)


def pick_gate_up(ops: FusedOps, sparse: nn.Module, dtype: torch.dtype) -> None:
    """The fused expert gate/up kernel where it is right and faster at this layer's expert shapes
    (``FusedOps.pick_moe_gate_up``; the ``SparseMoe`` layers, plain weights only), the counting
    kernels for the expert rows' grouping, and the router kernel where its check passes at this
    layer's router."""
    w = sparse.experts.fmt.dense(sparse.experts, "gate_up") if isinstance(sparse, SparseMoe) else None
    device, ex = sparse.gate.weight.device, sparse.experts
    if w is not None:
        ops.pick_moe_gate_up(w, sparse.top_k, GROUPED_GEMM, sparse.experts.num_experts)
    elif isinstance(sparse, SparseMoe):  # FP8 experts: the format's fused kernel where its check passes
        ops.decide("fp8_moe_kernel", "fused FP8 expert gate/up",
                   lambda: ex.fmt.check_fused_gate_up(ex, sparse.top_k), device)
    ops.pick_group(ex.num_local + (ex.ep.size > 1), sparse.top_k, device)  # (per rank: the same rows either way)
    if hasattr(sparse, "check_router_kernel"):  # SparseMoe's softmax routers, DeepSeek's sigmoid one
        ops.check_router(sparse, device, dtype)
        ops.router_kernel = agreed(sparse.tp, ops.router_kernel, device)
    if hasattr(sparse, "check_router_gemm"):  # DeepSeek's float32 router: its logits from bf16 parts
        ops.check_router_gemm(sparse, device, dtype)
        ops.router_gemm_split = agreed(sparse.tp, ops.router_gemm_split, device)
        if not ops.router_gemm_split:  # (the check's parts, of no use now)
            sparse.gate.parts = None


def agreed(tp: TensorParallel, on: bool, device: torch.device) -> bool:
    """``on`` where every rank of ``tp`` says so: ranks route every token alike, so a router
    kernel that one rank's timing turned on and another's not would pick different experts for a
    float32-noise tie on each, and the ranks' partial sums would not add up to one routing."""
    if tp.size == 1:
        return on
    flag = torch.tensor([1.0 if on else 0.0], device=device)
    return bool(tp.all_reduce(flag).item() == tp.size)


class MoeModel:
    """Mixin (before a ``LlamaForCausalLM`` subclass in the bases) for the expert families."""

    decoder_layer = MoeDecoderLayer

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        """Expert weights go to ``layers.N.mlp.experts`` (see ``layers.moe.expert_param``);
        ``block_sparse_moe`` is read as ``mlp``; everything else as the dense families.
        A zero-width shared expert's tensors (shape [0, ...]) and its gate are not read."""
        m = _MLP.match(hf_name)
        if m:
            layer, rest = m.groups()
            if rest.startswith("shared_expert") and not self.spec.shared_expert_intermediate_size:  # type: ignore[attr-defined]
                return None  # a shared expert of width 0 (and its gate) adds exactly nothing, as in transformers
            if rest.startswith("experts."):
                place = expert_param(rest.removeprefix("experts."))
                if place is not None:
                    return f"layers.{layer}.mlp.experts", *place
            hf_name = f"model.layers.{layer}.mlp.{rest}"
        return super().checkpoint_param(hf_name)  # type: ignore[misc]

    def multi_token_prediction(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is a tensor of the ``mtp_layers`` multi-token-prediction layers after
        the last (``model.layers.<num_hidden_layers + i>``: DeepSeek-V3's, GLM-4.5's), not for
        scoring; a layer past those has no place, refused as a config/weights mismatch."""
        m = _MLP_LAYER.match(hf_name)
        spec: ModelSpec = self.spec  # type: ignore[attr-defined]
        return m is not None and 0 <= int(m.group(1)) - spec.num_layers < spec.mtp_layers

    def check_checkpoint(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The loader's look at the checkpoint's tensors before reading them: a shared expert with
        weights where config.json says it has none (width 0, or a family without one) would be
        passed over, and another model served; transformers refuses it too (a size mismatch)."""
        if self.spec.shared_expert_intermediate_size:  # type: ignore[attr-defined]
            return
        for name, shape in shapes.items():
            m = _MLP.match(name)
            if m and m.group(2).startswith(("shared_expert.", "shared_experts.")) and all(shape):
                raise ValueError(f"checkpoint tensor {name} is {list(shape)}, a shared expert's weights, but "
                                 "config.json gives no shared expert (shared_expert_intermediate_size is 0 or unset)")

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The dense stages' checks, then the expert layers' (``warm_up_experts``)."""
        super().warm_up_ops(ops, ropes)  # type: ignore[misc]
        spec: ModelSpec = self.spec  # type: ignore[attr-defined]
        sparse = next((layer.mlp for layer in self.layers if layer.sparse), None)  # type: ignore[attr-defined]
        if sparse is None:
            return
        device, dtype = next(iter(ropes.values())).table.device, self.dtype  # type: ignore[attr-defined]
        warm_up_experts(ops, sparse, spec.hidden_size, device, dtype)
