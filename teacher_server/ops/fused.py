"""FusedOps: the per-layer stages of the forward and the two independent switches that pick
how they run.

- ``kernels``: our CUDA and Triton kernels (``SWITCHES``: SiLU-mul, the fused QKV/rotary/KV
  write, the fused gate/up GEMMs, the Gated DeltaNet input stage, the expert layers' combine,
  gate/up, grouping and router) and the residual add inside the o/down GEMM.
- ``compile``: the elementwise stages (``_STAGES``: norms, the QKV and linear-layer input
  stages, gated norms and activations) through ``torch.compile`` (dynamic shapes: one graph
  for every token count), each one or two fused kernels instead of a chain of passes.

A compile that fails (when built, in the start-up check, or at run time) turns off the
compiled stages alone, which then run eagerly; a kernel that fails its start-up check turns
off that kernel alone. The CPU runs everything eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from teacher_server.ops import extension, moe_gate_up, moe_group
from teacher_server.ops.checks import assert_close
from teacher_server.ops.clamped_swiglu import check_clamped_swiglu_kernel, clamped_swiglu, clamped_swiglu_kernel
from teacher_server.ops.conv_prep import check_conv_prep
from teacher_server.ops.gate_up_silu import check_gate_up_silu, gate_up_silu
from teacher_server.ops.gated_delta import linear_prep
from teacher_server.ops.gelu_mul import gelu_tanh_mul
from teacher_server.ops.guarded import Guarded
from teacher_server.ops.mla_prep import mla_expand, mla_prep
from teacher_server.ops.moe_combine import check_moe_combine
from teacher_server.ops.norm import add_rms_norm, gated_rms_norm, norm_add, norm_add_rms_norm, rms_norm
from teacher_server.ops.partial_rope import gated_qk_prep, partial_qk_prep, sigmoid_gate
from teacher_server.ops.qkv_rope import HeadLayout, KVStore, check_qkv_rope, qkv_prep, qkv_rope
from teacher_server.ops.row_end import before_end
from teacher_server.ops.silu_mul import check_silu_mul, silu_mul, silu_mul_rows

if TYPE_CHECKING:
    from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)


_STAGES: dict[str, Callable] = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "qkv_prep": qkv_prep,
                                "gated_rms_norm": gated_rms_norm, "linear_prep": linear_prep,
                                "gelu_tanh_mul": gelu_tanh_mul, "partial_qk_prep": partial_qk_prep,
                                "norm_add_rms_norm": norm_add_rms_norm, "norm_add": norm_add,
                                "clamped_swiglu": clamped_swiglu, "mla_prep": mla_prep, "mla_expand": mla_expand,
                                "gated_qk_prep": gated_qk_prep, "sigmoid_gate": sigmoid_gate}


_GATE_UP = {"silu": "gate_up_kernel", "gelu_tanh": "gate_up_gelu_kernel"}  # the fused gate/up kernel's switches
# the kernels' switches (each on or off after the warm-up's checks and picks)
SWITCHES = ("silu_kernel", "qkv_kernel", "conv_kernel", "gate_up_kernel", "gate_up_gelu_kernel", "combine_kernel",
            "moe_gate_up_kernel", "router_kernel", "group_kernel", "swiglu_kernel", "router_gemm_split",
            "gated_qk_kernel", "fp8_moe_kernel")


class FusedOps:
    """The stage functions a layer calls (``rms_norm``, ``add_rms_norm``, ``gated_rms_norm``,
    ``linear_prep``, ``silu_mul``, ``qkv_store``) and the switches behind them.
    ``kernels_available`` says whether the CUDA library loads (injectable, so the switches can
    be exercised on the CPU, where every op still takes its torch reference)."""

    # the stages of ``_STAGES``, eager or compiled (``_use``)
    rms_norm: Callable
    add_rms_norm: Callable
    qkv_prep: Callable
    gated_rms_norm: Callable
    linear_prep: Callable
    clamped_swiglu: Callable  # gpt-oss's expert activation (``ops.clamped_swiglu``)
    gelu_tanh_mul: Callable
    partial_qk_prep: Callable
    norm_add_rms_norm: Callable
    norm_add: Callable  # Gemma's post-norm and residual add on a pipeline stage's last layer
    mla_prep: Callable  # latent attention's latent and rotated q (``ops.mla_prep``)
    mla_expand: Callable  # latent attention's keys and values from kv_b_proj's output
    gated_qk_prep: Callable  # Qwen3.5's gated attention: q, k normed and partly rotated, v, into slack buffers
    sigmoid_gate: Callable  # Qwen3.5's output gate: o * sigmoid(gate)

    def __init__(self, kernels: bool, compile: bool,
                 kernels_available: Callable[[], bool] = extension.available) -> None:
        self._use(_STAGES)
        # the gated norm's shape as the layer calls it, checked (and compiled) at warm-up: heads, head
        # dim, and the gate's place in its row (the in-projection's width, the gate's first column)
        self.gated_norm_shape: tuple[int, int, int, int] | None = None
        # the linear layers' heads as ``linear_prep`` is called: key heads, key dim, value heads, value dim
        self.linear_heads: tuple[int, int, int, int] | None = None
        loaded = self._loaded = kernels and kernels_available()
        self.silu_kernel = loaded  # SiLU-mul CUDA kernel
        self.swiglu_kernel = loaded  # gpt-oss's expert activation where the rows have an end, after its check
        self.combine_kernel = loaded  # the expert layer's weighted sum (``ops.moe_combine``), after its check
        # the experts' gather, gate/up grouped GEMM and SiLU-mul in one Triton kernel: ``pick_moe_gate_up``
        self.moe_gate_up_kernel = False
        self.fp8_moe_kernel = False  # the same for FP8 experts (``ops.fp8_moe``), where the warm-up's check passes
        self.moe_gate_up_config = moe_gate_up.CONFIG  # the tiles the warm-up found fastest
        # the router in one Triton kernel (``ops.moe_router``, ``ops.softmax_topk``): ``check_router``
        self.router_kernel = False
        self.group_kernel = False  # expert rows grouped by counting (``ops.moe_group``), off until ``pick_group``
        self.router_gemm_split = False  # float32 router logits from bf16 parts (ops.split_gemm): check_router_gemm
        self._kernels = kernels
        self.qkv_kernel = loaded  # the fused QKV/rotary/KV-write CUDA kernel, where it applies
        self.residual_in_gemm = kernels  # residual add in the o/down GEMM epilogue (addmm_, in place)
        # the gate/up GEMM and SiLU-mul (Gemma: gelu_tanh) in one Triton kernel (``ops.gate_up_silu``;
        # Hopper only, after each one's start-up check at the model's shapes: ``check_gate_up``)
        self.gate_up_kernel = self.gate_up_gelu_kernel = kernels
        self._refused: set[str] = set()  # the gate/up switches a check (or ``refuse``) turned off for good
        self._widths: set[tuple[int, int]] = set()  # (hidden, width) the SiLU one was checked at
        # the Gated DeltaNet input stage in one Triton pass (``ops.conv_prep``; CUDA, after ``check_conv_kernel``)
        self.conv_kernel = kernels
        self.gated_qk_kernel = False  # Qwen3.5's gated attention input in one Triton pass: ``pick_gated_qk``
        self.fp8_norm_input = True  # FP8 q/k/v, gate/up inputs quantized in the norm's pass (WeightFormat.norm_input)
        self.compiled = False
        if compile:
            try:
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                staged = {n: Guarded(torch.compile(f, fullgraph=True), f) for n, f in _STAGES.items()}
            except Exception as e:  # no triton / inductor: the eager stages are correct, only slower
                log.warning("torch.compile unavailable (%s); the elementwise stages run eagerly", e)
            else:
                self._use(staged)
                self.compiled = True

    def use_qkv_kernel(self, on: bool) -> None:
        """Switch the fused QKV/rotary/KV-write kernel off (a family whose q/k preparation it
        does not do: partial rotary, an output gate), or back on where it loaded."""
        self.qkv_kernel = on and self._loaded

    def use_residual_in_gemm(self, on: bool) -> None:
        """The residual add in the o/down GEMM's epilogue, or a separate add (an ablation)."""
        self.residual_in_gemm = on

    def refuse(self, switch: str) -> None:
        """A kernel switch off for good (a family it does not fit): no later check turns it on."""
        setattr(self, switch, False)
        self._refused.add(switch)

    def expect_linear_layers(self, gated_norm_shape: tuple[int, int, int, int],
                             heads: tuple[int, int, int, int]) -> None:
        """The shapes a hybrid model's linear layers call the gated norm and ``linear_prep``
        at, for the start-up check (``warm_up``) to compile and check them there."""
        self.gated_norm_shape, self.linear_heads = gated_norm_shape, heads

    def silu_mul(self, gate_up: torch.Tensor, end: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up; with ``end`` (an expert-parallel rank's row end,
        int32 [1] on the device) the rows after it are not needed (``ops.row_end``)."""
        return silu_mul(gate_up, end) if self.silu_kernel else silu_mul_rows(gate_up, end)

    def expert_swiglu(self, gate_up: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, alpha: float,
                      limit: float, end: torch.Tensor | None = None) -> torch.Tensor:
        """gpt-oss's expert activation [M, 2I] -> [M, I] (``ops.clamped_swiglu``; the stage,
        compiled or eager); with ``end`` as ``silu_mul``'s, the CUDA kernel on the rows before it."""
        if end is not None and self.swiglu_kernel:
            out = clamped_swiglu_kernel(gate_up, bias, rows, alpha, limit, end)
            if out is not None:
                return out
        return before_end(lambda g, r: self.clamped_swiglu(g, bias, r, alpha, limit), gate_up, end,
                          gate_up.shape[1] // 2, rows)

    def gate_up_act(self, h: torch.Tensor, w: torch.Tensor, act: str = "silu") -> torch.Tensor | None:
        """silu(h gate^T) * (h up^T) (``act`` "gelu_tanh": Gemma's), w = [gate; up] ([2I, H]), in one
        kernel: [T, I]; None where it does not run (the caller runs the GEMM and the activation)."""
        return gate_up_silu(h, w, act=act) if getattr(self, _GATE_UP[act]) else None

    def check_gate_up(self, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                      act: str = "silu") -> None:
        """Check (and compile) the fused gate/up kernel with ``act`` at the model's shapes (when on);
        where it does not apply or fails, it is off (a failure logs a line: the two passes are correct)."""
        switch = _GATE_UP[act]
        if not getattr(self, switch):
            return
        if act == "silu":
            self._widths.add((hidden, intermediate))
        try:
            setattr(self, switch, check_gate_up_silu(hidden, intermediate, device, dtype, act))
        except Exception as e:
            log.warning("fused gate/up %s kernel disabled: %s: %s", act, type(e).__name__, e)
            setattr(self, switch, False)
            self._refused.add(switch)
        if getattr(self, switch):
            log.info("fused gate/up %s kernel on (hidden %d, intermediate %d)", act, hidden, intermediate)

    def check_gate_up_width(self, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype) -> None:
        """The fused SiLU gate/up kernel at a second width it runs at (a shared expert's), once per
        width: a mismatch turns it off everywhere, for good; a width it does not take is left to the
        two passes, call by call, and one it takes turns it on where the first did not take it (GLM's
        dense layers, 10,944 wide), the kernel then running at the widths it takes."""
        if not self._kernels or "gate_up_kernel" in self._refused or (hidden, intermediate) in self._widths:
            return
        self._widths.add((hidden, intermediate))
        on, self.gate_up_kernel = self.gate_up_kernel, True
        self.check_gate_up(hidden, intermediate, device, dtype)
        self.gate_up_kernel = "gate_up_kernel" not in self._refused and (on or self.gate_up_kernel)

    def qkv_store(self, qkv: torch.Tensor, cs: torch.Tensor, heads: HeadLayout, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, kv: KVStore, layer: int,
                  ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, n_q, d], k, v [T, n_kv, d] from the fused QKV output [T, width] and the
        step's rotary rows cs [T, d]; this step's k and v go into the KV pool where the
        scheduler asked for it: one CUDA kernel when it can, else the torch stages."""
        if self.qkv_kernel:
            out = qkv_rope(qkv, cs, q_norm, k_norm, heads, *kv.store_target(layer, ctx))
            if out is not None:
                return out
        half = heads.d // 2
        q, k, v = self.qkv_prep(qkv, cs[:, None, :half], cs[:, None, half:], q_norm, k_norm, heads.n_q, heads.n_kv,
                                heads.d, heads.eps)
        kv.store(layer, k, v, ctx)
        return q, k, v

    def check_silu(self, width: int, device: torch.device, dtype: torch.dtype) -> None:
        """Check the SiLU-mul kernel at ``width`` (when on); a failure switches it off, with
        one log line (the reference is correct, only slower)."""
        self._check_kernel("silu_kernel", "SiLU-mul", check_silu_mul, width, device, dtype)

    def check_experts(self, width: int, hidden: int, top_k: int, device: torch.device, dtype: torch.dtype) -> None:
        """Check an expert layer's kernels: SiLU-mul at the experts' ``width`` and the combine at
        ``hidden`` and ``top_k`` (when on); a failure switches that kernel off, with one log line."""
        self.check_silu(width, device, dtype)
        self._check_kernel("combine_kernel", "MoE combine", check_moe_combine, hidden, top_k, device, dtype)

    def pick_moe_gate_up(self, w: torch.Tensor, top_k: int, gemm: Callable, total: int) -> None:
        """The fused expert gate/up kernel on, at the tiles ``ops.moe_gate_up.pick`` finds fastest,
        where it matches the two-pass path at a layer's expert weights ``w`` [E, 2I, H] (of ``total``
        experts) and beats it (timed with this object's SiLU-mul). Each rank picks for itself."""
        def pick() -> bool:
            config = moe_gate_up.pick(w, top_k, gemm, act=self.silu_mul, total=total)
            self.moe_gate_up_config = config or moe_gate_up.CONFIG
            return config is not None
        self.decide("moe_gate_up_kernel", "fused expert gate/up", pick, w.device)

    def check_router(self, layer: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """The router as one kernel where ``layer``'s check (``check_router_kernel``) passes."""
        self.decide("router_kernel", "router", lambda: layer.check_router_kernel(device, dtype), device)

    def check_router_gemm(self, layer: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """The float32 router logits from bf16 parts where ``layer.check_router_gemm`` passes."""
        self.decide("router_gemm_split", "split router GEMM", lambda: layer.check_router_gemm(device, dtype), device)

    def pick_group(self, buckets: int, k: int, device: torch.device) -> None:
        """The counting kernels group the expert rows where right and faster (``ops.moe_group.pick``)."""
        self.decide("group_kernel", "expert grouping", lambda: moe_group.pick(buckets, k, device), device)

    def decide(self, switch: str, name: str, decide: Callable[[], bool], device: torch.device) -> None:
        """``switch`` = decide() on CUDA with the kernels on; a failure leaves it off (one log line)."""
        if not self._kernels or device.type != "cuda":
            return
        try:
            setattr(self, switch, bool(decide()))
        except Exception as e:
            log.warning("%s kernel off: %s: %s", name, type(e).__name__, e)
            setattr(self, switch, False)

    def check_swiglu(self, bias: torch.Tensor, alpha: float, limit: float) -> None:
        """Check gpt-oss's expert activation kernel at the experts' width (``bias`` [E, 2I]; when
        on); a failure switches it off, with one log line (the stage is correct, only reads
        every row)."""
        self._check_kernel("swiglu_kernel", "clamped SwiGLU", check_clamped_swiglu_kernel, bias, alpha, limit)

    def _check_kernel(self, switch: str, name: str, check: Callable[..., None], *args: object) -> None:
        """``check(*args)`` where the kernel's ``switch`` is on; a failure turns it off."""
        if getattr(self, switch):
            try:
                check(*args)
            except Exception as e:
                log.warning("%s kernel disabled: %s", name, e)
                setattr(self, switch, False)

    def check_conv_kernel(self, nk: int, dk: int, nv: int, dv: int, kernel: int, device: torch.device,
                          dtype: torch.dtype) -> None:
        """Check the fused Gated DeltaNet input stage at the model's shapes (when on; CUDA
        only): a failure switches it off, with one log line (the two-pass path is correct)."""
        self.conv_kernel = self.conv_kernel and device.type == "cuda"
        self._check_kernel("conv_kernel", "fused Gated DeltaNet input", check_conv_prep, nk, dk, nv, dv, kernel, device,
                           dtype)

    def pick_gated_qk(self, decide: Callable[[], bool], device: torch.device) -> None:
        """Qwen3.5's gated attention input as one kernel where ``decide`` (``ops.gated_qk.pick``) says so."""
        self.decide("gated_qk_kernel", "gated attention input", decide, device)

    def warm_up(self, heads: HeadLayout, hidden: int, intermediate: int, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, cos_sin: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        """Compile the stages now (two token counts: a static then a dynamic graph) and check
        every switched-on stage against its reference at the model's shapes; a compiled stage
        that fails turns the compiled stages off, a kernel that fails turns that kernel off."""
        if self.compiled:
            t0 = time.perf_counter()
            try:
                self._check_compiled(heads, hidden, q_norm, k_norm, cos_sin, device, dtype)
                log.info("compiled fused elementwise stages in %.1fs", time.perf_counter() - t0)
            except Exception as e:
                self.eager_stages(e)
        self.check_silu(intermediate, device, dtype)
        self.check_gate_up(hidden, intermediate, device, dtype)
        if self.qkv_kernel:
            try:
                check_qkv_rope(heads, q_norm, k_norm, cos_sin, device, dtype)
            except Exception as e:  # the torch stages are correct, only slower
                log.warning("fused QKV kernel disabled: %s", e)
                self.qkv_kernel = False

    def eager_stages(self, err: Exception) -> None:
        """Run the compiled stages eagerly from now on (the kernels are not affected)."""
        log.warning("compiled elementwise stages failed (%s: %s); running them eagerly", type(err).__name__, err)
        self._use(_STAGES)
        self.compiled = False

    def _use(self, stages: dict[str, Callable]) -> None:
        """Call ``stages`` (one function per name of ``_STAGES``) from now on."""
        for name, f in stages.items():
            setattr(self, name, f)

    def _check_compiled(self, heads: HeadLayout, hidden: int, q_norm: torch.Tensor | None,
                        k_norm: torch.Tensor | None, cos_sin: torch.Tensor, device: torch.device,
                        dtype: torch.dtype) -> None:
        half = heads.d // 2
        for n in (16, 40):
            x = torch.randn(n, hidden, device=device, dtype=dtype)
            w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
            qkv = torch.randn(n, heads.width, device=device, dtype=dtype)
            cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]
            args = {
                "rms_norm": (x, w, heads.eps),
                "add_rms_norm": (x, x.flip(0), w, heads.eps),
                "qkv_prep": (qkv, cs[:, None, :half], cs[:, None, half:], q_norm, k_norm, heads.n_q, heads.n_kv,
                             heads.d, heads.eps),
            }
            if self.gated_norm_shape is not None:  # o [T, H, D]; the gate a column slice, strided as the layer's
                gh, gd, width, first = self.gated_norm_shape
                wide = torch.randn(n, width, device=device, dtype=dtype)
                o = torch.randn(n, gh, gd, device=device, dtype=dtype)
                gw = 1 + 0.1 * torch.randn(gd, device=device, dtype=dtype)
                args["gated_rms_norm"] = (o, wide[:, first:first + gh * gd].view(n, gh, gd), gw, heads.eps)
            if self.linear_heads is not None:  # y contiguous (the convolution's output), b and a strided
                nk, dk, nv, dv = self.linear_heads
                y = torch.randn(n, 2 * nk * dk + nv * dv, device=device, dtype=dtype)
                ba = torch.randn(n, 2 * nv + 3, device=device, dtype=dtype)
                a_log, dt_bias = (torch.randn(nv, device=device, dtype=dtype) for _ in range(2))
                args["linear_prep"] = (y, ba[:, 1:1 + nv], ba[:, 2 + nv:2 + 2 * nv], a_log, dt_bias, nk, dk, nv, dv)
            for name, a in args.items():
                got, ref = getattr(self, name)(*a), _STAGES[name](*a)
                for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                    assert_close(f"compiled {name}", g, r)
                if name == "linear_prep" and not all(x.is_contiguous() for x in got[:3]):
                    log.warning("compiled linear_prep returns strided q/k/v; fla-core will copy them")
