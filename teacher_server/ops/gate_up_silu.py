"""gate_up_silu: the fused gate/up projection and SiLU-mul in one GEMM, [T, H] x [2I, H]^T
-> [T, I], so the [T, 2I] product is never written to memory and read back.

A persistent Triton kernel for Hopper (TMA loads, wgmma, a warp-specialised tile loop): each
tile of BM rows x BN output columns keeps two float32 accumulators, one over the gate rows
[n0, n0 + BN) of the weight and one over the matching up rows [I + n0, I + n0 + BN), and its
epilogue writes ``round(round(silu(round(g))) * round(u))``: the rounding of the two-pass path
(a bf16 GEMM output, then ``silu_mul``). What may differ from it: the GEMM's summation order,
and the epilogue's exp and division, the GPU's fast ones by default (``exact=False``: a few
float32 ulps before the bf16 rounding; ``exact=True`` takes libdevice's correctly rounded ones,
as ``silu_mul``'s expf and '/', and costs the epilogue more). At the Qwen3-8B and Qwen3-32B
shapes the default config gave the two-pass path's bits on every one of 1024 x I outputs, either
way (``bench/bench_fused_mlp.py``); the tests and the start-up check allow a few bf16 steps.

Measured (``bench/results/README.md``): the engine's W1 0.9%, W1f 1.5%, W3 1.1%, W4 1.6%
faster than cuBLAS's GEMM followed by the SiLU-mul kernel; the exact epilogue without warp
specialisation was 0.3% slower on W1, and is not the default.

``gate_up_silu`` returns None where the kernel does not apply (no Triton, not a Hopper GPU,
a shape it does not take); the caller then runs the GEMM and ``silu_mul``.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from teacher_server.ops.gelu_mul import gelu_tanh_mul
from teacher_server.ops.silu_mul import silu_mul_reference

log = logging.getLogger(__name__)

# (BM, BN, BK, stages, warps, group_m): BN columns of gate and BN of up per tile. The default
# ran fastest in the engine's position; the others are kept for the benchmark's sweep. Only
# 8-warp configs: with warp specialisation (the default loop) Triton 3.6 gave wrong values on
# about one tile in 1,500 with 64x128x64, 4 stages, 4 warps (NaN included:
# ``bench/results/fused_mlp_h200_3752d1f.json``) and did not compile 128x64x64, 4 stages, 4 warps.
CONFIGS = {
    "128x128x64s3": (128, 128, 64, 3, 8, 8),
    "128x128x64s4": (128, 128, 64, 4, 8, 8),
    "128x64x64s5": (128, 64, 64, 5, 8, 8),
    "128x128x128s2": (128, 128, 128, 2, 8, 8),
}
DEFAULT = "128x128x64s3"
ACTS = {"silu": False, "gelu_tanh": True}  # the epilogue's activation: the kernel's GELU switch


_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """The kernels, compiled on first use ({} when Triton with tensor descriptors is missing)."""
    if _K:
        return _K
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
        from triton.tools.tensor_descriptor import TensorDescriptor
    except Exception as e:  # no triton (the CPU wheel), or one without tensor descriptors
        log.info("fused gate/up SiLU kernel unavailable: %s: %s", type(e).__name__, e)
        _K["missing"] = True
        return _K

    # M (the step's tokens) differs from step to step: not specialised on. Tiles in grouped
    # order: GROUP_M row tiles take each weight tile in turn while it is in L2.
    @triton.jit(do_not_specialize=["M"])
    def fused(a_desc, b_desc, c_desc, M, I, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,  # noqa: E741
              GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
              EXACT: tl.constexpr, GELU: tl.constexpr):
        # EXACT: libdevice's correctly rounded exp and division, as the SiLU-mul kernel's expf
        # and '/'; else the GPU's fast ones (the default: a lighter epilogue). GELU: Gemma's
        # gelu_tanh(g) * u instead, as torch computes it (float32, libdevice's tanh)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(I, BN)
        per_group = GROUP_M * num_pid_n
        k_tiles = tl.cdiv(K, BK)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
            first_m = (tile // per_group) * GROUP_M
            size_m = min(num_pid_m - first_m, GROUP_M)
            om = (first_m + (tile % per_group) % size_m) * BM
            on = ((tile % per_group) // size_m) * BN
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for kt in range(k_tiles):
                ok = kt * BK
                a = a_desc.load([om, ok])
                acc_g = tl.dot(a, b_desc.load([on, ok]).T, acc_g)
                acc_u = tl.dot(a, b_desc.load([I + on, ok]).T, acc_u)
            g = acc_g.to(c_desc.dtype).to(tl.float32)
            u = acc_u.to(c_desc.dtype).to(tl.float32)
            if GELU:
                s = 0.5 * g * (1.0 + libdevice.tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g))))
            elif EXACT:
                s = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
            else:
                s = g / (1.0 + tl.exp(-g))
            s = s.to(c_desc.dtype).to(tl.float32)
            c_desc.store([om, on], (s * u).to(c_desc.dtype))

    @triton.jit(do_not_specialize=["M"])
    def plain(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr):
        # the same loop as one GEMM (calibration against cuBLAS): [M, K] x [N, K]^T -> [M, N]
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_pid_n
        k_tiles = tl.cdiv(K, BK)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN):
            first_m = (tile // per_group) * GROUP_M
            size_m = min(num_pid_m - first_m, GROUP_M)
            om = (first_m + (tile % per_group) % size_m) * BM
            on = ((tile % per_group) // size_m) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kt in range(k_tiles):
                ok = kt * BK
                acc = tl.dot(a_desc.load([om, ok]), b_desc.load([on, ok]).T, acc)
            c_desc.store([om, on], acc.to(c_desc.dtype))

    _K.update(fused=fused, plain=plain, desc=TensorDescriptor.from_tensor)
    return _K


@functools.cache
def _props(index: int) -> tuple[bool, int]:
    """(a Hopper GPU, its SM count) for a CUDA device index."""
    props = torch.cuda.get_device_properties(index)
    return props.major == 9, props.multi_processor_count


def _gpu(device: torch.device) -> tuple[bool, int]:
    return _props(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (cached per device)."""
    return _gpu(device)[1]


