"""The FP8 expert layer's products against bf16, at an expert model's shapes (default
Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, intermediate 768), T tokens routed at random:

- ``bf16``: the engine's bf16 path: the fused gather + gate/up + SiLU-mul kernel
  (``ops.moe_gate_up``, each config) and torch's grouped GEMM for down;
- ``fp8_{row,block}_two_pass``: the FP8 path before ``ops.fp8_moe``: the input's codes gathered,
  ``ops.fp8_grouped``'s gate/up multiply, ``silu_mul_quant`` (1x128 groups), the down multiply;
- ``fp8_{row,block}_fused``: ``ops.fp8_moe``'s kernel (each config), then the down multiply on
  its 1x128 groups (each of ``ops.fp8_grouped``'s tile heights); ``fp8_row fused ... rows fast
  down`` is the engine's row-wise path: the groups taken per row (``rows_of_groups``), then
  torch's grouped row-wise multiply with fast accumulation.

The input's quantization (one pass over T rows, made by the norm in the engine) is outside every
case. Median milliseconds of ``--iters`` back-to-back calls after a pre-heat, TFLOP/s of the
two GEMMs' FLOPs, and each case's ratio to the fastest bf16 config.

  python bench/bench_fp8_moe.py --out fp8_moe.json          (GPU, ~1 minute)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import provenance
from workloads import QWEN3_30B_A3B

from teacher_server.ops import fp8, fp8_grouped, fp8_moe, moe_gate_up
from teacher_server.ops.checks import median_ms
from teacher_server.ops.grouped_mm import GroupedGemm


def fp8_cases(mode: str, x: torch.Tensor, tokens: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The FP8 expert layer in ``mode`` (row: per-channel weights, per-row input; block: 128x128
    weights, 1x128 input groups): the two passes, and the fused kernel at each config followed by
    the down multiply at each tile height."""
    wb, e = mode == "block", w13.shape[0]
    (q13, s13), (q2, s2) = fp8.quantize_weight(w13, mode), fp8.quantize_weight(w2, mode)
    if not wb:
        s13, s2 = s13.reshape(e, -1), s2.reshape(e, -1)
    xq, xs = fp8.quantize_groups(x) if wb else fp8.quantize_rows(x)

    def down(a: tuple[torch.Tensor, torch.Tensor], bm: int = 64) -> torch.Tensor:
        return fp8_grouped.grouped_block_mm(*a, q2, s2, offs, x_groups=True, w_blocks=wb, bm=bm)

    mid = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, q13, s13, x_groups=wb, w_blocks=wb)
    mid_rows = fp8.quantize_rows(torch.randn(mid[0].shape, device=x.device).bfloat16())
    out = {f"fp8_{mode} gate_up alone": lambda: fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, q13, s13,
                                                                           x_groups=wb, w_blocks=wb),
           f"fp8_{mode} down alone (1x128 input)": lambda: down(mid),
           f"fp8_{mode} down alone (row input)": lambda: fp8_grouped.grouped_block_mm(
               *mid_rows, q2, s2, offs, x_groups=False, w_blocks=wb)}
    for bm, warps, stages, bn in ((64, 4, 4, 128), (128, 8, 3, 128), (64, 8, 3, 128), (64, 4, 2, 128),
                                  (64, 4, 3, 256), (128, 8, 3, 256), (64, 8, 3, 256)):
        for groups, a in ((True, mid), (False, mid_rows)):
            out[f"fp8_{mode} down alone ({'1x128' if groups else 'row'} input) {bm, warps, stages, bn}"] = \
                lambda bm=bm, warps=warps, stages=stages, bn=bn, groups=groups, a=a: fp8_grouped.grouped_block_mm(
                    *a, q2, s2, offs, x_groups=groups, w_blocks=wb, bm=bm, warps=warps, stages=stages, bn=bn)
    if not wb:  # the engine's path with per-channel weights: the groups taken per row, torch's fast-accumulating down
        def fast_down(a: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return fp8.grouped_scaled_linear(*fp8_moe.rows_of_groups(*a), q2, s2, offs, "row", fast_accum=True)

        out["fp8_row rows_of_groups alone"] = lambda: fp8_moe.rows_of_groups(*mid)
        out["fp8_row down alone (rows of groups, fast accumulation)"] = lambda: fast_down(mid)
        out[f"fp8_row fused{fp8_moe.CONFIG} rows fast down"] = lambda: fast_down(fp8_moe.gate_up_silu_quant(
            xq, xs, tokens, offs, q13, s13, x_groups=False, w_blocks=False, pow2=True))
    out[f"fp8_{mode} two_pass"] = lambda: down(fp8_moe.two_pass(xq, xs, tokens, offs, q13, s13, x_groups=wb,
                                                                 w_blocks=wb))
    for c in fp8_moe.CONFIGS:
        for bm in (64, 128):
            out[f"fp8_{mode} fused{c} down_bm{bm}"] = lambda c=c, bm=bm: down(
                fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, q13, s13, x_groups=wb, w_blocks=wb, config=c), bm)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B["hidden_size"])
    ap.add_argument("--inter", type=int, default=QWEN3_30B_A3B["moe_intermediate_size"])
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B["num_experts"])
    ap.add_argument("--top-k", type=int, default=QWEN3_30B_A3B["num_experts_per_tok"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--preheat-s", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t, h, i, e, k = a.tokens, a.hidden, a.inter, a.experts, a.top_k
    tokens, offs = moe_gate_up._routing(t, k, e, dev)
    m = tokens.shape[0]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev, generator=g) * i ** -0.5).bfloat16()
    flops = 2.0 * m * h * 2 * i + 2.0 * m * i * h
    gg = GroupedGemm()
    cases: dict[str, Callable[[], object]] = {}
    act = moe_gate_up.moe_gate_up_silu(x, tokens, offs, w13)
    cases["bf16 gate_up alone"] = lambda: moe_gate_up.moe_gate_up_silu(x, tokens, offs, w13, (128, 128, 64, 8, 3))
    cases["bf16 down alone"] = lambda: gg(act, w2.transpose(1, 2), offs)
    for c in moe_gate_up.CONFIGS:
        cases[f"bf16 gate_up{c}"] = lambda c=c: gg(moe_gate_up.moe_gate_up_silu(x, tokens, offs, w13, c),
                                                     w2.transpose(1, 2), offs)
    for mode in ("row", "block"):
        cases.update(fp8_cases(mode, x, tokens, offs, w13, w2))
    end = time.time() + a.preheat_s
    while time.time() < end:
        for fn in cases.values():
            fn()
        torch.cuda.synchronize()
    res: dict = {"tokens": t, "rows": m, "hidden": h, "inter": i, "experts": e, "top_k": k,
                 "device": torch.cuda.get_device_name(), "provenance": provenance(), "cases": {}}
    for name, fn in cases.items():
        ms = median_ms([fn], reps=a.iters + 1, skip=1)[0]
        res["cases"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
    base = min(v["ms"] for n, v in res["cases"].items() if n.startswith("bf16") and "alone" not in n)
    for name, v in res["cases"].items():
        v["x_bf16"] = base / v["ms"]
        print(f"{name:>44} {v['ms']:8.3f} ms {v['tflops']:7.1f} TF/s  x{v['x_bf16']:.3f}", flush=True)
    for mode in ("row", "block"):  # the fused path against the two passes it replaces: the down outputs
        ref = cases[f"fp8_{mode} two_pass"]().float()
        got = cases[f"fp8_{mode} fused{fp8_moe.CONFIG} down_bm64"]().float()
        d = (got - ref).abs()
        res[f"{mode}_fused_vs_two_pass"] = {"max_abs": d.max().item(), "mean_abs": d.mean().item(),
                                            "ref_mean_abs": ref.abs().mean().item()}
        print(mode, res[f"{mode}_fused_vs_two_pass"], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
