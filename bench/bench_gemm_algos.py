"""Which cuBLASLt algorithm runs a layer's projections fastest under the power limit.

torch.mm takes cuBLAS's heuristic pick per shape, chosen for a GPU at full clock. A prefill
step's multiplies run back to back against the 700 W limit (~1450 of 1980 MHz), where the
rate is set by the energy each FLOP costs, so another candidate of the heuristic's list may be
faster there. For each projection of the model's layer at a step's token count this script
lists the candidates (``bench/lt_gemm.cpp``, built here), checks each against torch.mm,
times each in a short burst and sustained (interleaved rounds, so drift in the GPU's state
falls on all alike), then runs the layer's sequence with the sustained winners against torch's
picks, alternating, for several seconds each, with the SM clock and power sampled.

``--recipe block`` does the same for the FP8 block-scaled products (1x128 activation and 128x128
weight scales, what a DeepSeek- or Qwen-FP8 checkpoint runs through torch's ``F.scaled_mm``):
the best-fit heuristic's list, each algorithm id's own list and its tiles x stages, screened by
a burst each (``--sustain-top N``: only the N fastest then timed sustained against torch's call).

  python bench/bench_gemm_algos.py --model-size 8b --tokens 16384 --out gemm_algos.json
  python bench/bench_gemm_algos.py --recipe block --model-size 8b --out gemm_algos_block.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import MODELS, Sampler, header, shapes, timed
from workloads import H200_PEAK

WORKSPACE = 32 << 20


def build_ext():  # noqa: ANN201
    """JIT-build ``lt_gemm.cpp``, linked against the cuBLASLt that torch has loaded."""
    from torch.utils import cpp_extension

    loaded = [p for p in open("/proc/self/maps").read().split() if "/libcublasLt.so" in p]
    build_dir = Path(os.environ.get("TEACHER_SERVER_EXT_DIR", "/tmp")) / "lt_gemm_bench"
    build_dir.mkdir(parents=True, exist_ok=True)
    src = (Path(__file__).resolve().parent / "lt_gemm.cpp").read_text()
    return cpp_extension.load_inline(
        name="ts_lt_gemm_bench", cpp_sources=[src], with_cuda=True,
        functions=["lt_gemm_algos", "lt_gemm_out", "lt_block_algos", "lt_block_out"],
        extra_ldflags=loaded[:1] or ["-lcublasLt"], extra_cflags=["-O2"], build_directory=str(build_dir))


def sustained(fn, seconds: float) -> float:  # noqa: ANN001
    """Seconds per call over ~``seconds`` of back-to-back calls, after as long again of warm-up
    at the same load (the clock settles under the power limit within milliseconds)."""
    per = timed(fn, 3)
    iters = max(3, int(seconds / per))
    timed(fn, max(1, iters // 2))
    return timed(fn, iters)


def rank(name: str, rows: int, k: int, n: int, resid: bool, fl: float, cands: list[dict],
         args: argparse.Namespace, res: dict) -> dict:
    """Time one shape's candidates (``cands[0]`` torch's call): a burst each, then the torch call
    and the candidates (the ``--sustain-top`` fastest bursts where given) sustained in
    interleaved rounds; the winner."""
    for c in cands:
        c["burst_s"] = timed(c["fn"], 20)
    top = [cands[0]] + sorted(cands[1:], key=lambda c: c["burst_s"])[:args.sustain_top]  # (None: all)
    times: dict = {str(c["id"]): [] for c in top}
    for _ in range(args.rounds):
        for c in top:
            times[str(c["id"])].append(sustained(c["fn"], args.sustain_s))
    for c in top:
        c["sustained_s"] = min(times[str(c["id"])])
    best = min(top, key=lambda c: c["sustained_s"])
    d = cands[0]
    print(f"{name:>16} M={rows} K={k} N={n}: {len(cands) - 1} candidates; torch burst "
          f"{fl / d['burst_s'] / 1e12:.0f} sustained {fl / d['sustained_s'] / 1e12:.0f} TF/s; best #{best['id']} "
          f"burst {fl / best['burst_s'] / 1e12:.0f} sustained {fl / best['sustained_s'] / 1e12:.0f} TF/s "
          f"({d['sustained_s'] / best['sustained_s']:.3f}x)", flush=True)
    res["shapes"][name] = {
        "M": rows, "K": k, "N": n, "residual": resid, "best": best["id"],
        "candidates": [{kk: (fl / v / 1e12 if kk.endswith("_s") else v) for kk, v in c.items() if kk != "fn"}
                       | {"sustained_tflops_rounds": [fl / t / 1e12 for t in times.get(str(c["id"]), [])]}
                       for c in cands]}
    return best


def block_candidates(ext, ws: torch.Tensor, m: int, k: int, n: int, args: argparse.Namespace,  # noqa: ANN001
                     ) -> tuple[float, list[dict]]:
    """The FP8 block-scaled product at [m, k] x [n, k]^T: torch's call (``ops.fp8_block.block_mm``,
    as the engine makes it) and each cuBLASLt candidate that reproduces it."""
    from teacher_server.ops import fp8, fp8_block, fp8_mm
    from teacher_server.ops.fp8_quant import padded_rows

    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    wq, wsc0 = fp8_mm.quantize_weight(torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5, "block")
    wsc = fp8_block.pad_block_scale(wsc0)
    xq, xs = fp8.quantize_groups(x)

    def dflt() -> None:
        fp8_block.block_mm(xq, xs, wq, wsc, dt, None)

    ref = fp8_block.block_mm(xq, xs, wq, wsc, dt, None).float()
    xp, sp = fp8_block.pad_rows(xq, xs, padded_rows(m))
    sb = fp8_block.block_scale_b(wsc)
    out = torch.empty(xp.shape[0], n, device=dev, dtype=dt)
    algos = ext.lt_block_algos(xp, sp, wq, sb, out, args.max_algos, WORKSPACE, True)
    cands: list[dict] = [{"id": "torch", "fn": dflt}]
    for i in range(algos.shape[0]):
        row = algos[i].contiguous()

        def fn(row=row) -> None:  # noqa: ANN001
            ext.lt_block_out(xp, sp, wq, sb, out, row, ws)

        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"  block {k}->{n} algo {i}: {str(e)[:120]}", flush=True)
            continue
        err = (out[:m].float() - ref).abs().max().item()
        if not err <= 1e-2 * ref.abs().max().item():
            print(f"  block {k}->{n} algo {i} (source {int(row[-1])}): max error {err:.3g}: dropped", flush=True)
            continue
        cands.append({"id": i, "fn": fn, "source": int(row[-1]), "workspace": int(row[-3]),
                      "waves": int(row[-2]) / 1000, "max_err": err})
    cands += triton_candidates(xq, xs, wq, wsc0, ref, m)
    return 2.0 * m * k * n, cands


def triton_candidates(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, wsc: torch.Tensor, ref: torch.Tensor,
                      m: int) -> list[dict]:
    """The same product through the experts' Triton block-FP8 kernel (``ops.fp8_grouped``) as
    one expert, in a few tilings: a kernel of the service's own against cuBLASLt's."""
    from teacher_server.ops import fp8_grouped

    w3, s3 = wq.unsqueeze(0).contiguous(), wsc.float().unsqueeze(0).contiguous()
    offs = torch.tensor([m], device=xq.device, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count
    out: list[dict] = []
    for bm, bn, warps, stages, pers in ((64, 128, 4, 4, 0), (128, 128, 8, 3, 0), (128, 128, 8, 4, 0),
                                         (128, 256, 8, 3, 0), (128, 128, 8, 3, sms), (128, 256, 8, 3, sms)):
        tag = f"triton_bm{bm}_bn{bn}_w{warps}_s{stages}" + (f"_p{pers}" if pers else "")

        def fn(bm=bm, bn=bn, warps=warps, stages=stages, pers=pers) -> None:  # noqa: ANN001
            fp8_grouped.grouped_block_mm(xq, xs, w3, s3, offs, bm=bm, warps=warps, stages=stages, bn=bn,
                                         persistent=pers)

        try:
            got = fp8_grouped.grouped_block_mm(xq, xs, w3, s3, offs, bm=bm, warps=warps, stages=stages, bn=bn,
                                               persistent=pers)
            torch.cuda.synchronize()
        except Exception as e:  # a tiling Triton cannot compile here (shared memory): skipped
            print(f"  {tag}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if got is None:
            print("  the Triton kernel does not apply here", flush=True)
            return out
        err = (got.float() - ref).abs().max().item()
        if not err <= 1e-2 * ref.abs().max().item():
            print(f"  {tag}: max error {err:.3g}: dropped", flush=True)
            continue
        out.append({"id": tag, "fn": fn, "source": "triton", "max_err": err})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="8b", choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--max-algos", type=int, default=24)
    ap.add_argument("--sustain-s", type=float, default=0.4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layer-s", type=float, default=2.0)
    ap.add_argument("--layer-rounds", type=int, default=3)
    ap.add_argument("--recipe", default="bf16", choices=("bf16", "block"))
    ap.add_argument("--sustain-top", type=int, default=None,
                    help="candidates timed sustained: the fastest bursts (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ext = build_ext()
    cfg, dt, dev, m = MODELS[args.model_size], torch.bfloat16, torch.device("cuda"), args.tokens
    torch.manual_seed(0)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device=dev)
    res: dict = {**header(args.model_size), "recipe": args.recipe, "tokens": m, "shapes": {}, "layer": []}
    layer_default, layer_best, layer_flops = [], [], 0.0
    for name, k, n, resid in shapes(cfg):
        if name.startswith("linear_") or (args.recipe == "block" and name.startswith("lm_head")):
            continue
        if args.recipe == "block":  # no residual epilogue: the engine adds it after the product
            fl, cands = block_candidates(ext, ws, m, k, n, args)
            best = rank(name, m, k, n, False, fl, cands, args, res)
            layer_flops += fl
            layer_default.append(cands[0]["fn"])
            layer_best.append(best["fn"])
            continue
        lm = name.startswith("lm_head")
        rows = min(m, 8192) if lm else m
        x = torch.randn(rows, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
        out = torch.randn(rows, n, device=dev, dtype=torch.float32 if lm else dt)
        fl = 2.0 * rows * k * n
        if lm:
            def dflt(x=x, w=w, out=out) -> None:  # noqa: ANN001
                torch.mm(x, w.t(), out_dtype=torch.float32)  # a new [M, N] float32 tensor, as the engine
        elif resid:
            def dflt(x=x, w=w, out=out) -> None:  # noqa: ANN001
                out.addmm_(x, w.t())
        else:
            def dflt(x=x, w=w, out=out) -> None:  # noqa: ANN001
                torch.mm(x, w.t(), out=out)
        algos = ext.lt_gemm_algos(x, w, out, resid, args.max_algos, WORKSPACE)
        base = out.clone()
        ref = (x.float() @ w.float().t() + (base.float() if resid else 0)).to(out.dtype).float()
        cands: list[dict] = [{"id": "torch", "fn": dflt}]
        for i in range(algos.shape[0]):
            row = algos[i].contiguous()

            def fn(x=x, w=w, out=out, row=row, r=resid) -> None:  # noqa: ANN001
                ext.lt_gemm_out(x, w, out, r, row, ws)

            out.copy_(base)
            try:
                fn()
            except RuntimeError as e:
                print(f"  {name} algo {i}: {str(e)[:120]}", flush=True)
                continue
            err = (out.float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            if not err <= 0.02 * scale:
                print(f"  {name} algo {i}: max error {err:.3g} of {scale:.3g}: dropped", flush=True)
                continue
            cands.append({"id": i, "fn": fn, "workspace": int(row[-2]), "waves": int(row[-1]) / 1000,
                          "max_err": err})
        best = rank(name, rows, k, n, resid, fl, cands, args, res)
        if not lm:
            layer_flops += fl
            layer_default.append(cands[0]["fn"])
            layer_best.append(best["fn"])

    def run(fns: list) -> None:
        for f in fns:
            f()

    for r in range(args.layer_rounds):
        for label, fns in (("torch", layer_default), ("best", layer_best)):
            with Sampler() as smp:
                t0 = time.perf_counter()
                s = sustained(lambda fns=fns: run(fns), args.layer_s)
            row = {"round": r, "picks": label, "tflops": layer_flops / s / 1e12, "frac_peak": layer_flops / s / H200_PEAK,
                   "wall_s": time.perf_counter() - t0, **smp.summary()}
            res["layer"].append(row)
            print(f"layer {label:>5} round {r}: {row['tflops']:.0f} TF/s ({row['frac_peak']:.3f} of peak) "
                  f"clock {row.get('sm_clock_mhz_mean', 0):.0f} MHz power {row.get('power_w_mean', 0):.0f} W", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
