"""fp8_moe: the FP8 experts' gate/up product, SiLU-mul and the down product's input
quantization in one Triton kernel, the FP8 counterpart of ``ops.moe_gate_up``:

    q[r], s[r] = quantize_1x128(silu(x[tokens[r]] gate_e^T) * (x[tokens[r]] up_e^T))

for the rows r of expert e (sorted by expert, ``offs`` their cumulative ends). x is the
layer's input already in e4m3 ([T, K], quantized once per token by the norm's pass), read
where it is by token (no gathered copy), with per-row scales [T] (``--quantization fp8``,
compressed-tensors' dynamic tokens) or 1x128 groups [T, K/128] (block checkpoints); the weights
[E, 2I, K] e4m3 (gate rows, then up rows) with per-channel [E, 2I] or 128x128 block scales
[E, 2I/128, K/128]. The [M, 2I] bf16 product never reaches memory: the path it replaces
(``gather_input``, ``ops.fp8_grouped``'s multiply, ``ops.fp8.silu_mul_quant``) writes and reads
it back, and gathers the rows first.

Each program takes BM rows of one expert and one 128-wide group of I: 128 gate columns and
the matching up columns (two float32 accumulators), so the 1x128 activation group of its
output is whole in the program, and its scale is written beside its codes (M-major, as
``fp8_quant.group_buffers`` lays them out; with per-channel weights the scales are powers of two
and ``rows_of_groups`` takes the groups per row for the down product; with block weights
``ops.fp8_grouped`` multiplies the groups). Rounding is the two-pass path's step for step: the
product scaled as ``ops.fp8_grouped`` scales it, rounded to the model dtype, silu rounded, the
product rounded, then ``fp8_quant``'s group quantization (``div_rn``, clamp, e4m3), so the two
agree to the tensor cores' accumulation order (``check``).

Blocks of rows are numbered per expert as ``ops.moe_gate_up`` numbers them (no host sync);
rows past the last row end (another expert-parallel rank's) are not written. I and K must be
multiples of 128.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import os
from typing import Any

import torch

from teacher_server.ops import fp8, fp8_grouped, fp8_quant
from teacher_server.ops.fp8_mm import AMAX_FLOOR, FP8_MAX
from teacher_server.ops.fp8_quant import group_buffers
from teacher_server.ops.guarded import FirstLaunch
from teacher_server.ops.moe_gate_up import _routing, block_experts, expert_blocks
from teacher_server.ops.triton_kernels import lazy

GROUP = 128  # the activation group, the weight block, the K step and the tile's columns
# (BM, warps, stages). At Qwen3-30B-A3B's experts on an H100 (bench/bench_fp8_moe.py, 16,384
# tokens) 128 rows, 8 warps, 4 stages ran fastest (row scales 1.98 ms for both products against
# 2.46 ms at 64 rows, 4 warps); 5 stages do not fit the shared memory; 4 warps for 128 rows spill
CONFIGS = ((128, 8, 4), (128, 8, 3), (64, 4, 3))
CONFIG = CONFIGS[0]
_K: dict[str, Any] = {}
# set by _define, as globals (the kernel's names resolve there, also under Triton's interpreter)
libdevice: Any = None  # triton.language.extra.libdevice
rounded: Any = None  # x rounded to the model dtype and back to float32 (``_define``)
pow2_ceil: Any = None  # ``fp8_quant.pow2_ceil`` (``_define``)
# Triton's interpreter (the CPU tests) has no libdevice (its exp there is tl.exp, numpy's), its
# float32 -> bfloat16 cast truncates and its float32 -> e4m3 cast is not round-to-nearest (127.9 ->
# 64): there bfloat16 rounding is done on the bits, and the kernel writes the clamped quotients in
# float32 for torch to cast (round-to-nearest-even, as the GPU's cvt.rn)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _define(triton, tl) -> dict[str, Any]:
    global libdevice, rounded, pow2_ceil
    from triton.language.extra import libdevice

    fp8_quant._kernels()
    pow2_ceil = fp8_quant.pow2_ceil  # (a global: the interpreter resolves the kernel's callees there)

    @triton.jit
    def rounded(x, F16: tl.constexpr, NATIVE: tl.constexpr):
        if F16:
            return x.to(tl.float16).to(tl.float32)
        if NATIVE:
            return x.to(tl.bfloat16).to(tl.float32)
        b = x.to(tl.uint32, bitcast=True)  # round to nearest even on the bits (finite values; NaN kept)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def fused(x_ptr, sx_ptr, sx_t, sx_k, tok_ptr, offs_ptr, blk_ptr, map_ptr, w_ptr, sw_ptr, q_ptr, sq_ptr, sq_k,
              E, fp8_max, amax_floor, I: tl.constexpr, K: tl.constexpr, XG: tl.constexpr,  # noqa: E741
              WB: tl.constexpr, F16: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, NATIVE: tl.constexpr,
              POW2: tl.constexpr):
        pid_m = tl.program_id(0)
        e = tl.load(map_ptr + pid_m)  # this block's expert (E: past the experts' last block)
        if e >= E:
            return
        prev = tl.maximum(e - 1, 0)
        first_blk = tl.where(e > 0, tl.load(blk_ptr + prev), 0)
        first_row = tl.where(e > 0, tl.load(offs_ptr + prev), 0)
        rows = first_row + (pid_m - first_blk) * BM + tl.arange(0, BM)
        rm = rows < tl.load(offs_ptr + e)
        tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)  # masked rows read token 0
        pid_n = tl.program_id(1)
        cols = pid_n * G + tl.arange(0, G)
        ks = tl.arange(0, G)
        kb_n: tl.constexpr = K // G
        nb_i: tl.constexpr = I // G  # the up rows' first weight block
        w_e = w_ptr + e.to(tl.int64) * (2 * I * K)
        g_ptrs = w_e + cols[:, None].to(tl.int64) * K + ks[None, :]
        u_ptrs = g_ptrs + I * K
        sw_e = sw_ptr + e.to(tl.int64) * (2 * nb_i * kb_n)
        acc_g = tl.zeros((BM, G), dtype=tl.float32)
        acc_u = tl.zeros((BM, G), dtype=tl.float32)
        for kb in range(kb_n):  # scaled as ops.fp8_grouped scales: per K block where a scale is
            a = tl.load(x_ptr + tok[:, None] * K + kb * G + ks[None, :])
            g = tl.load(g_ptrs + kb * G)
            u = tl.load(u_ptrs + kb * G)
            if XG and WB:
                sa = tl.load(sx_ptr + tok * sx_t + kb * sx_k)[:, None]
                acc_g += tl.dot(a, g.T) * (sa * tl.load(sw_e + pid_n * kb_n + kb))
                acc_u += tl.dot(a, u.T) * (sa * tl.load(sw_e + (nb_i + pid_n) * kb_n + kb))
            elif XG:
                sa = tl.load(sx_ptr + tok * sx_t + kb * sx_k)[:, None]
                acc_g += tl.dot(a, g.T) * sa
                acc_u += tl.dot(a, u.T) * sa
            elif WB:
                acc_g += tl.dot(a, g.T) * tl.load(sw_e + pid_n * kb_n + kb)
                acc_u += tl.dot(a, u.T) * tl.load(sw_e + (nb_i + pid_n) * kb_n + kb)
            else:
                acc_g = tl.dot(a, g.T, acc_g)
                acc_u = tl.dot(a, u.T, acc_u)
        if not XG:  # the rows' scales
            sa = tl.load(sx_ptr + tok * sx_t)[:, None]
            acc_g = acc_g * sa
            acc_u = acc_u * sa
        if not WB:  # the expert's column scales
            sw_c = sw_ptr + e.to(tl.int64) * (2 * I) + cols
            acc_g = acc_g * tl.load(sw_c)[None, :]
            acc_u = acc_u * tl.load(sw_c + I)[None, :]
        # the grouped multiply writes bf16, which the layer takes to its dtype; then silu_mul_quant's steps
        gf = rounded(rounded(acc_g, False, NATIVE), F16, NATIVE)
        uf = rounded(rounded(acc_u, False, NATIVE), F16, NATIVE)
        ex = libdevice.exp(-gf) if NATIVE else tl.exp(-gf)  # libdevice's: silu_mul_quant's rounding
        act = rounded(tl.div_rn(gf, 1.0 + ex), F16, NATIVE)
        y = rounded(act * uf, F16, NATIVE)
        s = tl.div_rn(tl.maximum(tl.max(tl.abs(y), axis=1), amax_floor), fp8_max)  # [BM]: the group's scale
        if POW2:  # rounded up to a power of two (``group_pow2``)
            s = pow2_ceil(s)
        q = tl.minimum(tl.maximum(tl.div_rn(y, s[:, None]), -fp8_max), fp8_max)
        r64 = rows.to(tl.int64)
        tl.store(q_ptr + r64[:, None] * I + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=rm[:, None])
        tl.store(sq_ptr + r64 + pid_n * sq_k, s, mask=rm)

    @triton.jit(do_not_specialize=["M", "SR", "ST"])
    def regroup(q_ptr, sq, s_ptr, SR, ST, out_ptr, so, so_ptr, M, NG: tl.constexpr, GP: tl.constexpr,
                BR: tl.constexpr, G: tl.constexpr):
        # BR rows' 1x128 group pid_g: the rows' scale the largest of their NG groups' (GP: NG's
        # next power of 2), the group's codes times its scale over the row's, rounded to e4m3
        # again (the row's largest group: x 1); group 0's programs write the rows' scales
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        pid_g = tl.program_id(1)
        rm = rows < M
        r64 = rows.to(tl.int64)
        gi = tl.arange(0, GP)
        sg = tl.load(s_ptr + gi[None, :].to(tl.int64) * ST + r64[:, None] * SR,
                     mask=rm[:, None] & (gi[None, :] < NG), other=0.0)
        srow = tl.where(rm, tl.max(sg, axis=1), 1.0)
        ratio = tl.div_rn(tl.load(s_ptr + pid_g * ST + r64 * SR, mask=rm, other=1.0), srow)
        cols = pid_g * G + tl.arange(0, G)
        y = tl.load(q_ptr + r64[:, None] * sq + cols[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        y = y * ratio[:, None]
        tl.store(out_ptr + r64[:, None] * so + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=rm[:, None])
        if pid_g == 0:
            tl.store(so_ptr + rows, srow, mask=rm)

    return {"fused": fused, "regroup": regroup}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "fused FP8 expert gate/up kernel", _define)


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel runs where x is: CUDA, or the CPU under Triton's interpreter."""
    return x.is_cuda or INTERPRETED


