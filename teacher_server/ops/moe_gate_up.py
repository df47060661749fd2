"""moe_gate_up: the expert layer's input gather, gate/up grouped GEMM and SiLU-mul in one
Triton kernel: act[r] = silu(h[tokens[r]] gate_e^T) * (h[tokens[r]] up_e^T) for the rows r of
expert e (rows sorted by expert, ``offs`` their cumulative ends, as ``layers.moe`` groups
them). The rows of h are read where they are (no [M, H] gathered copy) and the [M, 2I]
product never reaches memory: two passes and two round trips fewer than index_select, torch's
grouped GEMM and ``silu_mul``.

Each program takes BM rows of one expert and BN columns of its gate rows and the matching up
rows (two float32 accumulators). The programs of an expert are numbered from the per-expert
block counts (``expert_blocks``: ceil(rows / BM) each, summed on the device, no host sync), and
a map from block to expert made from them (``block_experts``) gives each program its expert in
one load; the grid covers the bound cdiv(M, BM) + E and programs past the last block return.
Rounding as the two-pass path: the GEMM's outputs rounded to the input dtype, silu of the
rounded gate rounded, times the rounded up, rounded (the exp is the GPU's fast one: a few
float32 ulps before the last rounding, as ``ops.gate_up_silu``'s default).

Whether it runs is decided once, at warm-up, at the model's expert shapes (``pick``): it must
match the two-pass path and be faster than it there, else the layer keeps torch's grouped
GEMM. Rows past the last row end (another expert-parallel rank's) are not written.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from teacher_server.ops.checks import assert_close, median_ms
from teacher_server.ops.silu_mul import silu_mul_reference
from teacher_server.ops.triton_kernels import lazy

log = logging.getLogger(__name__)

# (BM, BN, BK, warps, stages): BN columns of gate and BN of up per tile. The warm-up checks and
# times each at the layer's shapes and keeps the fastest (``pick``); CONFIG is the default.
CONFIGS = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4))
CONFIG = CONFIGS[0]
_K: dict[str, Any] = {}


def _define(triton, tl) -> dict[str, Any]:
    """The fused expert gate/up kernel (``triton_kernels.lazy``)."""
    # (no argument varies with the step: the row count is read from the device)
    @triton.jit
    def fused(h_ptr, sh, tok_ptr, offs_ptr, blk_ptr, map_ptr, w_ptr, swe, swr, out_ptr, so, E, I, K,  # noqa: E741
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        e = tl.load(map_ptr + pid_m)  # this block's expert (E: past the experts' last block)
        if e >= E:
            return
        prev = tl.maximum(e - 1, 0)
        first_blk = tl.where(e > 0, tl.load(blk_ptr + prev), 0)
        first_row = tl.where(e > 0, tl.load(offs_ptr + prev), 0)
        rows = first_row + (pid_m - first_blk) * BM + tl.arange(0, BM)
        rmask = rows < tl.load(offs_ptr + e)
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < I
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + tok[:, None] * sh + ks[None, :]
        g_ptrs = w_ptr + e.to(tl.int64) * swe + cols[None, :].to(tl.int64) * swr + ks[:, None]  # [BK, BN]
        u_off = I * swr
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kmask = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            bmask = kmask[:, None] & cmask[None, :]
            acc_g = tl.dot(a, tl.load(g_ptrs, mask=bmask, other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(g_ptrs + u_off, mask=bmask, other=0.0), acc_u)
            a_ptrs += BK
            g_ptrs += BK
        dt = out_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * so + cols[None, :], (s * u).to(dt),
                 mask=rmask[:, None] & cmask[None, :])

    return {"fused": fused}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "fused expert gate/up kernel", _define)


def expert_blocks(offs: torch.Tensor, bm: int) -> torch.Tensor:
    """[E] int32 on offs' device: the cumulative count of BM-row blocks of each expert's rows."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum((counts + bm - 1) // bm, 0, dtype=torch.int32)


