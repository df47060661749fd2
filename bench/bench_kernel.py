"""Bench the gather-logprob kernel against the device's copy bandwidth, the scoring stage
(LM head in float32 row chunks + kernel) against the LM-head matmul alone and the naive
``log_softmax(logits.float()).gather`` path, and the qkv_rope kernel (split, q/k norm,
rotary, KV-pool write) at each of its items-per-group settings against the copy bandwidth
and the eager torch stages.

    python bench/bench_kernel.py [--out bench/results/kernel_h200.json]

Times are medians of CUDA-event timings after warm-up, on random (never zero) data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from teacher_server.ops import extension  # noqa: E402
from teacher_server.ops import gather_logprob as glp  # noqa: E402
from teacher_server.ops.qkv_rope import HeadLayout, qkv_prep, qkv_rope  # noqa: E402


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over iters runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak memory fn() allocates beyond what is already allocated."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_copy(gib: float, iters: int, warmup: int) -> dict:
    """Device-to-device copy: bytes read + written per second."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, warmup)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_read_plus_written": moved, "ms": ms, "gb_s": moved / ms / 1e6}


def bench_gather(rows: int, vocab: int, k: int, dtype: torch.dtype, copy_gb_s: float, iters: int, warmup: int) -> dict:
    """The kernel alone on [rows, vocab] logits, per-row int32 candidates."""
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)  # [R, V]
    cand = torch.randint(0, vocab, (rows, k), device="cuda", dtype=torch.int32)  # [R, K]
    out = torch.empty(rows, k, device="cuda")  # [R, K] float32
    ms = time_ms(lambda: glp.gather_logprobs(logits, cand, out=out), iters, warmup)
    moved = logits.numel() * logits.element_size() + cand.numel() * 4 + out.numel() * 4
    # Spot check a few rows against float64 so a fast wrong kernel cannot pass unnoticed.
    x = logits[:8].double()
    want = x.gather(1, cand[:8].long()) - torch.logsumexp(x, -1, keepdim=True)
    err = (out[:8].double() - want).abs().max().item()
    gb_s = moved / ms / 1e6
    return {
        "rows": rows, "vocab": vocab, "k": k, "dtype": str(dtype).removeprefix("torch."),
        "bytes": moved, "ms": ms, "gb_s": gb_s, "pct_of_copy": 100 * gb_s / copy_gb_s,
        "max_abs_err_vs_f64": err,
    }


def load_baseline_library(src: Path):  # noqa: ANN201
    """The kernel library built from another checkout's ``kernels/`` (an older commit's, to
    time its kernels beside this one's in one process), under a module name of its own."""
    return extension.build_extension(False, name="ts_kernels_baseline", src=src)


def bench_qkv(tokens: int, hq: int, hkv: int, d: int, copy_gb_s: float, iters: int, warmup: int,
              baseline=None) -> dict:  # noqa: ANN001
    """qkv_rope at a step of ``tokens`` (Qwen3's q/k norm on, every token's k and v written
    to a pool twice the step's size), per items-per-group setting; the eager torch stages
    (``qkv_prep``, then the indexed stores) beside it, and ``baseline``'s kernel (a library
    from ``load_baseline_library``) when given. Bytes: qkv read, q/k/v and the pool rows
    written."""
    dt = torch.bfloat16
    heads = HeadLayout(hq, hkv, d, 1e-6)
    qkv = torch.randn(tokens, heads.width, device="cuda", dtype=dt) * 3
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = pos[:, None].float() * inv[None]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)  # [T, d] float32
    qn, kn = ((1 + 0.2 * torch.randn(d, device="cuda")).to(dt) for _ in range(2))
    slots = torch.randperm(2 * tokens, device="cuda")[:tokens]
    kc, vc = (torch.zeros(2 * tokens, hkv, d, device="cuda", dtype=dt) for _ in range(2))
    moved = qkv.numel() * 2 + tokens * (hq + 2 * hkv) * d * 2 + 2 * tokens * hkv * d * 2
    res: dict = {"tokens": tokens, "hq": hq, "hkv": hkv, "d": d, "bytes": moved, "kernel": {}}
    first = None
    for u in (1, 2, 4, 8):
        ms = time_ms(lambda u=u: qkv_rope(qkv, cs, qn, kn, heads, kc, vc, slots, items_per_group=u), iters, warmup)
        out = qkv_rope(qkv, cs, qn, kn, heads, kc, vc, slots, items_per_group=u)
        first = out if first is None else first
        same = all(torch.equal(a, b) for a, b in zip(out, first))  # every setting computes the same bits
        res["kernel"][str(u)] = {"ms": ms, "gb_s": moved / ms / 1e6, "pct_of_copy": 100 * moved / ms / 1e6 / copy_gb_s,
                                 "same_bits_as_1": same}
    half = d // 2

    def eager() -> None:
        q, k, v = qkv_prep(qkv, cs[:, None, :half], cs[:, None, half:], qn, kn, hq, hkv, d, 1e-6)
        kc[slots] = k
        vc[slots] = v

    res["eager_ms"] = time_ms(eager, iters, warmup)
    if baseline is not None:  # its own outputs, laid out as the current kernel's (q, k, v contiguous)
        outs = [torch.empty_like(x) for x in first]
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)

        def base() -> None:
            baseline.qkv_rope_out(qkv, cs, qn, kn, 1e-6, *outs, kc2, vc2, slots)

        ms = time_ms(base, iters, warmup)
        res["baseline_kernel"] = {"ms": ms, "gb_s": moved / ms / 1e6, "pct_of_copy": 100 * moved / ms / 1e6 / copy_gb_s,
                                  "equal_fraction_vs_kernel": min((a == b).float().mean().item()
                                                                  for a, b in zip(outs, first))}
    ref = qkv_prep(qkv, cs[:, None, :half], cs[:, None, half:], qn, kn, hq, hkv, d, 1e-6)
    res["max_abs_diff_vs_eager"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(first, ref))
    res["equal_fraction_vs_eager"] = min((a == b).float().mean().item() for a, b in zip(first, ref))
    return res


