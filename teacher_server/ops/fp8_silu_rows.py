"""FP8 (e4m3) codes per row of ``silu(gate) * up``, each [2I] gate/up row read once, on CUDA with
Triton: the down projection's input for row-wise products (``ops.fp8_quant.quantize``'s
``silu`` producer, ``row`` mode, takes it first).

A row's scale (its amax / 448) needs the whole row before its first code. A persistent grid of
programs, each walking rows pid, pid + P, ..., writes each row's rounded silu(gate) * up (bf16:
the values the codes are made of, so they are never recomputed) into a scratch row of its own,
which stays in L2, takes the row's amax on the way, and makes the codes from the scratch row.
It gives ``quant_chunks``' bits (the two-pass kernel, which reads each row twice and computes
SiLU twice): silu rounded, then the product rounded, as ``ops.silu_mul.silu_mul_reference``;
correctly rounded divisions; a clamp to +-448. Measured slower on an H100, and not kept: two
scratch rows per program, one walk over the columns making the next row's scratch and the previous
row's codes (0.573 against 0.495 ms at Qwen3-8B's width, ``bench/results/fp8_silu_h100_3eb6847.json``);
a row's first 4,096-16,384 columns held in registers, only the rest through the scratch row (at
best 0.530 against 0.493, ``fp8_silu_keep_h100_034427c.json``).
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernel's arguments take no annotations)
from __future__ import annotations

from typing import Any

import torch

from teacher_server.ops.gate_up_silu import sm_count
from teacher_server.ops.guarded import FirstLaunch
from teacher_server.ops.triton_kernels import lazy

ONE_READ = True  # False: the two-pass kernel takes every call
# the scratch rows, SCRATCH bytes in all, stay in L2 (up to PER_SM programs per SM, CHUNK columns a step)
SCRATCH = 32 << 20
PER_SM = 4
CHUNK, WARPS = 2048, 8
_K: dict[str, Any] = {}
libdevice: Any = None  # set by _define, a global: the kernel's names resolve there, also under Triton's interpreter


def _define(triton, tl) -> dict[str, Any]:
    """The kernel (``triton_kernels.lazy``)."""
    global libdevice
    from triton.language.extra import libdevice

    # (evict_last on the scratch rows, evict_first on the gate/up rows, read once; each thread reads
    # back what it wrote, one layout, and the barriers keep a program's passes apart all the same)
    @triton.jit(do_not_specialize=["T"])
    def silu_rows(x_ptr, sx, q_ptr, sq, scale_ptr, h_ptr, T, K: tl.constexpr, fp8_max, amax_floor,
                  CHUNK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        hrow = h_ptr + pid * K
        dt = x_ptr.dtype.element_ty
        for base in range(0, T, tl.num_programs(0)):  # the last turn of some programs has no row
            row = pid + base
            live = row < T
            xrow = x_ptr + row * sx
            amax = tl.zeros((CHUNK,), dtype=tl.float32)
            for c in range(0, K, CHUNK):
                m = (c + cols < K) & live
                g = tl.load(xrow + c + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
                u = tl.load(xrow + K + c + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
                a = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
                y = (a * u).to(dt)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
                tl.store(hrow + c + cols, y, mask=m, eviction_policy="evict_last")
            scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), amax_floor), fp8_max)
            tl.store(scale_ptr + row, scale, mask=live)
            tl.debug_barrier()
            for c in range(0, K, CHUNK):
                m = (c + cols < K) & live
                y = tl.load(hrow + c + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                q = tl.minimum(tl.maximum(tl.div_rn(y, scale), -fp8_max), fp8_max)
                tl.store(q_ptr + row * sq + c + cols, q.to(tl.float8e4nv), mask=m)
            tl.debug_barrier()

    return {"silu_rows": silu_rows, "next_pow2": triton.next_power_of_2}


def _kernels() -> dict[str, Any]:
    return lazy(_K, "FP8 one-read SiLU-mul kernel", _define)


def one_read_key(k: int, dtype: torch.dtype) -> tuple:
    """The launch key of the one-read SiLU-mul per row at width k (``fp8_quant.LAUNCHES``; the
    start-up check fails it there)."""
    return "one_read", "silu", "row", k, dtype


def programs(rows: int, k: int, itemsize: int, device: torch.device) -> int:
    """The persistent grid: ``PER_SM`` programs per SM, fewer where their scratch rows would pass
    ``SCRATCH`` bytes (L2; one per SM at least), and never more than rows."""
    sms = sm_count(device) if device.type == "cuda" else 4  # (4: Triton's interpreter, the CPU tests)
    return max(1, min(rows, sms * max(1, min(PER_SM, SCRATCH // (k * itemsize * sms)))))


def run(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor, k: int, fp8_max: float, amax_floor: float,
        launches: FirstLaunch) -> bool:
    """Write the codes xq [T, k] and the scales [T, 1] of silu(x[:, :k]) * x[:, k:] (x a CUDA
    bf16/fp16 [T, 2k] with unit column stride, as ``fp8_quant.applies`` takes); False where it
    did not run (switched off, no Triton, its launch key failed in ``launches``)."""
    key = one_read_key(k, x.dtype)
    if not ONE_READ or not launches.usable(key) or "silu_rows" not in (kern := _kernels()):
        return False
    t = x.shape[0]
    progs = programs(t, k, x.element_size(), x.device)
    scratch = torch.empty(progs, k, device=x.device, dtype=x.dtype)
    return launches.run(lambda: kern["silu_rows"][(progs,)](
        x, x.stride(0), xq, xq.stride(0), scale, scratch, t, k, float(fp8_max), float(amax_floor),
        CHUNK=min(CHUNK, kern["next_pow2"](k)), num_warps=WARPS), key)
