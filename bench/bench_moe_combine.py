"""The expert layer's combine at the engine's step sizes: torch's ``embedding_bag`` (the path
before ``ops.moe_combine``) against the CUDA kernel, in microseconds per call and as a share
of the rows' bytes at the GPU's copy rate (a device-to-device copy of the same bytes).

  python bench/bench_moe_combine.py --out bench/results/moe_combine_h100.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from bench_moe import timed as timed_ms

from teacher_server.ops.moe_combine import moe_combine, moe_combine_reference

# (name, tokens per step, top-k, hidden)
SHAPES = [("moonlight", 16384, 6, 2048), ("qwen3-30b-a3b", 16384, 8, 2048), ("deepseek-v3", 16384, 8, 7168),
          ("gpt-oss-20b", 16384, 4, 2880), ("qwen3-next", 16384, 10, 2048)]


def timed(fn: Callable[[], object], reps: int = 50) -> float:
    """Median microseconds of ``fn`` (``bench_moe.timed``'s CUDA events)."""
    return timed_ms(fn, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/moe_combine.json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, t, k, h in SHAPES:
        y = torch.randn(t * k, h, device=dev, dtype=dt)
        pos = torch.randperm(t * k, device=dev).view(t, k)
        w = torch.rand(t, k, device=dev)
        src = torch.empty(t * k + t, h, device=dev, dtype=dt)  # the bytes the combine moves, copied once
        dst = torch.empty_like(src)
        r = {"shape": name, "tokens": t, "top_k": k, "hidden": h,
             "embedding_bag_us": timed(lambda: moe_combine_reference(y, pos, w, None)),
             "kernel_us": timed(lambda: moe_combine(y, pos, w, None)),
             "copy_same_bytes_us": timed(lambda: dst.copy_(src)) / 2}  # a copy reads and writes: half its time
        r["speedup"] = r["embedding_bag_us"] / r["kernel_us"]
        rows.append(r)
        print(f"{name:14s} T={t} k={k} H={h}: embedding_bag {r['embedding_bag_us']:8.1f} us, kernel "
              f"{r['kernel_us']:8.1f} us ({r['speedup']:.2f}x), the bytes once at copy rate {r['copy_same_bytes_us']:.1f} us",
              flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