def block_experts(blk: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int32: the expert of each of n row blocks (E past the last block), from the
    cumulative block counts ``blk`` (on the device: no host sync)."""
    return torch.searchsorted(blk, torch.arange(n, device=blk.device, dtype=blk.dtype), right=True, out_int32=True)


def eligible(h: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor) -> bool:
    """h [T, H] (unit column stride), w [E, 2I, H] (unit stride along H), both of one half
    dtype on one device (CUDA, or the CPU under the Triton interpreter), int64 tokens, int32 offs."""
    return (h.dtype in (torch.bfloat16, torch.float16) and w.dtype == h.dtype and h.dim() == 2 and w.dim() == 3
            and w.shape[2] == h.shape[1] and w.shape[1] % 2 == 0 and h.stride(1) == 1 and w.stride(2) == 1
            and tokens.dtype == torch.int64 and offs.dtype == torch.int32 and w.shape[0] == offs.shape[0] > 0
            and tokens.dim() == 1 and offs.dim() == 1 and tokens.is_contiguous() and offs.is_contiguous()
            and h.device == w.device == tokens.device == offs.device and "fused" in _kernels())


def moe_gate_up_silu(h: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
                     config: tuple[int, int, int, int, int] = CONFIG,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
    """[M, I]: silu(h[tokens[r]] gate_e^T) * (h[tokens[r]] up_e^T) for each row r of expert e
    (w [E, 2I, H] = gate rows | up rows; tokens [M]; offs [E] int32 row ends); rows past
    offs[-1] unwritten (in ``out`` where given). None where the kernel does not apply."""
    if not eligible(h, w, tokens, offs):
        return None
    bm, bn, bk, warps, stages = config
    m, (e, two_i, k) = tokens.shape[0], w.shape
    inter = two_i // 2
    if out is None:
        out = h.new_empty(m, inter)
    assert out.shape == (m, inter) and out.stride(1) == 1 and out.dtype == h.dtype, tuple(out.shape)
    if m == 0:
        return out
    blk = expert_blocks(offs, bm)
    grid = (-(-m // bm) + e, -(-inter // bn))  # at least the blocks: sum ceil(c_e / BM) <= M / BM + E
    _K["fused"][grid](h, h.stride(0), tokens, offs, blk, block_experts(blk, grid[0]), w, w.stride(0), w.stride(1), out,
                      out.stride(0), e, inter, k, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return out


def two_pass(h: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, gemm,
             act: Callable[[torch.Tensor], torch.Tensor] = silu_mul_reference) -> torch.Tensor:
    """The path it replaces: the gathered rows, the grouped GEMM (``gemm(a, b, offs)``), then
    SiLU-mul (``act``: the engine's kernel where timed, the reference where checked)."""
    return act(gemm(h.index_select(0, tokens), w.transpose(1, 2), offs))


def _routing(t: int, k: int, e: int, device: torch.device,
             total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing of t tokens over ``total`` experts (default e), sorted by expert as
    ``layers.moe`` does, kept for the first e of them (an expert-parallel rank's share; its
    tokens [rows], offs [e] int32); some experts get no rows."""
    total = total or e
    g = torch.Generator(device="cpu").manual_seed(t + total)
    ids = torch.rand(t, total, generator=g).topk(min(k, total), dim=-1).indices
    ids = torch.where(ids % 5 == 1, ids - 1, ids)  # experts 1, 6, 11, ... left empty (duplicates allowed)
    keys, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(keys, torch.arange(1, e + 1), out_int32=True)
    return (order[:int(offs[-1])] // min(k, total)).to(device), offs.to(device)


def check(w: torch.Tensor, top_k: int, gemm, config: tuple[int, int, int, int, int] = CONFIG) -> bool:
    """Start-up check at the model's expert weights ``w`` [E, 2I, H] (a layer's own: nothing of
    their size allocated): the kernel against the two-pass path on random inputs and routing
    (token counts 1, 37 and 300; empty experts), every output within a few steps of the dtype
    (NaN fails). False where it does not apply; RuntimeError on a mismatch."""
    g = torch.Generator(device="cpu").manual_seed(1)
    for t in (1, 37, 300):
        h = torch.randn(t, w.shape[2], generator=g).to(w.device, w.dtype)
        tokens, offs = _routing(t, top_k, w.shape[0], w.device)
        got = moe_gate_up_silu(h, tokens, offs, w, config)
        if got is None:
            return False
        assert_close(f"moe_gate_up at {t} tokens", got, two_pass(h, tokens, offs, w, gemm), rel=2 ** -6, floor=1e-3)
    return True


def _timed(w: torch.Tensor, top_k: int, gemm, act: Callable, tokens: int, total: int,
           configs: list[tuple[int, int, int, int, int]]) -> tuple[list[float], float]:
    """Median milliseconds of the kernel at each of ``configs`` and of the two-pass path (with
    the engine's SiLU-mul ``act``) at ``tokens`` tokens routed over ``total`` experts, the rows
    of w's experts kept (``checks.median_ms``)."""
    h = torch.randn(tokens, w.shape[2], device=w.device, dtype=w.dtype)
    rows, offs = _routing(tokens, top_k, w.shape[0], w.device, total)
    runs = [lambda c=c: moe_gate_up_silu(h, rows, offs, w, c) for c in configs]
    med = median_ms([*runs, lambda: two_pass(h, rows, offs, w, gemm, act)])
    return med[:-1], med[-1]


def pick(w: torch.Tensor, top_k: int, gemm, act: Callable = silu_mul_reference, tokens: int = 8192,
         total: int | None = None, margin: float = 0.03) -> tuple[int, int, int, int, int] | None:
    """The tile config a layer with expert weights ``w`` [E, 2I, H] (of ``total`` experts in
    all: an expert-parallel rank holds some) should run the kernel with, or None for the two
    passes: of the ``CONFIGS`` that pass ``check``, the fastest at ``tokens`` tokens, where it
    is at least ``margin`` faster than the two-pass path with the engine's SiLU-mul ``act``.
    Logs the times either way; the step-sized buffers it made go back to the driver, also on a
    failure."""
    if w.device.type != "cuda":
        return None
    good = []
    for c in CONFIGS:
        try:
            if check(w, top_k, gemm, c):
                good.append(c)
        except RuntimeError as e:  # a config Triton compiles wrong here: the others may still run
            log.warning("fused expert gate/up kernel config %s: %s", c, e)
    if not good:
        return None
    try:
        fused, base = _timed(w, top_k, gemm, act, tokens, total or w.shape[0], good)
    finally:
        torch.cuda.empty_cache()
    best = min(range(len(good)), key=lambda j: fused[j])
    use = fused[best] <= (1 - margin) * base
    log.info("fused expert gate/up kernel %s: %.3f ms (config %s; others %s) against %.3f ms for the gather, grouped "
             "GEMM and SiLU-mul (%d experts here, hidden %d, intermediate %d, top-%d, %d tokens)",
             "on" if use else "off", fused[best], good[best], [round(f, 3) for f in fused], base, w.shape[0],
             w.shape[2], w.shape[1] // 2, top_k, tokens)
    return good[best] if use else None
