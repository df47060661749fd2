"""The GEMM rate at the engine's shapes: each projection of a model's layer at a step's token
count, timed alone (a short burst after warm-up; every burst first, on a cool GPU) and as the
layer's sequence run back to back for several seconds (sustained: the clock settles under the
power limit), with the SM clock, power and the clock's throttle reasons sampled meanwhile. The
engine interleaves memory-bound passes with its multiplies, so its GEMMs may run faster than
the sustained loop; the two rates bracket what a step's multiplies can do.

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


def smi_id() -> str:
    """This process's GPU as nvidia-smi names it: by UUID, since nvidia-smi ignores
    CUDA_VISIBLE_DEVICES (the CUDA index would name another GPU)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())


def smi(fields: str) -> list[str]:
    r = subprocess.run(["nvidia-smi", "-i", smi_id(), f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=10)
    return [x.strip() for x in r.stdout.strip().split(",")]


class Sampler:
    """nvidia-smi's SM clock, power and throttle reasons every 0.2 s while running."""

    FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown"

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, bool, bool]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        fields = self.FIELDS
        while not self._stop.is_set():
            try:
                got = smi(fields)
                a, b = float(got[0]), float(got[1])
                reasons = got[2:4] if len(got) >= 4 else ["", ""]
                self.rows.append((a, b, reasons[0] == "Active", reasons[1] == "Active"))
            except Exception:  # a driver without the throttle-reason fields: clock and power alone
                fields = "clocks.sm,power.draw"
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
        n = len(clocks)
        return {"sm_clock_mhz_mean": sum(clocks) / n, "sm_clock_mhz_min": min(clocks),
                "power_w_mean": sum(power) / n, "samples": n,
                "power_cap_throttled_frac": sum(r[2] for r in self.rows) / n,
                "hw_slowdown_frac": sum(r[3] for r in self.rows) / n}


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


def header(model_size: str) -> dict:
    """A results file's first fields: the GPU, torch, the model, the GPU's power and clock limits."""
    try:
        limits = dict(zip(("power_limit_w", "sm_clock_max_mhz"), smi("power.limit,clocks.max.sm")))
    except Exception as e:
        limits = {"error": str(e)[:200]}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model_size, "limits": limits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="8b", choices=list(MODELS))
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--sustain-s", type=float, default=6.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, dt, dev = MODELS[args.model_size], torch.bfloat16, torch.device("cuda")
    res: dict = {**header(args.model_size), "burst": {}, "burst_clocks": {}, "sustained": {}}
    weights = {name: torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for name, k, n, _ in shapes(cfg)}
    tokens = [int(x) for x in args.tokens.split(",")]
    layers = {}  # M -> (the layer's calls, their FLOPs)
    for m in tokens:  # every burst first, while the GPU is cool
        xs = {k: torch.randn(m, k, device=dev, dtype=dt) for k in {k for _, k, _, _ in shapes(cfg)}}
        layer_flops, calls = 0.0, []
        with Sampler() as smp:
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
        res["burst_clocks"][str(m)] = smp.summary()
        print(f"bursts at M={m}: {smp.summary()}", flush=True)
        layers[m] = (calls, layer_flops)
    for m in tokens:
        calls, layer_flops = layers[m]

        def layer(calls: list = calls) -> None:
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
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