def eligible(xq: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor) -> bool:
    """xq [T, K] e4m3 contiguous, w [E, 2I, K] e4m3 contiguous, K and I multiples of 128, int64
    tokens and int32 offs, all on one device: CUDA, or the CPU under Triton's interpreter only."""
    e4m3 = torch.float8_e4m3fn
    return (runs_on(xq) and xq.dtype == e4m3 and w.dtype == e4m3 and xq.dim() == 2 and w.dim() == 3
            and xq.is_contiguous()
            and w.is_contiguous() and w.shape[2] == xq.shape[1] and xq.shape[1] % GROUP == 0
            and w.shape[1] % (2 * GROUP) == 0 and tokens.dtype == torch.int64 and offs.dtype == torch.int32
            and w.shape[0] == offs.shape[0] > 0 and tokens.dim() == 1 and tokens.is_contiguous()
            and offs.is_contiguous() and xq.device == w.device == tokens.device == offs.device
            and "fused" in _kernels())


def gate_up_silu_quant(xq: torch.Tensor, sx: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor,
                       w: torch.Tensor, sw: torch.Tensor, *, x_groups: bool, w_blocks: bool,
                       dtype: torch.dtype = torch.bfloat16, config: tuple[int, int, int] = CONFIG,
                       pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [M, I] e4m3, scales [M, I/128] float32 M-major) of silu(gate) * up of each sorted
    row's token, quantized per 1x128 group (module docstring); None where the kernel does not
    apply. sx: [T] or [T, 1] per row (stride 0 for a static per-tensor scale expanded), or
    [T, K/128] (``x_groups``); sw: [E, 2I] or [E, 2I, 1] per channel, or [E, 2I/128, K/128]
    (``w_blocks``). ``dtype`` the model's (the two-pass path's roundings); ``pow2``: the groups'
    scales rounded up to powers of two (``ops.fp8``'s ``group_pow2``, for ``rows_of_groups``)."""
    if not eligible(xq, w, tokens, offs) or dtype not in (torch.bfloat16, torch.float16):
        return None
    bm, warps, stages = config
    m, (e, two_i, k) = tokens.shape[0], w.shape
    inter = two_i // 2
    q, s = group_buffers(m, inter, GROUP, xq.device)
    if m == 0:
        return q, s
    codes = torch.empty(m, inter, dtype=torch.float32) if INTERPRETED else q
    sw = sw.float().contiguous()
    if x_groups:
        sx_t, sx_k = sx.stride(0), sx.stride(1)
    else:
        sx = sx.reshape(-1)
        sx_t, sx_k = (0 if sx.numel() == 1 else sx.stride(0)), 0  # (one scale: every row's)
    blk = expert_blocks(offs, bm)
    grid = (-(-m // bm) + e, inter // GROUP)
    _K["fused"][grid](xq, sx.float(), sx_t, sx_k, tokens, offs, blk, block_experts(blk, grid[0]), w, sw, codes, s,
                      s.stride(1), e, FP8_MAX, AMAX_FLOOR, I=inter, K=k, XG=x_groups, WB=w_blocks,
                      F16=dtype == torch.float16, BM=bm, G=GROUP, NATIVE=not INTERPRETED, POW2=pow2, num_warps=warps,
                      num_stages=stages)
    if INTERPRETED:
        q.copy_(torch.where(offs[-1] > torch.arange(m)[:, None], codes, 0.0).to(q.dtype))  # (rows past the end: 0)
    return q, s


def rows_of_groups(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128-group codes q [M, I] (I a multiple of 128) with scales s [M, I/128] (any strides)
    -> per-row codes and scales [M, 1]: each row's scale is its largest group's, and each
    group's codes are multiplied by its scale over the row's and rounded to e4m3 again (the
    largest group's codes unchanged). With power-of-two group scales (``group_pow2``, as the
    layer makes them) the ratios are powers of two and the codes move by their exponent only,
    exactly, but where a code falls below e4m3's normal range (2^-6 of the row's scale); with
    other scales they are rounded twice. What the experts' down product takes with per-channel
    weights: ``ops.fp8_moe``'s kernel makes whole 1x128 groups only, and the row-wise grouped
    multiply (torch's, with fast accumulation) ran 1.31x bf16 where the 1x128 one ran 0.90x
    (``bench/bench_fp8_down.py``). New buffers: on CUDA (and under the interpreter) a Triton
    kernel, else torch, bit for bit."""
    m, i = q.shape
    if s.shape != (m, i // GROUP) or i % GROUP:
        raise ValueError(f"rows_of_groups takes codes [M, I] and 1x128 scales [M, I/128], I a multiple of "
                         f"{GROUP}: got {tuple(q.shape)} and {tuple(s.shape)}")
    if i == GROUP:
        return q, s.reshape(m, 1)
    if runs_on(q) and "regroup" in _kernels() and q.stride(1) == 1 and REGROUP.usable():
        got = _regroup(q, s)
        if got is not None:
            return got
    srow = s.float().amax(1, keepdim=True)
    y = q.float().view(m, -1, GROUP) * (s.float() / srow)[..., None]
    return y.view(m, i).to(q.dtype), srow


REGROUP = FirstLaunch("rows_of_groups' kernel")  # its first launch failed (compiling): the torch path from then on


def _regroup(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rows_of_groups`` by the Triton kernel, into new buffers; None where its first launch
    failed (logged once; the torch path gives the same bits). A failure after a success raises."""
    m, i = q.shape
    srow = torch.empty(m, 1, device=q.device, dtype=torch.float32)
    out = torch.empty(m, i, device=q.device, dtype=torch.float32 if INTERPRETED else q.dtype)  # (e4m3 by torch)
    if m == 0:
        return out.to(q.dtype), srow
    ng, br = i // GROUP, 64
    if not REGROUP.run(lambda: _K["regroup"][(-(-m // br), ng)](
            q, q.stride(0), s, s.stride(0), s.stride(1), out, out.stride(0), srow, m,
            NG=ng, GP=1 << (ng - 1).bit_length(), BR=br, G=GROUP, num_warps=4)):
        return None
    return (out.to(q.dtype) if INTERPRETED else out), srow


def two_pass(xq: torch.Tensor, sx: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
             sw: torch.Tensor, *, x_groups: bool, w_blocks: bool, dtype: torch.dtype = torch.bfloat16,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The path the kernel replaces, the same result in three passes: the rows' codes gathered,
    ``ops.fp8_grouped``'s multiply (bf16, as the layer's grouped multiplies write it, then taken to
    ``dtype``), ``silu_mul_quant`` in 1x128 groups (the float32 reference of the multiply where its
    kernel does not run: the CPU)."""
    xg = xq.view(torch.uint8).index_select(0, tokens).view(xq.dtype)
    sg = sx.reshape(-1, 1).expand(xq.shape[0], 1) if sx.numel() == 1 else sx  # (one static scale)
    sg = sg.index_select(0, tokens)
    gu = fp8_grouped.grouped_block_mm(xg, sg, w, sw, offs, x_groups=x_groups, w_blocks=w_blocks)
    if gu is None:
        mode = "block" if w_blocks else "row"
        gu = fp8.grouped_scaled_linear_reference(xg, sg, w, sw if w_blocks else sw.reshape(w.shape[0], -1, 1), offs,
                                                 mode)
    mode = "group_pow2" if pow2 else "group"
    return fp8.silu_mul_quant(gu.to(dtype), mode, kernel=gu.is_cuda)  # (bf16 products, as the layer's)


def check(w: torch.Tensor, sw: torch.Tensor, top_k: int, *, x_groups: bool, w_blocks: bool,
          dtype: torch.dtype = torch.bfloat16, config: tuple[int, int, int] = CONFIG, pow2: bool = False) -> bool:
    """Start-up check at a layer's expert weights ``w`` [E, 2I, K] and scales ``sw`` (its own:
    nothing of their size allocated): the kernel against ``two_pass`` on random inputs and
    routing (1, 37 and 300 tokens, empty experts): each 1x128 group of the dequantized outputs
    within one e4m3 step of its largest value, at most 1% of the codes other (a tensor-core sum
    in another order may round a code the other way; NaN fails). False where the kernel does not
    apply; RuntimeError on a mismatch."""
    g = torch.Generator(device="cpu").manual_seed(2)
    for t in (1, 37, 300):
        x = torch.randn(t, w.shape[2], generator=g).to(w.device, dtype)
        xq, sx = fp8.quantize_groups(x) if x_groups else fp8.quantize_rows(x)
        tokens, offs = _routing(t, top_k, w.shape[0], w.device)
        got = gate_up_silu_quant(xq, sx, tokens, offs, w, sw, x_groups=x_groups, w_blocks=w_blocks, dtype=dtype,
                                 config=config, pow2=pow2)
        if got is None:
            return False
        m = int(offs[-1])
        ref = two_pass(xq, sx, tokens, offs, w, sw, x_groups=x_groups, w_blocks=w_blocks, dtype=dtype, pow2=pow2)
        a, b = (q[:m].float().view(m, -1, GROUP) * s[:m, :, None] for q, s in (got, ref))
        # per 1x128 group, within one e4m3 step of its largest value (32 / 448), and few codes off
        err = ((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30)).max().item() if m else 0.0
        off = (got[0][:m].view(torch.uint8) != ref[0][:m].view(torch.uint8)).float().mean().item() if m else 0.0
        if not (err <= 0.072 and off <= 0.01):  # (NaN fails)
            raise RuntimeError(f"fused FP8 expert gate/up at {t} tokens differs from its passes: a group by up to "
                               f"{err:.3g} of its largest value, {off:.2%} of the codes")
    return True
