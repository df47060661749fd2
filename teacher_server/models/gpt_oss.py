"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b and -120b): the Llama decoder with

- attention: q/k/v and o biases, a learned sink logit per query head (``attention.sinks``),
  sliding-window (128) and full layers alternating as ``layer_types`` says, YaRN rotary;
- the expert MLP of ``layers.gpt_oss_moe`` (biased router, experts with biases and the
  clamped SwiGLU, interleaved gate/up in the checkpoint, MXFP4 or plain expert weights).

Checkpoint names: ``mlp.router`` is the expert layer's router (``gate`` here);
``mlp.experts.{gate_up_proj,down_proj}`` with ``_bias``, ``_blocks`` and ``_scales`` go to
the stacked experts; ``self_attn.sinks`` to the attention layer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from teacher_server.cache_layout import AttentionParams
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.gpt_oss_moe import GptOssMoe
from teacher_server.layers.linear import RowLinear, copy_checked
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.llama import LlamaAttention, LlamaForCausalLM
from teacher_server.models.moe import GROUPED_GEMM, MoeDecoderLayer, MoeModel
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.checks import assert_close
from teacher_server.ops.clamped_swiglu import clamped_swiglu
from teacher_server.ops.fused import FusedOps
from teacher_server.step_context import StepContext

# "model.layers.N.mlp.experts.<gate_up_proj | down_proj>[_bias | _blocks | _scales]"
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:_(bias|blocks|scales))?$")


class BiasedRowLinear(RowLinear):
    """The o projection with its bias (``out_bias``, added once to the all-reduced sum: not
    named ``bias``, which the weight formats would add on every rank)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(in_features, out_features, dtype, device, tp, fmt)
        self.out_bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return super().forward(a) + self.out_bias

    def add_into(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        if self.tp.rank == 0:  # rank 0's x is the residual the others' partial sums are added to
            x.add_(self.out_bias)
        return super().add_into(x, a)


class GptOssAttention(LlamaAttention):
    """Llama attention (q/k/v bias through the fused projection) with a biased o projection
    and a sink logit per query head ([this rank's q heads] float32), taken by the backend."""

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, dtype, device, tp, fmt)
        self.params = AttentionParams(self.params.scale, self.params.window, sinks=True)
        if spec.attention_bias:  # (attention_bias=false: no bias on q, k, v or o, as transformers builds it)
            self.o_proj = BiasedRowLinear(spec.q_size, spec.hidden_size, dtype, device, tp, fmt)
        self.q_start = tp.rank * self.heads.n_q  # this rank's first query head
        self.sinks = nn.Parameter(torch.empty(self.heads.n_q, dtype=torch.float32, device=device),
                                  requires_grad=False)

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.sinks.data, loaded[self.q_start:self.q_start + self.heads.n_q].float(), name)

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        rt = self.rt
        qkv = self.qkv_proj(h)  # [T, (n_q + 2 n_kv) d]
        q, k, v = rt.ops.qkv_store(qkv, cs, self.heads, None, None, rt.kv, self.layer_id, ctx)
        return self.attend(q, k, v, ctx, self.sinks).reshape(q.shape[0], -1)


class GptOssDecoderLayer(MoeDecoderLayer):
    """Attention with sinks, then gpt-oss's expert MLP (every layer routes)."""

    def make_mlp(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel, fmt: WeightFormat) -> nn.Module:
        self.sparse = True
        return GptOssMoe(spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                         spec.swiglu_alpha, spec.swiglu_limit, GROUPED_GEMM, dtype, device, tp, fmt)


class GptOssForCausalLM(MoeModel, LlamaForCausalLM):
    attention = GptOssAttention
    decoder_layer = GptOssDecoderLayer

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        m = _EXPERTS.match(hf_name)
        if m:
            layer, proj, suffix = m.groups()
            where = f"layers.{layer}.mlp.experts"
            if suffix == "bias":
                return where, f"{proj}_bias", None
            return where, proj, suffix or "hf"  # a packed pair's half, or transformers' [E, in, out]
        if hf_name.endswith(".self_attn.o_proj.bias"):
            return hf_name.removeprefix("model.").removesuffix(".bias"), "out_bias", None
        return super().checkpoint_param(hf_name.replace(".mlp.router.", ".mlp.gate."))

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The shared and expert checks, the expert activation's kernel (expert parallel's), then
        the compiled expert activation against its eager definition at two token counts (the
        static, then the dynamic graph): a mismatch runs every compiled stage eagerly, as the
        shared checks do."""
        super().warm_up_ops(ops, ropes)
        ex = self.layers[0].mlp.experts
        ops.check_swiglu(ex.gate_up_bias, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        if not ops.compiled:
            return
        dev = ex.gate_up_bias.device
        try:
            for n in (16, 40):
                gu = 4 * torch.randn(n, ex.gate_up_bias.shape[1], device=dev, dtype=self.dtype)  # past the clamp
                # ids into this rank's bias rows (expert parallel: E / size of them; a global id
                # past them is a device-side assert on CUDA, which no fallback survives)
                rows = torch.randint(0, ex.gate_up_bias.shape[0], (n,), device=dev)
                args = (gu, ex.gate_up_bias, rows, self.spec.swiglu_alpha, self.spec.swiglu_limit)
                assert_close("compiled clamped_swiglu", ops.clamped_swiglu(*args), clamped_swiglu(*args))
        except Exception as e:
            ops.eager_stages(e)
