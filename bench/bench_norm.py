"""The decoder's RMSNorm: the Triton kernel (``ops.rms_norm_kernel``) against the compiled stage
(what the engine ran before it) and torch's eager ``F.rms_norm``, alone and in the order of a
dense layer's second half: the o projection onto the residual stream (cuBLAS, the sum in the
epilogue), the norm of the stream, the fused gate/up SiLU kernel on the normed rows, the down
projection. Random data in every input; each variant in interleaved rounds for several seconds
(sustained: the clock settles under the power limit), SM clock and power sampled. Accuracy:
each norm's output, and the MLP's output after it, against float32 on the same bf16 inputs.

  python bench/bench_norm.py --model-size 8b,32b --tokens 16384 --out norm.json

(``bench/results/norm_fold_*_a3279a5.json`` hold this bench's first form, which also tried the
norm folded into the gate/up kernel: 9-11% slower with the sums of squares in its loop, and no
faster than the kernel with a 1 / rms row scale in its epilogue.)
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
from teacher_server.ops.norm import rms_norm
from teacher_server.ops.rms_norm_kernel import rms_norm_rows

MODELS = {"8b": QWEN3_8B, "32b": QWEN3_32B}


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.float() - ref).abs()
    return {"max_abs_err": d.max().item(), "mean_abs_err": d.mean().item(),
            "rel_rms_err": (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="8b,32b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--sustain-s", type=float, default=3.0, help="seconds per variant, all rounds together")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dt, dev = torch.bfloat16, torch.device("cuda")
    compiled = torch.compile(rms_norm, dynamic=True, fullgraph=True)  # the engine's stage before the kernel
    norms = {"kernel": rms_norm_rows, "compiled": compiled,
             "eager": lambda x, g, eps: F.rms_norm(x, (x.shape[-1],), g, eps)}
    res: dict = {**header(args.model_size), "runs": {}}
    for size in args.model_size.split(","):
        cfg = MODELS[size]
        k, i, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg["rms_norm_eps"]
        q = cfg["num_attention_heads"] * cfg["head_dim"]
        w = torch.randn(2 * i, k, device=dev, dtype=dt) * k ** -0.5
        g = (1 + 0.2 * torch.randn(k, device=dev)).to(dt)  # the norm's weight
        wo_t = (torch.randn(k, q, device=dev, dtype=dt) * q ** -0.5).t()
        wd_t = (torch.randn(k, i, device=dev, dtype=dt) * i ** -0.5).t()
        for m in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            a = torch.randn(m, q, device=dev, dtype=dt)
            x2, x3 = torch.empty_like(x), torch.empty_like(x)
            run: dict = {"model": size, "tokens": m, "hidden": k, "intermediate": i}
            torch.addmm(x, a, wo_t, out=x2)  # the stream after the o projection
            s = x2[:1024]
            sf = s.float()
            hn = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
            gate, up = (hn @ w.float().t()).chunk(2, dim=-1)
            ref = F.silu(gate) * up
            run["accuracy"] = {n: {"norm": errors(f(s, g, eps), hn), "mlp": errors(gus.gate_up_silu(f(s, g, eps), w), ref)}
                               for n, f in norms.items()}
            run["kernel_differs_from_compiled_frac"] = (norms["kernel"](s, g, eps) != compiled(s, g, eps)).float().mean().item()
            print(f"{size} {m} accuracy {json.dumps(run['accuracy'])}; kernel differs from compiled on "
                  f"{run['kernel_differs_from_compiled_frac']:.2e}", flush=True)

            def half_layer(norm) -> None:  # noqa: ANN001
                torch.addmm(x, a, wo_t, out=x2)
                torch.addmm(x2, gus.gate_up_silu(norm(x2, g, eps), w), wd_t, out=x3)

            seqs = {**{f"half_layer_{n}": (lambda f=f: half_layer(f)) for n, f in norms.items()},
                    **{f"norm_{n}": (lambda f=f: f(x2, g, eps)) for n, f in norms.items()}}
            flops = 2.0 * m * (k * q + 2 * k * i + i * k)
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
                run["sustained"][n] = {"ms": 1e3 * t, "of_peak": flops / t / H200_PEAK if n.startswith("half") else None,
                                       "sm_clock_mhz": sum(p["clock"]) / max(len(p["clock"]), 1),
                                       "power_w": sum(p["power"]) / max(len(p["power"]), 1), "calls": p["calls"]}
                print(f"{size} {m} sustained {n:<22} {1e3 * t:8.3f} ms "
                      f"{run['sustained'][n]['sm_clock_mhz']:.0f} MHz {run['sustained'][n]['power_w']:.0f} W", flush=True)
            base = run["sustained"]["half_layer_compiled"]["ms"]
            run["half_layer_over_compiled"] = {n: run["sustained"][f"half_layer_{n}"]["ms"] / base for n in norms}
            print(f"{size} {m}: half layer over the compiled norm's {json.dumps(run['half_layer_over_compiled'])}",
                  flush=True)
            res["runs"][f"{size}_{m}"] = run
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
