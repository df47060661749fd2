"""The down projection's input quantization per row, SiLU-mul in the same pass: the one-read
persistent kernel (``ops.fp8_silu_rows``, at several grid and tile settings) against
the two-pass kernel (``quant_chunks``: the row's amax, then the codes, the gate/up row read twice)
and the 1x128-group pass (one read: the rate a one-read kernel can reach), at a dense model's
intermediate widths. GB/s counts the bytes a single read moves (the [T, 2I] bf16 rows read, the
[T, I] codes written); each setting's codes and scales are checked against the torch reference.

  python bench/bench_fp8_silu.py --out bench/results/fp8_silu.json     (GPU, ~1 minute)
  python bench/bench_fp8_silu.py --tiny                                 (CPU smoke: the references)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import Clock
from workloads import QWEN3_8B, QWEN3_32B

from teacher_server.ops import fp8
from teacher_server.ops import fp8_silu_rows as fsr

# (programs per SM at most, scratch MiB, chunk, warps); the first is the module's default
SETTINGS = [(fsr.PER_SM, fsr.SCRATCH >> 20, fsr.CHUNK, fsr.WARPS),
            (4, 16, 2048, 8), (2, 16, 2048, 8), (8, 32, 2048, 8), (4, 32, 4096, 16), (8, 32, 1024, 4),
            (16, 32, 1024, 4), (4, 16, 1024, 4), (2, 32, 4096, 16)]


def _set(per_sm: int, scratch_mib: int, chunk: int, warps: int, one_read: bool = True) -> None:
    fsr.PER_SM, fsr.SCRATCH, fsr.CHUNK, fsr.WARPS, fsr.ONE_READ = per_sm, scratch_mib << 20, chunk, warps, one_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda)
    widths = {"tiny": 256} if args.tiny else {"8b": QWEN3_8B["intermediate_size"], "32b": QWEN3_32B["intermediate_size"]}
    t = 64 if args.tiny else args.tokens
    default = SETTINGS[0]
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "tokens": t,
                 "default": dict(zip(("per_sm", "scratch_mib", "chunk", "warps"), default)), "widths": {}}
    for name, i in widths.items():
        g = torch.Generator(device=dev).manual_seed(1)
        gu = (4 * torch.randn(t, 2 * i, device=dev, generator=g)).bfloat16()
        ref = fp8.silu_mul_quant(gu, "row", kernel=False)
        nbytes = 5 * t * i
        rows = {}

        def case(label: str, fn: Callable[[], tuple], check: bool = True) -> None:
            if check and (err := fp8._differs(fn(), ref)):
                rows[label] = {"error": err}
                print(f"{name:>5} {label:>28} differs from the reference: {err}", flush=True)
                return
            s = clock.per_call(fn, args.iters)
            rows[label] = {"ms": s * 1e3, "gb_per_s": nbytes / s / 1e9}
            print(f"{name:>5} {label:>28} {s * 1e3:8.3f} ms {nbytes / s / 1e9:7.0f} GB/s", flush=True)

        _set(*default, one_read=False)
        case("two_pass", lambda: fp8.silu_mul_quant(gu, "row"))
        case("groups_one_read", lambda: fp8.silu_mul_quant(gu, "group"), check=False)
        for st in SETTINGS if cuda else SETTINGS[:1]:
            _set(*st)
            progs = fsr.programs(t, i, 2, dev)
            case(f"one_read {st} ({progs} programs)", lambda: fp8.silu_mul_quant(gu, "row"))
        _set(*default)
        res["widths"][name] = {"intermediate": i, "cases": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