def make_lm_head() -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]:
    """[r, H] bf16 x [V, H]^T bf16 -> [r, V] float32, with float32 output from the GEMM
    itself when torch.mm supports out_dtype, else a bf16 GEMM then .float()."""
    a = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    try:
        y = torch.mm(a, b.t(), out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (16, 32)
        return (lambda h, w: torch.mm(h, w.t(), out_dtype=torch.float32)), "torch.mm(out_dtype=float32)"
    except (TypeError, RuntimeError, AssertionError) as e:
        print(f"note: torch.mm(out_dtype=float32) unsupported ({type(e).__name__}); using bf16 mm + .float()")
        return (lambda h, w: torch.mm(h, w.t()).float()), "bf16 mm + .float() (out_dtype unsupported)"


def bench_scoring(rows: int, vocab: int, hidden: int, k: int, chunk_rows: int, iters: int, warmup: int) -> dict:
    """Scoring stage on hidden [rows, hidden] bf16 and an LM head [vocab, hidden] bf16."""
    lm_head, mm_mode = make_lm_head()
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)  # [R, H]
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5  # [V, H]
    cand = torch.randint(0, vocab, (rows, k), device="cuda", dtype=torch.int32)  # [R, K]
    out = torch.empty(rows, k, device="cuda")  # [R, K] float32
    chunks = [(r0, min(r0 + chunk_rows, rows)) for r0 in range(0, rows, chunk_rows)]

    def matmul_only() -> None:
        for r0, r1 in chunks:
            lm_head(h[r0:r1], w)  # [r, V] float32, dropped

    def scoring() -> None:
        for r0, r1 in chunks:
            logits = lm_head(h[r0:r1], w)  # [r, V] float32
            glp.gather_logprobs(logits, cand[r0:r1], out=out[r0:r1])

    cand_long = cand.long()

    def naive_post(logits_bf16: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits_bf16.float(), -1).gather(1, cand_long)  # [R, K]

    def naive() -> None:
        naive_post(h @ w.t())  # full [R, V] bf16 logits

    res: dict = {"rows": rows, "vocab": vocab, "hidden": hidden, "k": k, "chunk_rows": chunk_rows, "matmul_mode": mm_mode}
    flops = 2 * rows * hidden * vocab
    res["matmul_ms"] = time_ms(matmul_only, iters, warmup)
    res["matmul_tflops"] = flops / res["matmul_ms"] / 1e9
    res["scoring_ms"] = time_ms(scoring, iters, warmup)
    res["scoring_over_matmul"] = res["scoring_ms"] / res["matmul_ms"]
    res["naive_ms"] = time_ms(naive, iters, warmup)
    res["naive_post_matmul_ms"] = time_ms(partial(naive_post, h @ w.t()), iters, warmup)  # logits [R, V] bf16
    res["naive_over_scoring"] = res["naive_ms"] / res["scoring_ms"]
    res["matmul_peak_extra_gib"] = peak_extra_bytes(matmul_only) / 2**30
    res["scoring_peak_extra_gib"] = peak_extra_bytes(scoring) / 2**30
    res["naive_peak_extra_gib"] = peak_extra_bytes(naive) / 2**30
    # The fp32-logit scores vs the naive bf16-logit ones: how much bf16 logits cost.
    scoring()
    res["max_abs_diff_naive_bf16_vs_fp32_logits"] = (naive_post(h @ w.t()) - out).abs().max().item()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk-rows", type=int, default=4096, help="LM-head row chunk of the scoring stage")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth buffer")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-scoring", action="store_true", help="kernels and copy only")
    p.add_argument("--qkv-tokens", type=int, default=16384, help="step size of the qkv_rope bench (0: skip it)")
    p.add_argument("--qkv-heads", default="32,8,128", help="query heads, kv heads, head dim (Qwen3-8B)")
    p.add_argument("--qkv-baseline-src", type=Path, default=None,
                   help="another checkout's kernels/ (an older commit's): its qkv_rope kernel is timed beside")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kernel_h200.json")
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    lib = extension.build()  # raises with the compiler's message if the kernel cannot be built
    build_s = time.perf_counter() - t0
    assert extension.available()
    torch.manual_seed(0)

    copy = bench_copy(args.copy_gib, 2 * args.iters, args.warmup)
    kernel = [
        bench_gather(args.rows, args.vocab, args.k, dt, copy["gb_s"], 2 * args.iters, args.warmup)
        for dt in (torch.float32, torch.bfloat16)
    ]
    torch.cuda.empty_cache()
    qkv = None
    if args.qkv_tokens:
        hq, hkv, d = (int(x) for x in args.qkv_heads.split(","))
        baseline = load_baseline_library(args.qkv_baseline_src) if args.qkv_baseline_src else None
        qkv = bench_qkv(args.qkv_tokens, hq, hkv, d, copy["gb_s"], 2 * args.iters, args.warmup, baseline)
        if baseline is not None:
            qkv["baseline_src"] = str(args.qkv_baseline_src)
        torch.cuda.empty_cache()
    scoring = None
    if not args.skip_scoring:
        scoring = bench_scoring(args.rows, args.vocab, args.hidden, args.k, args.chunk_rows, args.iters, args.warmup)

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel_library": str(lib),
        "build_or_load_s": build_s,
        "copy": copy,
        "gather_kernel": kernel,
        "qkv_rope": qkv,
        "scoring": scoring,
        "total_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{results['device']}  torch {results['torch']}  cuda {results['cuda']}  -> {args.out}")
    print(f"{'what':<52}{'ms':>10}{'GB/s':>10}{'% copy':>9}{'err':>10}")
    print(f"{'device copy (read+write) ' + format(args.copy_gib, 'g') + ' GiB':<52}{copy['ms']:>10.3f}{copy['gb_s']:>10.0f}")
    for r in kernel:
        name = f"gather kernel R={r['rows']} V={r['vocab']} K={r['k']} {r['dtype']}"
        print(f"{name:<52}{r['ms']:>10.3f}{r['gb_s']:>10.0f}{r['pct_of_copy']:>8.1f}%{r['max_abs_err_vs_f64']:>10.1e}")
    if qkv:
        print(f"\nqkv_rope: {qkv['tokens']} tokens, {qkv['hq']} q / {qkv['hkv']} kv heads of {qkv['d']}, "
              f"q/k norm, every k/v written to the pool ({qkv['bytes'] / 1e6:.0f} MB moved)")
        for u, r in qkv["kernel"].items():
            print(f"{'  kernel, at most ' + u + ' head(s) per group':<52}{r['ms']:>10.3f}{r['gb_s']:>10.0f}"
                  f"{r['pct_of_copy']:>8.1f}%  same bits: {r['same_bits_as_1']}")
        if "baseline_kernel" in qkv:
            b = qkv["baseline_kernel"]
            print(f"{'  kernel of ' + qkv['baseline_src']:<52}{b['ms']:>10.3f}{b['gb_s']:>10.0f}"
                  f"{b['pct_of_copy']:>8.1f}%  equal to this one's: {100 * b['equal_fraction_vs_kernel']:.2f}%")
        print(f"{'  eager torch stages':<52}{qkv['eager_ms']:>10.3f}   max |kernel - eager| "
              f"{qkv['max_abs_diff_vs_eager']:.3g}, equal {100 * qkv['equal_fraction_vs_eager']:.2f}%")
    if scoring:
        s = scoring
        print(f"\nscoring stage: hidden [{s['rows']}, {s['hidden']}] bf16, LM head [{s['vocab']}, {s['hidden']}] bf16, "
              f"chunks of {s['chunk_rows']} rows, {s['matmul_mode']}")
        print(f"{'what':<52}{'ms':>10}{'peak GiB':>10}")
        print(f"{'(i) LM head fp32 logits alone (' + format(s['matmul_tflops'], '.0f') + ' TFLOP/s)':<52}"
              f"{s['matmul_ms']:>10.2f}{s['matmul_peak_extra_gib']:>10.2f}")
        print(f"{'(ii) LM head chunks + gather kernel':<52}{s['scoring_ms']:>10.2f}{s['scoring_peak_extra_gib']:>10.2f}")
        print(f"{'(iii) naive: bf16 logits, log_softmax(float).gather':<52}{s['naive_ms']:>10.2f}"
              f"{s['naive_peak_extra_gib']:>10.2f}")
        print(f"{'     of which after the matmul':<52}{s['naive_post_matmul_ms']:>10.2f}")
        print(f"scoring/matmul = {s['scoring_over_matmul']:.3f}   naive/scoring = {s['naive_over_scoring']:.2f}   "
              f"max |naive bf16 - fp32| = {s['max_abs_diff_naive_bf16_vs_fp32_logits']:.3f} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
