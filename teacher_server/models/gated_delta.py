"""The Gated DeltaNet mixer of the Qwen3.5 linear-attention layers.

One fused in-projection (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` of the
checkpoint as parts of one GEMM), the causal convolution + SiLU over the q/k/v channels, the
gates (``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)`` in float32), the
chunked gated delta rule, and the gated RMSNorm ``norm(o) * silu(z)`` per value head. The
out-projection is applied by the decoder layer (``o_proj``, fused with the residual add as
for the attention layers).

State (the KV pool's, Interface 1/2 of the engine): sequence b of the step starts from slot
``ctx.state_in[b]`` of this layer's convolution and recurrent states (slot 0: zeros, and no
gather at all when every sequence starts there); after the chunk the end state of sequence
``ctx.state_keep[j]`` is written to slot ``ctx.state_out[j]``. All initial states are
gathered (copied) before any end state is written, so a sequence may carry its state in place.

Tensor parallel: each rank holds a contiguous share of the key heads and the value heads they
serve (the grouping of value heads to key heads stays within a rank): its rows of q, k, v, z,
b and a, its channels of the convolution, its ``A_log`` / ``dt_bias`` entries, its heads'
states in the pool, and its input columns of ``o_proj`` (whose partial sums are all-reduced).
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear, Slice, copy_checked
from teacher_server.layers.norm import RMSNorm
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.runtime import RuntimeModule
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.conv_prep import conv_prep
from teacher_server.ops.gated_delta import LinearPlan, causal_conv1d, gated_delta_rule, make_plan
from teacher_server.step_context import StepContext


def linear_plan(ctx: StepContext) -> LinearPlan:
    """The step's plan for the linear layers, made by the first one (``ctx.linear_plan``)."""
    if ctx.linear_plan is None:
        keep = ctx.state_keep_host is not None and len(ctx.state_keep_host) > 0
        has_init = ctx.state_in_host is not None and any(ctx.state_in_host)
        ctx.linear_plan = make_plan(ctx.q_lens, ctx.cu_q, has_init, keep)
    return ctx.linear_plan


