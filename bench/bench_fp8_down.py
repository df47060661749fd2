"""The FP8 experts' down product alone, against bf16, at an expert model's shapes (default
Qwen3-30B-A3B: 128 experts, top-8, intermediate 768 -> hidden 2048), T tokens routed at random:
torch's bf16 grouped GEMM (the bf16 path's); ``ops.fp8_grouped``'s Triton kernel, one program
per tile (``grid``) and one per SM walking the tiles (``persistent``), with the input in 1x128
groups (``ops.fp8_moe``'s output) or per row, each tile config; torch's grouped row-wise FP8
multiply with and without fast accumulation. Per-channel weight scales (``--quantization
fp8``). Median milliseconds of ``--iters`` calls after a pre-heat, TFLOP/s, and x bf16.

  python bench/bench_fp8_down.py --tokens 16384 32768 --out fp8_down.json     (GPU, ~2 minutes)

``--accuracy`` (CPU, seconds) instead measures what each layout of the down input costs in
accuracy: SiLU-mul outputs of random gate/up rows quantized per 1x128 group, per row, per row
through ``rows_of_groups`` (from groups with any scales: two roundings; from power-of-two
scales, the engine's: exact), and the down product's error against the float32 product of the
unquantized input (the same per-channel FP8 weights in every case).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import provenance
from workloads import QWEN3_30B_A3B

from teacher_server.ops import fp8, fp8_grouped, moe_gate_up
from teacher_server.ops.checks import median_ms
from teacher_server.ops.grouped_mm import GroupedGemm

# (BM, BN, warps, stages)
TILES = ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4))


def cases(t: int, i: int, h: int, e: int, k: int, sms: int) -> tuple[dict, float, dict]:
    dev = torch.device("cuda")
    tokens, offs = moe_gate_up._routing(t, k, e, dev)
    m = tokens.shape[0]
    g = torch.Generator(device=dev).manual_seed(1)
    act = torch.randn(m, i, device=dev, generator=g).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev, generator=g) * i ** -0.5).bfloat16()
    q2, s2 = fp8.quantize_weight(w2, "row")
    s2 = s2.reshape(e, -1)
    groups, rows = fp8.quantize_groups(act), fp8.quantize_rows(act)
    gg = GroupedGemm()
    out = {"bf16 grouped_mm": lambda: gg(act, w2.transpose(1, 2), offs)}
    for fast in (False, True):
        out[f"torch scaled_grouped_mm row fast_accum={fast}"] = lambda fast=fast: torch._scaled_grouped_mm(
            rows[0], q2.transpose(1, 2), rows[1].reshape(-1).contiguous(), s2, offs=offs, out_dtype=torch.bfloat16,
            use_fast_accum=fast)
    for name, a, xg in (("1x128", groups, True), ("row", rows, False)):
        for bm, bn, warps, stages in TILES:
            for progs in (0, sms, 2 * sms):
                kind = f"persistent{progs}" if progs else "grid"
                out[f"triton {kind} {name} {bm, bn, warps, stages}"] = (
                    lambda a=a, xg=xg, bm=bm, bn=bn, warps=warps, stages=stages, progs=progs:
                    fp8_grouped.grouped_block_mm(*a, q2, s2, offs, x_groups=xg, w_blocks=False, bm=bm, bn=bn,
                                                 warps=warps, stages=stages, persistent=progs))
    refs = {"1x128": out["triton grid 1x128 (64, 128, 4, 3)"], "row": out["triton grid row (64, 128, 4, 3)"]}
    return out, 2.0 * m * i * h, refs


def accuracy(rows: int, inter: int, hidden: int) -> dict[str, dict[str, float]]:
    """Relative RMS error of the down input and of the down product, per input layout."""
    import torch.nn.functional as F

    from teacher_server.ops import fp8_moe

    g = torch.Generator().manual_seed(0)
    act = (F.silu(1.5 * torch.randn(rows, inter, generator=g)) * torch.randn(rows, inter, generator=g)).bfloat16()
    wq, ws = fp8.quantize_weight(torch.randn(1, hidden, inter, generator=g) * inter ** -0.5, "row")
    w = (wq.float() * ws)[0]
    ref_in, ref_out = act.float(), act.float() @ w.T

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return q.float() * (s if s.shape[1] == 1 else s.repeat_interleave(128, 1))

    groups, groups2 = fp8.quantize_groups(act), fp8.quantize_groups(act, pow2=True)
    layouts = {"1x128 groups": groups, "per row": fp8.quantize_rows(act),
               "rows of 1x128 groups (two roundings)": fp8_moe.rows_of_groups(*groups),
               "1x128 groups, power-of-two scales": groups2,
               "rows of power-of-two groups (the engine's)": fp8_moe.rows_of_groups(*groups2)}
    out = {}
    for name, (q, s) in layouts.items():
        d = deq(q, s)
        out[name] = {"input_rel_rms": rel(d, ref_in), "down_rel_rms": rel(d @ w.T, ref_out)}
        print(f"{name:>44}  input {out[name]['input_rel_rms']:.5f}  down product {out[name]['down_rel_rms']:.5f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B["hidden_size"])
    ap.add_argument("--inter", type=int, default=QWEN3_30B_A3B["moe_intermediate_size"])
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B["num_experts"])
    ap.add_argument("--top-k", type=int, default=QWEN3_30B_A3B["num_experts_per_tok"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--preheat-s", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--accuracy", action="store_true", help="the down input layouts' error instead (CPU)")
    a = ap.parse_args()
    if a.accuracy:
        res = {"rows": 4096, "inter": a.inter, "hidden": a.hidden, "provenance": provenance(),
               "layouts": accuracy(4096, a.inter, a.hidden)}
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"hidden": a.hidden, "inter": a.inter, "experts": a.experts, "top_k": a.top_k,
                 "device": torch.cuda.get_device_name(), "provenance": provenance(), "runs": {}}
    for t in a.tokens:
        fns, flops, refs = cases(t, a.inter, a.hidden, a.experts, a.top_k, sms)
        ok = {}
        for name, fn in list(fns.items()):  # each Triton variant agrees with the grid kernel of its input
            try:
                got = fn()
            except Exception as e:  # a config that does not compile on this GPU: reported, dropped
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                fns.pop(name)
                continue
            if name.startswith("triton"):
                ref = refs["1x128" if " 1x128 " in name else "row"]()
                ok[name] = bool(torch.equal(got, ref))
        end = time.time() + a.preheat_s
        while time.time() < end:
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
        run = {}
        for name, fn in fns.items():
            ms = median_ms([fn], reps=a.iters + 1, skip=1)[0]
            run[name] = {"ms": ms, "tflops": flops / ms / 1e9, "equal_to_grid": ok.get(name)}
        base = run["bf16 grouped_mm"]["ms"]
        for name, v in sorted(run.items(), key=lambda kv: kv[1]["ms"]):
            v["x_bf16"] = base / v["ms"]
            print(f"T={t} {name:>52} {v['ms']:7.3f} ms {v['tflops']:7.1f} TF/s x{v['x_bf16']:.3f} "
                  f"{'' if v['equal_to_grid'] is None else 'equal' if v['equal_to_grid'] else 'DIFFERS'}", flush=True)
        res["runs"][str(t)] = run
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
