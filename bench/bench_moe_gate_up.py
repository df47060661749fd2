"""The experts' gate/up stage at the engine's step sizes: the fused Triton kernel
(``ops.moe_gate_up``: gather, grouped GEMM and SiLU-mul in one) against the two passes it
replaces (index_select, torch's grouped GEMM, the SiLU-mul kernel), per model shape, in
milliseconds per call and TFLOP/s of the GEMM, and what the warm-up would pick there (the
kernel timed at that pick's tiles, else at the default's).

  python bench/bench_moe_gate_up.py --out bench/results/moe_gate_up_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_moe import timed

from teacher_server.ops import moe_gate_up
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import GroupedGemm

# (name, experts, hidden, expert intermediate, top-k)
SHAPES = [("moonlight", 64, 2048, 1408, 6), ("qwen3-30b-a3b", 128, 2048, 768, 8),
          ("qwen3.5-35b-a3b", 256, 2048, 512, 8), ("qwen3-next", 512, 2048, 512, 10),
          ("glm4.5-air", 128, 4096, 1408, 8), ("deepseek-v3", 256, 7168, 2048, 8)]


def shape_rows(name: str, e: int, h: int, i: int, k: int, tokens: list[int]) -> list[dict]:
    """One shape's rows: the warm-up's pick, then both paths at each token count."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    silu = FusedOps(kernels=True, compile=False).silu_mul  # the engine's SiLU-mul kernel
    gemm = GroupedGemm()
    gemm.use_torch(dev, dt, shapes=((h, 2 * i), (i, h)))
    w = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * h ** -0.5
    picked = moe_gate_up.pick(w, k, gemm, act=silu)  # the fastest config, or None
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=dt)
        tok, offs = moe_gate_up._routing(t, k, e, dev)
        fused = timed(lambda: moe_gate_up.moe_gate_up_silu(x, tok, offs, w, picked or moe_gate_up.CONFIG), 20)
        two = timed(lambda: silu(gemm(x.index_select(0, tok), w.transpose(1, 2), offs)), 20)
        flop = 2 * t * k * h * 2 * i
        r = {"shape": name, "experts": e, "hidden": h, "intermediate": i, "top_k": k, "tokens": t,
             "fused_ms": fused, "two_pass_ms": two, "speedup": two / fused, "fused_tflops": flop / fused / 1e9,
             "two_pass_tflops": flop / two / 1e9, "warm_up_picks": picked}
        rows.append(r)
        print(f"{name:16s} {t:6d} tokens: fused {fused:7.3f} ms ({r['fused_tflops']:5.0f} TFLOP/s), two passes "
              f"{two:7.3f} ms ({r['two_pass_tflops']:5.0f}): {r['speedup']:.2f}x; warm-up picks "
              f"{picked or 'two passes'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--out", default="bench/results/moe_gate_up.json")
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        rows += shape_rows(*shape, [int(x) for x in args.tokens.split(",")])
        torch.cuda.empty_cache()  # the shape's weights go back before the next
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "configs": moe_gate_up.CONFIGS,
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
