"""Bench the Gated DeltaNet layers' fused input stage (``ops.conv_prep``: convolution + SiLU,
q/k norms, contiguous q/k/v, gates in one Triton pass) against the two passes it replaces
(fla-core's causal convolution, then the compiled ``linear_prep`` stage) at the Qwen3.5-9B
layer's shapes, on a step of W1-like sequences, with and without stored initial states.

    python bench/bench_conv_prep.py [--tokens 8192,16384] [--out bench/results/conv_prep_h200.json]

Times are medians of CUDA-event timings after warm-up (``bench_kernel.time_ms``), random data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

from bench_kernel import time_ms  # noqa: E402

from teacher_server.ops.conv_prep import conv_prep, random_inputs  # noqa: E402
from teacher_server.ops.fused import FusedOps  # noqa: E402
from teacher_server.ops.gated_delta import bounds_of, causal_conv1d, make_plan  # noqa: E402

NK, DK, NV, DV, W = 16, 128, 32, 128, 4  # Qwen3.5-9B's linear layers (one GPU)


def lengths(tokens: int) -> list[int]:
    """A step of W1-like sequences (1280-6912 tokens) filling ``tokens``, the last one cut."""
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(min(int(torch.randint(1280, 6913, (1,), generator=gen)), tokens - sum(out)))
    return out


def bench(tokens: int, init: bool, iters: int, warmup: int) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    lens = lengths(tokens)
    dim = 2 * NK * DK + NV * DV
    x, weight, initial, b, a, a_log, dt_bias = random_inputs(lens, NK, DK, NV, DV, W, dtype, dev, init)
    plan = make_plan(lens, torch.tensor(bounds_of(lens), device=dev), init, True)
    ops = FusedOps(kernels=False, compile=True)

    def two_passes() -> object:
        y, end = causal_conv1d(x, weight, plan, initial, True)
        return ops.linear_prep(y, b, a, a_log, dt_bias, NK, DK, NV, DV), end

    row = {"tokens": tokens, "sequences": len(lens), "initial_states": init,
           "two_passes_ms": time_ms(two_passes, iters, warmup)}
    moved = 2 * tokens * dim * x.element_size()  # the q|k|v columns read once, q, k, v written once
    for bt in (16, 32, 64):
        ms = time_ms(lambda bt=bt: conv_prep(x, weight, plan, initial, True, b, a, a_log, dt_bias,
                                              NK, DK, NV, DV, block_t=bt), iters, warmup)
        row[f"fused_bt{bt}_ms"] = ms
        row[f"fused_bt{bt}_gb_s"] = moved / ms / 1e6
    best = min(row[f"fused_bt{bt}_ms"] for bt in (16, 32, 64))
    row["speedup"] = row["two_passes_ms"] / best
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "conv_prep_h200.json")
    args = p.parse_args()
    rows = [bench(int(t), init, args.iters, args.warmup) for t in args.tokens.split(",") for init in (False, True)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
