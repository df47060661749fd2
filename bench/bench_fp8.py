"""FP8 against bf16 for one decoder layer's projections, sustained under the GPU's power cap.

For each model shape (Qwen3-8B, Qwen3-32B at T tokens) the layer's four projections (qkv, o,
gate_up, down) run back to back for ``--sustain-s`` seconds per case (CUDA events; the SM
clock and power sampled meanwhile), after a pre-heat so every case runs at the cap:

- ``bf16_gemm``: the four bf16 GEMMs; ``bf16_layer``: with the layer's elementwise passes
  (RMSNorm, add + RMSNorm, SiLU-mul: torch's eager ops, as the FP8 variants use them);
- ``fp8_{tensor,row,block}_gemm``: the four scaled multiplies on pre-quantized activations
  (tensor: static per-tensor activation scales; row: per-token; block: 1x128 activations and
  128x128 weights);
- ``..._separate``: the bf16 layer's passes, then each activation quantized in a pass of its own;
- ``..._fused``: RMSNorm and SiLU-mul write FP8 and scales directly (``ops.fp8``'s fused
  kernels); the attention output before ``o`` is still quantized in a pass of its own.

Then the experts' multiplies of Qwen3-30B-A3B (128 experts, top-8, hidden 2048, intermediate
768; T tokens routed at random, so 8T rows): bf16 grouped GEMM against FP8 grouped, row-wise
and 128x128-block (both ``ops.fp8_grouped``'s Triton kernel, 64-row tiles), each as GEMMs
alone, with the quantization passes separate, and with SiLU-mul's fused; on the GPU also the
block kernel's 128-row tiles and torch's grouped row-wise kernel (with and without fast
accumulation), the paths not taken by default.

TFLOP/s counts the GEMMs' FLOPs only, so a case with passes shows its effective rate;
``speedup`` is against the bf16 case of the same kind (gemm against bf16_gemm, the others
against bf16_layer). A first check gives each FP8 mode's relative RMS error against the bf16
product; the quantization kernels are also timed alone (GB/s at the first model's widths).
``--tiny`` runs tiny shapes on the CPU (a smoke test of the script).

  python bench/bench_fp8.py --out fp8.json                     (H200: ~3-4 minutes)
  python bench/bench_fp8.py --tiny --out /tmp/fp8_tiny.json    (CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import H200_PEAK, QWEN3_8B, QWEN3_30B_A3B, QWEN3_32B

from teacher_server.ops import fp8, fp8_grouped
from teacher_server.ops.grouped_mm import GroupedGemm
from teacher_server.ops.norm import add_rms_norm, rms_norm

MODELS = {"8b": QWEN3_8B, "32b": QWEN3_32B}
TINY = dict(QWEN3_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)
TINY_MOE = dict(QWEN3_30B_A3B, hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
MODES = ("tensor", "row", "block")
EPS = 1e-6


def _act_mode(mode: str) -> str:
    return {"tensor": "tensor", "row": "row", "block": "group"}[mode]


class Clock:
    """Seconds per call of a function: CUDA events on the GPU, wall time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def per_call(self, fn: Callable[[], object], iters: int) -> float:
        fn()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) / iters
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / iters


def _sampler(cuda: bool) -> contextlib.AbstractContextManager:
    if not cuda:
        return contextlib.nullcontext()
    from bench_gemm import Sampler
    return Sampler()


