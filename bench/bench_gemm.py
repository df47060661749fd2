"""The GEMM ceiling at the engine's shapes: each projection of a model's layer at a step's
token count, timed alone (a short burst after warm-up) and as the layer's sequence run for
several seconds (sustained: the clocks settle under the power limit), with the SM clock and
power sampled meanwhile. The engine's own GEMM rate (its profile) is measured against these.

  python bench/bench_gemm.py --model-size 8b --tokens 8192,16384 --out gemm.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import H200_PEAK, QWEN3_5_9B, QWEN3_8B, QWEN3_32B

MODELS = {"8b": QWEN3_8B, "32b": QWEN3_32B, "qwen3.5-9b": QWEN3_5_9B}


def shapes(cfg: dict) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, residual in the epilogue) of a dense decoder layer's projections, plus the
    Gated DeltaNet in-projection for hybrid models and the LM head."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gate = 2 if cfg.get("layer_types") else 1  # Qwen3.5's full attention: q and its output gate
    out = [("qkv", h, (gate * nq + 2 * nkv) * d, False), ("o", nq * d, h, True),
           ("gate_up", h, 2 * i, False), ("down", i, h, True)]
    if cfg.get("layer_types"):
        kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        out.append(("linear_in", h, 2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"], False))
        out.append(("linear_out", vd, h, True))
    out.append(("lm_head_8k_rows", h, cfg["vocab_size"], False))
    return out


class Sampler:
    """nvidia-smi's SM clock and power every 0.2 s while running."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        dev = str(torch.cuda.current_device())
        while not self._stop.is_set():
            try:
                r = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=clocks.sm,power.draw",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                a, b = r.stdout.strip().split(",")[:2]
                self.rows.append((float(a), float(b)))
            except Exception:
                pass
            time.sleep(0.2)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        clocks, power = [r[0] for r in self.rows], [r[1] for r in self.rows]
        return {"sm_clock_mhz_mean": sum(clocks) / len(clocks), "sm_clock_mhz_min": min(clocks),
                "power_w_mean": sum(power) / len(power), "samples": len(clocks)}


def timed(fn, iters: int) -> float:  # noqa: ANN001
    """Seconds per call of fn over ``iters`` calls (CUDA events, after one warm-up call)."""
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="8b", choices=list(MODELS))
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--sustain-s", type=float, default=6.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, dt, dev = MODELS[args.model_size], torch.bfloat16, torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model_size,
                 "burst": {}, "sustained": {}}
    weights = {name: torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for name, k, n, _ in shapes(cfg)}
    for m in (int(x) for x in args.tokens.split(",")):
        xs = {k: torch.randn(m, k, device=dev, dtype=dt) for k in {k for _, k, _, _ in shapes(cfg)}}
        layer_flops, calls = 0.0, []
        for name, k, n, resid in shapes(cfg):
            rows = min(m, 8192) if name.startswith("lm_head") else m
            x, w = xs[k][:rows], weights[name]
            out = torch.randn(rows, n, device=dev, dtype=dt)
            fl = 2.0 * rows * k * n
            s_mm = timed(lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out), 20)
            row = {"M": rows, "K": k, "N": n, "mm_tflops": fl / s_mm / 1e12, "mm_frac_peak": fl / s_mm / H200_PEAK}
            if resid:
                s_add = timed(lambda x=x, w=w, out=out: out.addmm_(x, w.t()), 20)
                row.update(addmm_tflops=fl / s_add / 1e12, addmm_frac_peak=fl / s_add / H200_PEAK)
            res["burst"][f"{name}@{m}"] = row
            print(f"{name:>16} M={rows:6d} K={k:6d} N={n:6d}  mm {row['mm_tflops']:6.0f} TF/s"
                  + (f"  addmm {row['addmm_tflops']:6.0f}" if resid else ""), flush=True)
            if not name.startswith("lm_head"):
                layer_flops += fl
                calls.append((lambda x=x, w=w, out=out, r=resid: out.addmm_(x, w.t()) if r
                              else torch.mm(x, w.t(), out=out)))

        def layer() -> None:
            for c in calls:
                c()

        per = timed(layer, 5)
        iters = max(1, int(args.sustain_s / per))
        with Sampler() as smp:
            s = timed(layer, iters)
        res["sustained"][str(m)] = {"tflops": layer_flops / s / 1e12, "frac_peak": layer_flops / s / H200_PEAK,
                                    "seconds": s * iters, **smp.summary()}
        print(f"sustained layer GEMMs M={m}: {layer_flops / s / 1e12:.0f} TF/s "
              f"({layer_flops / s / H200_PEAK:.3f} of peak) {smp.summary()}", flush=True)
        del xs
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