def eligible(h: torch.Tensor, w: torch.Tensor, bn: int = 128) -> bool:
    """Does the kernel take h [T, H] and w [2I, H]: CUDA bf16/fp16 on Hopper, contiguous, I a
    multiple of the tile width (a tile never mixes gate and up rows), 16-byte aligned rows."""
    return (h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and w.dtype == h.dtype and h.dim() == 2
            and w.dim() == 2 and h.shape[1] == w.shape[1] and w.shape[0] % (2 * bn) == 0 and h.shape[1] % 8 == 0
            and h.is_contiguous() and w.is_contiguous() and h.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and _gpu(h.device)[0]
            and "fused" in _kernels())


def _launch(kernel: str, h: torch.Tensor, w: torch.Tensor, cols: int, bn: int, config: str,
            **consts: bool) -> torch.Tensor:
    """out [T, cols] from kernel ``kernel`` over h [T, H] and w, in tiles of BM x ``bn``
    (BM, BK, stages, warps and grouping from ``config``), one program per SM."""
    bm, _, bk, stages, warps, group = CONFIGS[config]
    t = h.shape[0]
    out = torch.empty(t, cols, dtype=h.dtype, device=h.device)
    if t == 0:
        return out
    sms = sm_count(h.device)
    k = _kernels()
    d = k["desc"]
    k[kernel][(min(sms, -(-t // bm) * (cols // bn)),)](
        d(h, [bm, bk]), d(w, [bn, bk]), d(out, [bm, bn]), t, cols, h.shape[1], BM=bm, BN=bn, BK=bk, GROUP_M=group,
        NUM_SMS=sms, num_stages=stages, num_warps=warps, **consts)
    return out


def gate_up_silu(h: torch.Tensor, w: torch.Tensor, config: str = DEFAULT, flatten: bool = False,
                 warp_specialize: bool = True, exact: bool = False, act: str = "silu") -> torch.Tensor | None:
    """silu(h @ gate^T) * (h @ up^T) with w = [gate; up] ([2I, H]) (``act`` "gelu_tanh": Gemma's
    gelu_tanh in place of silu); None where it does not apply."""
    bn = CONFIGS[config][1]
    if not eligible(h, w, bn):
        return None
    return _launch("fused", h, w, w.shape[0] // 2, bn, config, FLATTEN=flatten, WS=warp_specialize, EXACT=exact,
                   GELU=ACTS[act])


def plain_gemm(h: torch.Tensor, w: torch.Tensor, config: str = DEFAULT, flatten: bool = False) -> torch.Tensor | None:
    """h @ w^T with the same kernel loop (BN doubled: the fused kernel's tile is BM x 2BN)."""
    bn = CONFIGS[config][1]
    if not eligible(h, w, bn):
        return None
    return _launch("plain", h, w, w.shape[0], 2 * bn, config, FLATTEN=flatten)


def check_gate_up_silu(hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                       act: str = "silu") -> bool:
    """Start-up check at the model's shapes: the kernel against the GEMM then act(g) * u on
    random inputs, every output within a few bf16 steps of it (NaN fails), and the same bits on
    a second call (a race would differ). Its token counts (1, one not a multiple of 16, and
    4096, which gives every SM several tiles) compile every variant Triton may specialise the
    launch for now rather than in the middle of serving. False where the kernel does not apply
    (no Triton, not Hopper, a width it does not take); RuntimeError on a mismatch."""
    w = torch.randn(2 * intermediate, hidden, device=device, dtype=dtype) * hidden ** -0.5
    for n in (1, 200, 4096):
        h = torch.randn(n, hidden, device=device, dtype=dtype)
        got = gate_up_silu(h, w, act=act)
        if got is None:
            return False
        ref = (silu_mul_reference if act == "silu" else gelu_tanh_mul)(h @ w.t()).float()
        bad = int((~((got.float() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-3)).sum())
        if bad:
            raise RuntimeError(f"gate_up_silu differs from the GEMM and SiLU-mul on {bad} of {got.numel()} outputs "
                               f"at {n} tokens")
        if not torch.equal(got, gate_up_silu(h, w, act=act)):
            raise RuntimeError(f"gate_up_silu gave other bits on a second call at {n} tokens")
    return True
