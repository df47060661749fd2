"""The experts' multiply with 128x128-block FP8 weights, in Triton: torch 2.11's grouped FP8
multiply takes row-wise scales only on sm90 (``ops.fp8``'s docstring), and requantizing block
weights per row costs each weight a second e4m3 rounding. This kernel keeps the checkpoint's
block scales, as DeepSeek's and Qwen's FP8 MoE releases ship them.

Operands as ``ops.grouped_mm``'s: x [M, K] e4m3 with rows sorted by expert, its 1x128 scales
[M, K/128] (any strides: ``ops.fp8.quantize_groups`` writes them M-major), w [E, N, K] e4m3
contiguous with scales [E, ceil(N/128), K/128], offs [E] int32 cumulative row ends. Out
[M, N] bf16, y[m, n] = sum over K blocks b of sx[m, b] * sw[e, n // 128, b] * (x[m, Kb] . w[e, n, Kb]),
each block's product summed by the tensor cores (Triton's FP8 dot on sm90 accumulates in their
own precision), then scaled and added in float32 (the recipe's own definition: one promotion
per 128-wide K block). With ``row``, the same kernel takes per-row activation scales [M] and
per-channel weight scales [E, N] (applied once, after the K blocks' float32 sum, in one
accumulator the tensor cores add into): the row-wise experts' default, because torch's grouped
row-wise kernel without fast accumulation ran at 0.59x the bf16 grouped GEMM on an H200
(Qwen3-30B-A3B's experts; ``ops.fp8``'s docstring). Each operand's layout is its own
(``x_groups``, ``w_blocks``): 1x128 activation groups with per-channel weights are promoted
per K block by the groups' scales and scaled by the columns' at the end (the engine's row-wise
experts take their down input per row instead: ``ops.fp8_moe.rows_of_groups``).

Tiles: BM rows of one expert x 128 columns (one weight scale block); BM = 64 (4 warps) by
default, which ran 1.41x faster than 128 rows (8 warps) at ~1,000 rows per expert. An
expert's rows take ceil(count / BM) row tiles; the grid has ceil(M / BM) + E row slots (the
most any split can need) on its second axis and the column tiles on its first (a row tile's
column tiles run together), and a slot finds its expert by comparing its index with the
experts' cumulative tile counts (computed on the GPU: no host sync); slots past the last tile
return at once.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

BLOCK = 128  # the scale block: K step and N tile
_K: dict[str, Any] = {}
tile: Any = None  # one output tile, a global that both kernels call (set by ``_kernels``; Triton's interpreter
# resolves a kernel's callees among the module's globals)


def _kernels() -> dict[str, Any]:
    global tile
    if _K:
        return _K
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # the CPU wheel has no triton: the reference runs instead
        log.info("grouped block-FP8 kernel unavailable: %s: %s", type(e).__name__, e)
        _K["missing"] = True
        return _K

    @triton.jit
    def tile(x_ptr, sx_ptr, sx_m, sx_k, w_ptr, sw_ptr, offs_ptr, out_ptr, e, first_tile, slot, pid_n,
             N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             XG: tl.constexpr, WB: tl.constexpr):
        # one [BM, BN] output tile: row tile ``slot - first_tile`` of expert e, column tile pid_n
        row_end = tl.load(offs_ptr + e)
        row_start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        rows = row_start + (slot - first_tile) * BM + tl.arange(0, BM)
        rm = rows < row_end
        rows = tl.where(rm, rows, row_start).to(tl.int64)  # masked rows read a valid row
        cols = pid_n * BN + tl.arange(0, BN)
        cm = cols < N
        ks = tl.arange(0, BK)
        kb_n: tl.constexpr = K // BK
        nb_n: tl.constexpr = (N + BK - 1) // BK  # the weight scale blocks' rows (BK = 128 = the block)
        w_base = w_ptr + e.to(tl.int64) * N * K
        # the tile's weight scales per K block: one (BN the block's height) or one per column's block
        sw_base = sw_ptr + e.to(tl.int64) * nb_n * kb_n + (pid_n * kb_n if BN == BK else (cols // BK) * kb_n)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        # with a per-block scale (XG or WB) each 128-wide K block's product is summed by the tensor
        # cores (Triton's FP8 dot on sm90 accumulates in their own precision) and then scaled and
        # added in float32: a promotion per block; with none, one accumulator, scaled at the end
        for kb in range(kb_n):
            a = tl.load(x_ptr + rows[:, None] * K + kb * BK + ks[None, :])
            b = tl.load(w_base + cols[:, None].to(tl.int64) * K + kb * BK + ks[None, :], mask=cm[:, None], other=0.0)
            if XG and WB:
                sb = tl.load(sw_base + kb) if BN == BK else tl.load(sw_base + kb, mask=cm, other=0.0)[None, :]
                acc += tl.dot(a, b.T) * (tl.load(sx_ptr + rows * sx_m + kb * sx_k)[:, None] * sb)
            elif XG:
                acc += tl.dot(a, b.T) * tl.load(sx_ptr + rows * sx_m + kb * sx_k)[:, None]
            elif WB:
                sb = tl.load(sw_base + kb) if BN == BK else tl.load(sw_base + kb, mask=cm, other=0.0)[None, :]
                acc += tl.dot(a, b.T) * sb
            else:
                acc = tl.dot(a, b.T, acc)
        if not XG:  # x's [M] row scales
            acc = acc * tl.load(sx_ptr + rows * sx_m)[:, None]
        if not WB:  # the expert's [N] column scales
            acc = acc * tl.load(sw_ptr + e.to(tl.int64) * N + cols, mask=cm, other=0.0)[None, :]
        out = out_ptr + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])

    @triton.jit(do_not_specialize=["M"])
    def grouped_block(x_ptr, sx_ptr, sx_m, sx_k, w_ptr, sw_ptr, offs_ptr, tiles_ptr, out_ptr, M,
                      N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, BE: tl.constexpr, XG: tl.constexpr, WB: tl.constexpr):
        # N, K, E: a layer's constants (one compile per expert layer shape); M varies per step
        # the column tiles of one row tile run next to each other: its rows are read from L2 after
        # the first, and an expert's weight stays there while its row tiles pass
        pid_n = tl.program_id(0)
        slot = tl.program_id(1)
        ei = tl.arange(0, BE)
        ends = tl.load(tiles_ptr + ei, mask=ei < E, other=2 ** 30)  # cumulative row tiles per expert
        e = tl.sum((ends <= slot).to(tl.int32), axis=0)  # the expert whose tiles hold this slot
        if e < E:
            first_tile = tl.sum(tl.where(ei == e - 1, ends, 0), axis=0)  # 0 for e == 0
            tile(x_ptr, sx_ptr, sx_m, sx_k, w_ptr, sw_ptr, offs_ptr, out_ptr, e, first_tile, slot, pid_n,
                 N, K, BM, BN, BK, XG, WB)

    @triton.jit(do_not_specialize=["M"])
    def grouped_persistent(x_ptr, sx_ptr, sx_m, sx_k, w_ptr, sw_ptr, offs_ptr, tiles_ptr, out_ptr, M,
                           N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, XG: tl.constexpr,
                           WB: tl.constexpr, PROGS: tl.constexpr, STAGES: tl.constexpr):
        # as grouped_block, with a program per SM walking the tiles (row tile major, its column
        # tiles next to each other), the loops over tiles and K blocks flattened into one so that
        # the next tile's loads are in flight while this one's epilogue runs
        n_tiles: tl.constexpr = (N + BN - 1) // BN
        ei = tl.arange(0, BE)
        ends = tl.load(tiles_ptr + ei, mask=ei < E, other=2 ** 30)
        total = tl.load(tiles_ptr + E - 1) * n_tiles
        for t in tl.range(tl.program_id(0), total, PROGS, flatten=True, num_stages=STAGES):
            slot = t // n_tiles
            e = tl.sum((ends <= slot).to(tl.int32), axis=0)
            first_tile = tl.sum(tl.where(ei == e - 1, ends, 0), axis=0)
            tile(x_ptr, sx_ptr, sx_m, sx_k, w_ptr, sw_ptr, offs_ptr, out_ptr, e, first_tile, slot, t % n_tiles,
                 N, K, BM, BN, BK, XG, WB)

    _K.update(grouped_block=grouped_block, grouped_persistent=grouped_persistent,
              next_pow2=triton.next_power_of_2)
    return _K


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """CUDA, e4m3 operands, K a multiple of 128, a contiguous weight, Triton present."""
    return (x.is_cuda and x.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn and w.is_contiguous()
            and x.stride(1) == 1 and x.stride(0) == x.shape[1] and x.shape[1] % BLOCK == 0
            and "grouped_block" in _kernels())


def grouped_block_mm(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, offs: torch.Tensor,
                     bm: int = 64, warps: int | None = None, stages: int = 3, row: bool = False,
                     out_dtype: torch.dtype = torch.bfloat16, x_groups: bool | None = None,
                     w_blocks: bool | None = None, bn: int = BLOCK, persistent: int = 0) -> torch.Tensor | None:
    """[M, K] x [E, N, K] by experts with 1x128 / 128x128 block scales -> [M, N] (bf16 by
    default), or None where the kernel does not apply (module docstring). ``row``: x's scales
    [M] (or [M, 1]) and per-channel weight scales [E, N] (or [E, N, 1]) instead; ``x_groups`` /
    ``w_blocks`` set each operand's own (default: ``not row``).
    ``bm`` the tile's rows (64: 4 warps; 128: 8 warps), ``bn`` its columns (128, or 256);
    ``persistent`` > 0: that many programs walk the tiles (``grouped_persistent``)."""
    if not applies(x, w):
        return None
    kern = _kernels()
    m, k = x.shape
    e, n, _ = w.shape
    xg = not row if x_groups is None else x_groups
    wb = not row if w_blocks is None else w_blocks
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0 or e == 0:
        return out
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    tiles = ((counts + bm - 1) // bm).cumsum(0).to(torch.int32)  # [E] cumulative row tiles, on the GPU
    sw = sw.float().contiguous()
    if not xg:
        sx = sx.reshape(m)
    sx_m, sx_k = (sx.stride(0), sx.stride(1)) if xg else (sx.stride(0), 0)
    if persistent:
        kern["grouped_persistent"][(persistent,)](
            x, sx, sx_m, sx_k, w, sw, offs, tiles, out, m, n, k, e, BM=bm, BN=bn, BK=BLOCK,
            BE=kern["next_pow2"](e), XG=xg, WB=wb, PROGS=persistent, STAGES=stages,
            num_warps=warps or (4 if bm <= 64 else 8), num_stages=stages)
        return out
    grid = (-(-n // bn), -(-m // bm) + e)
    kern["grouped_block"][grid](x, sx, sx_m, sx_k, w, sw, offs, tiles, out, m, n, k, e,
                                BM=bm, BN=bn, BK=BLOCK, BE=kern["next_pow2"](e), XG=xg, WB=wb,
                                num_warps=warps or (4 if bm <= 64 else 8), num_stages=stages)
    return out