class InProjection(MergedColumnLinear):
    """The linear layer's fused in-projection, parts q, k, v (the checkpoint's one
    ``in_proj_qkv`` tensor, cut here), z, b and a, each split by heads across ranks."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                 fmt: WeightFormat = UNQUANTIZED) -> None:
        kd, vd, nv = spec.linear_key_dim, spec.linear_value_dim, spec.linear_num_value_heads
        dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        super().__init__(spec.hidden_size, {"q": kd, "k": kd, "v": vd, "z": vd, "b": nv, "a": nv}, False, dtype,
                         device, tp, units={"q": dk, "k": dk, "v": dv, "z": dv}, fmt=fmt)
        self.qkv_rows = {"q": (0, kd), "k": (kd, kd), "v": (2 * kd, vd)}  # of in_proj_qkv
        for sub, (start, n) in self.qkv_rows.items():
            self.fmt.check_shard(f"{sub} rows of in_proj_qkv", 0, start, n, 2 * kd + vd)

    def shards(self, param: str) -> int:
        return 4  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return None if part == "qkv" else super().checkpoint_slice(param, part)  # qkv: read whole, cut below

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        if part != "qkv":
            return super().load_weight(param, loaded, part, name)
        for sub, (start, n) in self.qkv_rows.items():
            super().load_weight(param, loaded.narrow(0, *self.fmt.span(param, 0, start, n)), sub, name)
        return None


class GatedDeltaNet(RuntimeModule):
    """[T, hidden] normed input -> [T, value_dim] gated-normed output (before ``o_proj``);
    with tensor parallel this rank's heads (see the module docstring)."""

    in_projection: type[InProjection] = InProjection  # how the checkpoint's in-projections are laid out

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.nk = tp.split(spec.linear_num_key_heads, "linear-attention key heads")
        self.nv = tp.split(spec.linear_num_value_heads, "linear-attention value heads")
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.full_key_dim = spec.linear_key_dim  # the checkpoint's convolution channels: q | k | v, all heads
        self.in_proj = self.in_projection(spec, dtype, device, tp, fmt)
        w = spec.linear_conv_kernel_dim
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, w, dtype=dtype, device=device),
                                        requires_grad=False)  # [D, W]; the checkpoint's conv1d.weight is [D, 1, W]
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.norm = RMSNorm(self.dv, spec.rms_norm_eps, dtype, device)  # plain weight * norm(x), per value head
        self.o_proj = RowLinear(spec.linear_value_dim, spec.hidden_size, dtype, device, tp, fmt)

    def shards(self, param: str) -> int:
        return 1

    def heads_shape(self) -> tuple[int, int, int, int]:
        """How ``forward`` calls ``linear_prep`` (``FusedOps.linear_heads``): this rank's key
        heads, key head dim, value heads, value head dim."""
        return self.nk, self.dk, self.nv, self.dv

    def gated_norm_shape(self) -> tuple[int, int, int, int]:
        """How ``forward`` calls the gated norm (``FusedOps.gated_norm_shape``): value heads, head
        dim, the in-projection's width and the first column of z in it."""
        return self.nv, self.dv, self.conv_dim + self.value_dim + 2 * self.nv, self.conv_dim

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        """``conv_weight`` (from [D, 1, W]), ``A_log``, ``dt_bias``: this rank's channels / heads
        of the whole checkpoint tensor."""
        if param == "conv_weight" and loaded.dim() == 3:
            loaded = loaded.squeeze(1)
        if self.tp.size > 1:
            r = self.tp.rank
            if param == "conv_weight":  # channels q | k | v of all heads -> this rank's of each
                kd, vd, fk = self.key_dim, self.value_dim, self.full_key_dim
                loaded = torch.cat([loaded.narrow(0, r * kd, kd), loaded.narrow(0, fk + r * kd, kd),
                                    loaded.narrow(0, 2 * fk + r * vd, vd)])
            else:
                loaded = loaded.narrow(0, r * self.nv, self.nv)
        copy_checked(getattr(self, param).data, loaded, name)

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h: normed input [T, hidden]; cs (rotary rows) is not used."""
        pool, t = self.rt.kv, h.shape[0]
        plan = linear_plan(ctx)
        proj = self.in_proj(h)  # [T, conv_dim + value_dim + 2 nv]
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
        conv_in = rec_in = None
        if plan.has_init:  # gathers are copies: read every initial state before writing any end state
            conv_in = pool.conv_state(self.layer_id)[ctx.state_in]  # [N, D, W]
            rec_in = pool.rec_state(self.layer_id)[ctx.state_in]  # [N, HV, K, V] float32
        if self.rt.ops.conv_kernel:  # the convolution and the stage below in one pass (CUDA)
            q, k, v, beta, g, conv_end = conv_prep(mixed, self.conv_weight, plan, conv_in, plan.keep, b, a, self.A_log,
                                                   self.dt_bias, self.nk, self.dk, self.nv, self.dv)
        else:
            y, conv_end = causal_conv1d(mixed, self.conv_weight, plan, conv_in, plan.keep)  # [T, conv_dim]
            # q, k L2-normed, q, k, v contiguous, beta, g [T, nv] float32: one compiled stage
            q, k, v, beta, g = self.rt.ops.linear_prep(y, b, a, self.A_log, self.dt_bias, self.nk, self.dk, self.nv,
                                                       self.dv)
        o, rec_end = gated_delta_rule(q, k, v, g, beta, plan, rec_in, plan.keep, qk_normed=True)
        if plan.keep:
            pool.conv_state(self.layer_id)[ctx.state_out] = conv_end[ctx.state_keep]
            pool.rec_state(self.layer_id)[ctx.state_out] = rec_end[ctx.state_keep]
        o = self.rt.ops.gated_rms_norm(o, z.view(t, self.nv, self.dv), self.norm.weight, self.norm.eps)
        return o.reshape(t, self.value_dim)