def _quant(x: torch.Tensor, mode: str, static: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation quantized in a pass of its own."""
    if mode == "tensor":
        return fp8.quantize_tensor(x, static)
    return fp8.quantize_rows(x) if mode == "row" else fp8.quantize_groups(x)


class DenseLayer:
    """One decoder layer's weights (bf16 and each FP8 mode), inputs and the cases over them."""

    def __init__(self, cfg: dict, t: int, dev: torch.device, fast_accum: bool = False) -> None:
        h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

        self.proj = {"qkv": (h, (nq + 2 * nkv) * d), "o": (nq * d, h), "gate_up": (h, 2 * i), "down": (i, h)}
        self.w = {n: rand(nn, k, scale=k ** -0.5) for n, (k, nn) in self.proj.items()}
        self.flops = sum(2.0 * t * k * nn for k, nn in self.proj.values())
        self.x, self.attn = rand(t, h), rand(t, nq * d)
        self.norm1, self.norm2 = 1 + 0.1 * rand(h), 1 + 0.1 * rand(h)
        self.wq = {m: {n: fp8.quantize_weight(w, m) for n, w in self.w.items()} for m in MODES}
        # static activation scales for the tensor mode (as a checkpoint's input_scale): from this data
        h1 = rms_norm(self.x, self.norm1, EPS)
        self.static = {n: (a.float().abs().amax() / fp8.FP8_MAX).reshape(1) for n, a in
                       (("qkv", h1), ("o", self.attn), ("gate_up", h1),
                        ("down", fp8.silu_mul_reference(h1 @ self.w["gate_up"].t())))}
        self.t, self.i, self.fast_accum = t, i, fast_accum

    def mm(self, name: str, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w[name].t()

    def smm(self, mode: str, name: str, q: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        wq, ws = self.wq[mode][name]
        return fp8.scaled_linear(q[0], q[1], wq, ws, mode, fast_accum=self.fast_accum)

    def cases(self) -> dict[str, Callable[[], object]]:
        x, attn = self.x, self.attn
        out: dict[str, Callable[[], object]] = {}
        inputs = {"qkv": x, "o": attn, "gate_up": x, "down": torch.zeros(self.t, self.i, device=x.device,
                                                                            dtype=x.dtype).normal_()}
        out["bf16_gemm"] = lambda: [self.mm(n, a) for n, a in inputs.items()]

        def bf16_layer() -> None:
            self.mm("qkv", rms_norm(x, self.norm1, EPS))
            o = self.mm("o", attn)
            _, h2 = add_rms_norm(x, o, self.norm2, EPS)
            self.mm("down", fp8.silu_mul_reference(self.mm("gate_up", h2)))

        out["bf16_layer"] = bf16_layer
        for mode in MODES:
            am = _act_mode(mode)
            st = self.static
            pre = {n: _quant(a, mode, st[n]) for n, a in inputs.items()}
            out[f"fp8_{mode}_gemm"] = lambda mode=mode, pre=pre: [self.smm(mode, n, q) for n, q in pre.items()]

            def separate(mode: str = mode) -> None:
                self.smm(mode, "qkv", _quant(rms_norm(x, self.norm1, EPS), mode, st["qkv"]))
                o = self.smm(mode, "o", _quant(attn, mode, st["o"]))
                _, h2 = add_rms_norm(x, o, self.norm2, EPS)
                gu = self.smm(mode, "gate_up", _quant(h2, mode, st["gate_up"]))
                self.smm(mode, "down", _quant(fp8.silu_mul_reference(gu), mode, st["down"]))

            def fused(mode: str = mode, am: str = am) -> None:
                tensor = mode == "tensor"
                self.smm(mode, "qkv", fp8.rms_norm_quant(x, self.norm1, EPS, am, st["qkv"] if tensor else None))
                o = self.smm(mode, "o", _quant(attn, mode, st["o"]))
                _, *h2 = fp8.add_rms_norm_quant(x, o, self.norm2, EPS, am, st["gate_up"] if tensor else None)
                gu = self.smm(mode, "gate_up", tuple(h2))
                self.smm(mode, "down", fp8.silu_mul_quant(gu, am, st["down"] if tensor else None))

            out[f"fp8_{mode}_separate"], out[f"fp8_{mode}_fused"] = separate, fused
        return out

    def accuracy(self) -> dict[str, float]:
        """Each mode's relative RMS error against the bf16 product, over the four projections."""
        res = {}
        for mode in MODES:
            num = den = 0.0
            for n, a in (("qkv", self.x), ("o", self.attn), ("gate_up", self.x)):
                ref = self.mm(n, a).float()
                got = self.smm(mode, n, _quant(a, mode, (a.float().abs().amax() / fp8.FP8_MAX).reshape(1))).float()
                num += (got - ref).pow(2).sum().item()
                den += ref.pow(2).sum().item()
            res[mode] = (num / den) ** 0.5
        return res


class MoeLayer:
    """The routed experts' two grouped multiplies of a Qwen3-MoE layer: bf16, FP8 row-wise and
    FP8 128x128-block (``ops.fp8_grouped``'s Triton kernel; torch's row-wise kernel on the GPU)."""

    def __init__(self, cfg: dict, t: int, dev: torch.device) -> None:
        h, i, e, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
        g = torch.Generator(device=dev).manual_seed(1)
        m = t * k
        choice = torch.rand(t, e, device=dev, generator=g).topk(k, dim=-1).indices.flatten()  # random routing
        self.offs = torch.bincount(choice, minlength=e).cumsum(0).to(torch.int32)
        self.x = torch.randn(m, h, device=dev, generator=g).bfloat16()
        self.w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) * h ** -0.5).bfloat16()
        self.w2 = (torch.randn(e, h, i, device=dev, generator=g) * i ** -0.5).bfloat16()
        self.q = {mode: (fp8.quantize_weight(self.w13, mode), fp8.quantize_weight(self.w2, mode))
                  for mode in ("row", "block")}
        self.mid = torch.randn(m, i, device=dev, generator=g).bfloat16()
        self.flops = 2.0 * m * h * 2 * i + 2.0 * m * i * h
        self.gg = GroupedGemm()

    def cases(self) -> dict[str, Callable[[], object]]:
        x, offs = self.x, self.offs

        def bf16_layer() -> None:
            gu = self.gg(x, self.w13.transpose(1, 2), offs)
            self.gg(fp8.silu_mul_reference(gu), self.w2.transpose(1, 2), offs)

        out: dict[str, Callable[[], object]] = {
            "bf16_gemm": lambda: (self.gg(x, self.w13.transpose(1, 2), offs),
                                  self.gg(self.mid, self.w2.transpose(1, 2), offs)),
            "bf16_layer": bf16_layer}
        for mode in ("row", "block"):
            q13, q2 = self.q[mode]
            quant = fp8.quantize_rows if mode == "row" else fp8.quantize_groups
            xq, midq = quant(x), quant(self.mid)
            am = _act_mode(mode)

            def gemm(mode: str = mode, q13: tuple = q13, q2: tuple = q2, xq: tuple = xq, midq: tuple = midq) -> None:
                fp8.grouped_scaled_linear(*xq, *q13, offs, mode)
                fp8.grouped_scaled_linear(*midq, *q2, offs, mode)

            def separate(mode: str = mode, q13: tuple = q13, q2: tuple = q2, quant: Callable = quant) -> None:
                gu = fp8.grouped_scaled_linear(*quant(x), *q13, offs, mode)
                fp8.grouped_scaled_linear(*quant(fp8.silu_mul_reference(gu)), *q2, offs, mode)

            def fused(mode: str = mode, q13: tuple = q13, q2: tuple = q2, quant: Callable = quant,
                      am: str = am) -> None:
                gu = fp8.grouped_scaled_linear(*quant(x), *q13, offs, mode)
                fp8.grouped_scaled_linear(*fp8.silu_mul_quant(gu, am), *q2, offs, mode)

            out.update({f"fp8_{mode}_gemm": gemm, f"fp8_{mode}_separate": separate, f"fp8_{mode}_fused": fused})
        (w13, s13), (w2, s2) = self.q["block"]
        xq, midq = fp8.quantize_groups(x), fp8.quantize_groups(self.mid)
        if x.is_cuda:  # the paths not taken by default: the block kernel's 128-row tiles, torch's row-wise kernel
            out["fp8_block_gemm_bm128"] = lambda: (fp8_grouped.grouped_block_mm(*xq, w13, s13, offs, bm=128),
                                                   fp8_grouped.grouped_block_mm(*midq, w2, s2, offs, bm=128))
            (r13, rs13), (r2, rs2) = self.q["row"]
            xr, midr = fp8.quantize_rows(x), fp8.quantize_rows(self.mid)
            for fast in (False, True):
                out[f"fp8_row_gemm_torch{'_fast_accum' if fast else ''}"] = lambda fast=fast: (
                    fp8.grouped_scaled_linear(*xr, r13, rs13, offs, "row", backend="torch", fast_accum=fast),
                    fp8.grouped_scaled_linear(*midr, r2, rs2, offs, "row", backend="torch", fast_accum=fast))
        return out

    def accuracy(self) -> dict[str, float]:
        ref = self.gg(self.x, self.w13.transpose(1, 2), self.offs).float()
        res = {}
        for mode in ("row", "block"):
            quant = fp8.quantize_rows if mode == "row" else fp8.quantize_groups
            got = fp8.grouped_scaled_linear(*quant(self.x), *self.q[mode][0], self.offs, mode).float()
            res[mode] = ((got - ref).pow(2).sum() / ref.pow(2).sum()).sqrt().item()
        return res


def run_cases(name: str, layer: DenseLayer | MoeLayer, clock: Clock, sustain_s: float, cuda: bool) -> dict:
    res: dict = {"gemm_gflop": layer.flops / 1e9, "rel_rms_error_vs_bf16": layer.accuracy(), "cases": {}}
    base = {}
    for case, fn in layer.cases().items():
        per = clock.per_call(fn, 2)
        iters = max(2, int(sustain_s / max(per, 1e-9)))
        with _sampler(cuda) as smp:
            s = clock.per_call(fn, iters)
        row = {"ms": s * 1e3, "tflops": layer.flops / s / 1e12, "iters": iters,
               **(smp.summary() if smp is not None else {})}
        if cuda:
            row["frac_bf16_peak"] = layer.flops / s / H200_PEAK
        kind = "gemm" if "_gemm" in case else "layer"
        if case.startswith("bf16"):
            base[kind] = s
        row["speedup"] = base[kind] / s if kind in base else None
        res["cases"][case] = row
        clk = f"{row['sm_clock_mhz_mean']:5.0f} MHz {row['power_w_mean']:4.0f} W" if "sm_clock_mhz_mean" in row else ""
        print(f"{name:>8} {case:>18} {row['ms']:9.3f} ms {row['tflops']:7.1f} TF/s  x{row['speedup']:.2f}  {clk}",
              flush=True)
    return res


def quant_rates(t: int, h: int, i: int, dev: torch.device, clock: Clock) -> dict:
    """The quantization kernels alone: GB/s moved (bytes read + written, scales left out) at a
    layer's widths; the H200's HBM moves about 4,800 GB/s."""
    g = torch.Generator(device=dev).manual_seed(2)
    x, d = (torch.randn(t, h, device=dev, generator=g).bfloat16() for _ in range(2))
    w = torch.ones(h, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(t, 2 * i, device=dev, generator=g).bfloat16()
    cases = {  # name: (call, bytes moved)
        "rows": (lambda: fp8.quantize_rows(x), 3 * t * h),
        "groups": (lambda: fp8.quantize_groups(x), 3 * t * h),
        "add_rms_norm_rows": (lambda: fp8.add_rms_norm_quant(x, d, w, EPS, "row"), 7 * t * h),
        "silu_mul_rows": (lambda: fp8.silu_mul_quant(gu, "row"), 5 * t * i),
        "silu_mul_groups": (lambda: fp8.silu_mul_quant(gu, "group"), 5 * t * i),
    }
    res = {}
    for name, (fn, nbytes) in cases.items():
        s = clock.per_call(fn, 20)
        res[name] = {"ms": s * 1e3, "gb_per_s": nbytes / s / 1e9}
        print(f"{'quant':>8} {name:>18} {s * 1e3:9.3f} ms {nbytes / s / 1e9:7.0f} GB/s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="8b,32b", help="dense shapes, of " + ",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--sustain-s", type=float, default=5.0, help="seconds each case runs back to back")
    ap.add_argument("--fast-accum", action="store_true", help="the dense multiplies' use_fast_accum (Hopper)")
    ap.add_argument("--preheat-s", type=float, default=5.0, help="seconds of bf16 GEMMs first, to reach the cap")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda)
    if args.tiny:
        models, t, moe, sustain, preheat = {"tiny": TINY}, 64, TINY_MOE, 0.02, 0.0
    else:
        models = {m: MODELS[m] for m in args.models.split(",") if m}
        t, moe, sustain, preheat = args.tokens, QWEN3_30B_A3B, args.sustain_s, args.preheat_s
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "tokens": t, "sustain_s": sustain, "fast_accum": args.fast_accum, "models": {}}
    if cuda:
        from bench_gemm import header
        res.update(header(args.models))
    print(f"{'shape':>8} {'case':>18} {'per layer':>12} {'GEMM rate':>12}  {'vs bf16':>6}", flush=True)
    for name, cfg in models.items():
        layer = DenseLayer(cfg, t, dev, args.fast_accum)
        if preheat:
            fn = layer.cases()["bf16_gemm"]
            clock.per_call(fn, max(1, int(preheat / clock.per_call(fn, 2))))
        res["models"][name] = run_cases(name, layer, clock, sustain, cuda)
        del layer
        if cuda:
            torch.cuda.empty_cache()
    first = next(iter(models.values()))
    res["quant_kernels"] = quant_rates(t, first["hidden_size"], first["intermediate_size"], dev, clock)
    if not args.no_moe:
        name = "tiny_moe" if args.tiny else "30b_a3b"
        res["models"][name] = run_cases(name, MoeLayer(moe, t, dev), clock, sustain, cuda)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
