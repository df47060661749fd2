"""The FP8 row-wise product's error with and without Hopper's fast accumulation, at model widths:
against the float32 product of the same FP8 operands (the start-up check's operands: 33 random
rows, unit-scale outputs), its relative RMS error, its worst output against the largest, and the
slope of the output on the reference (least squares, minus one: a scale error moves it; the fast
sums' truncation leans it below zero); each also with a 1% activation scale error, the kind of
fault the start-up check (``ops.fp8.check_scaled_linear``) must catch.

  python bench/probe_fast_accum.py --out bench/results/fp8_fast_accum_error.json   (GPU, seconds)
  python bench/probe_fast_accum.py --tiny                                           (CPU smoke)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from teacher_server.ops.checks import error_stats
from teacher_server.ops.fp8_mm import quantize_weight, scale_from_amax, scaled_linear, scaled_linear_reference, to_fp8

# k -> n: Qwen3-8B (qkv, gate/up, down), Qwen3-32B (qkv, down), Moonlight, DeepSeek-V3 (o, dense down)
WIDTHS = [(4096, 6144), (4096, 24576), (12288, 4096), (5120, 10240), (25600, 5120), (2048, 3072), (7168, 4096),
          (18432, 7168)]


def errors(k: int, n: int, seed: int, dev: torch.device, fast: bool, scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(33, k, generator=gen).bfloat16().float()
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen) * k ** -0.5, "row")
    s = scale_from_amax(x.abs().amax(-1, keepdim=True))
    xq = to_fp8(x, s)
    ref = scaled_linear_reference(xq, s, wq, ws, "row", torch.float32, None)
    got = scaled_linear(xq.to(dev), s.to(dev) * scale, wq.to(dev), ws.to(dev), "row", fast_accum=fast).float().cpu()
    rel, maxrel, slope = error_stats(got, ref)
    return {"k": k, "n": n, "seed": seed, "fast": fast, "scale": scale, "rel": rel, "maxrel": maxrel, "slope": slope}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small widths on the CPU (the reference path; a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    widths = WIDTHS if cuda else [(256, 64)]
    out = [errors(k, n, seed, dev, fast, scale) for k, n in widths for seed in (0, 1) for fast in (False, True)
           for scale in (1.0, 1.01)]
    for r in out:
        print(f"K={r['k']:6d} N={r['n']:6d} seed {r['seed']} {'fast    ' if r['fast'] else 'promoted'} scale "
              f"x{r['scale']:.2f}: rel RMS {r['rel']:.5f}, worst {r['maxrel']:.5f}, slope {r['slope']:+.6f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                              "torch": torch.__version__, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
