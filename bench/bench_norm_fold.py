"""The post-attention RMSNorm folded into the fused gate/up kernel, against the engine's order.

The engine's order for a dense layer's second half: the o projection onto the residual stream
(cuBLAS, the sum in the epilogue), RMSNorm of the stream (a pass that reads it and writes the
normed copy), the fused gate/up SiLU kernel on the copy, the down projection onto the stream.
Folded: the norm's weight is multiplied into the gate/up weight's columns once, and the kernel
takes the stream itself, summing each row's squares from the tiles its dots read and scaling
its products by 1 / rms before they are rounded (``gate_up_silu(..., norm_eps=eps)``): no pass,
no copy. Both sequences run with random data in every input, in interleaved rounds for several
seconds each (sustained: the clock settles under the power limit), with the SM clock and power
sampled; the MLP alone (norm + kernel against the folded kernel) is timed the same way.
Accuracy: each path's SiLU-mul output against a float32 computation of the norm and the
projections on the same bf16 stream and weights.

  python bench/bench_norm_fold.py --model-size 8b,32b --tokens 16384 --out norm_fold.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_gemm import Sampler, header, timed
from workloads import H200_PEAK, QWEN3_8B, QWEN3_32B

from teacher_server.ops import gate_up_silu as gus
from teacher_server.ops import row_norm as rn
from teacher_server.ops.norm import rms_norm

MODELS = {"8b": QWEN3_8B, "32b": QWEN3_32B}


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.float() - ref).abs()
    return {"max_abs_err": d.max().item(), "mean_abs_err": d.mean().item(),
            "rel_rms_err": (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="8b,32b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--sustain-s", type=float, default=4.0, help="seconds per variant, all rounds together")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dt, dev = torch.bfloat16, torch.device("cuda")
    compiled_norm = torch.compile(rms_norm, dynamic=True, fullgraph=True)  # the engine's compiled stage
    res: dict = {**header(args.model_size), "runs": {}}
    for size in args.model_size.split(","):
        cfg = MODELS[size]
        k, i, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg["rms_norm_eps"]
        q = cfg["num_attention_heads"] * cfg["head_dim"]
        w = torch.randn(2 * i, k, device=dev, dtype=dt) * k ** -0.5
        g = (1 + 0.2 * torch.randn(k, device=dev)).to(dt)  # the norm's weight
        wf = (w.float() * g.float()).to(dt)  # folded: w's columns times the weight, rounded once
        wo_t = (torch.randn(k, q, device=dev, dtype=dt) * q ** -0.5).t()
        wd_t = (torch.randn(k, i, device=dev, dtype=dt) * i ** -0.5).t()
        for m in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            a = torch.randn(m, q, device=dev, dtype=dt)
            x2, x3 = torch.empty_like(x), torch.empty_like(x)
            run: dict = {"model": size, "tokens": m, "hidden": k, "intermediate": i}
            # accuracy on the first 1024 rows of the stream after the o projection
            torch.addmm(x, a, wo_t, out=x2)
            s = x2[:1024]
            sf = s.float()
            hn = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
            gate, up = (hn @ w.float().t()).chunk(2, dim=-1)
            ref = F.silu(gate) * up
            run["accuracy"] = {
                "norm_then_fused": errors(gus.gate_up_silu(compiled_norm(s, g, eps), w), ref),
                "triton_norm_then_fused": errors(gus.gate_up_silu(rn.rms_norm_rows(s, g, eps), w), ref),
                "row_scale": errors(gus.gate_up_silu(s, wf, row_scale=rn.inv_rms(s, eps)), ref),
                "folded_in_kernel": errors(gus.gate_up_silu(s, wf, norm_eps=eps), ref),
            }
            run["triton_norm_vs_compiled_differs_frac"] = (
                rn.rms_norm_rows(s, g, eps) != compiled_norm(s, g, eps)).float().mean().item()
            print(f"{size} {m} accuracy {json.dumps(run['accuracy'])} triton norm differs from compiled on "
                  f"{run['triton_norm_vs_compiled_differs_frac']:.2e}", flush=True)

            def half_layer(mode: str) -> None:
                torch.addmm(x, a, wo_t, out=x2)
                if mode == "row_scale":
                    h = gus.gate_up_silu(x2, wf, row_scale=rn.inv_rms(x2, eps))
                elif mode == "triton_norm":
                    h = gus.gate_up_silu(rn.rms_norm_rows(x2, g, eps), w)
                else:
                    h = gus.gate_up_silu(compiled_norm(x2, g, eps), w)
                torch.addmm(x2, h, wd_t, out=x3)

            seqs = {
                "half_layer_engine_order": lambda: half_layer("compiled"),
                "half_layer_triton_norm": lambda: half_layer("triton_norm"),
                "half_layer_row_scale": lambda: half_layer("row_scale"),
                "mlp_norm_then_fused": lambda: gus.gate_up_silu(compiled_norm(x2, g, eps), w),
                "mlp_row_scale": lambda: gus.gate_up_silu(x2, wf, row_scale=rn.inv_rms(x2, eps)),
                "norm_compiled": lambda: compiled_norm(x2, g, eps),
                "norm_eager": lambda: F.rms_norm(x2, (k,), g, eps),
                **{f"norm_triton_r{r}w{wp}": (lambda r=r, wp=wp: rn.rms_norm_rows(x2, g, eps, r, wp))
                   for r, wp in ((1, 4), (1, 8), (2, 8), (4, 8))},
                **{f"norm_inv_rms_r{r}w{wp}": (lambda r=r, wp=wp: rn.inv_rms(x2, eps, r, wp))
                   for r, wp in ((1, 4), (2, 8), (4, 8))},
            }
            flops = {"half_layer": 2.0 * m * (k * q + 2 * k * i + i * k), "mlp": 2.0 * m * 2 * k * i, "norm": 0.0}
            run["burst_ms"] = {n: 1e3 * timed(f, 20) for n, f in seqs.items()}
            print(f"{size} {m} burst " + " ".join(f"{n} {v:.3f}" for n, v in run["burst_ms"].items()), flush=True)
            per = {n: {"s": 0.0, "calls": 0, "clock": [], "power": []} for n in seqs}
            for _ in range(args.rounds):
                for n, f in seqs.items():
                    iters = max(5, int(args.sustain_s / args.rounds / (run["burst_ms"][n] / 1e3)))
                    with Sampler() as smp:
                        t = timed(f, iters)
                    per[n]["s"] += t * iters
                    per[n]["calls"] += iters
                    sm = smp.summary()
                    if sm:
                        per[n]["clock"].append(sm["sm_clock_mhz_mean"])
                        per[n]["power"].append(sm["power_w_mean"])
            run["sustained"] = {}
            for n, p in per.items():
                t = p["s"] / p["calls"]
                fl = flops[n.split("_")[0] if not n.startswith("half_layer") else "half_layer"]
                run["sustained"][n] = {"ms": 1e3 * t, "of_peak": fl / t / H200_PEAK if fl else None,
                                       "sm_clock_mhz": sum(p["clock"]) / max(len(p["clock"]), 1),
                                       "power_w": sum(p["power"]) / max(len(p["power"]), 1), "calls": p["calls"]}
                print(f"{size} {m} sustained {n:<26} {1e3 * t:8.3f} ms "
                      f"{run['sustained'][n]['sm_clock_mhz']:.0f} MHz {run['sustained'][n]['power_w']:.0f} W", flush=True)
            sus = run["sustained"]
            base = sus["half_layer_engine_order"]["ms"]
            run["over_engine_order"] = {n: sus[n]["ms"] / base for n in ("half_layer_triton_norm", "half_layer_row_scale")}
            print(f"{size} {m}: half layer over the engine order {json.dumps(run['over_engine_order'])}", flush=True)
            res["runs"][f"{size}_{m}"] = run
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
