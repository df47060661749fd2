"""FP8 against bf16 end to end, through HTTP (issue 48's targets): one shape, one workload, a
server per variant, the variants alternating round by round so that the GPU's power and clock
state is shared:

- ``bf16``: the shape's bf16 model (dummy weights);
- ``row``: the same model quantized at load (``--quantization fp8``: per-channel weights,
  dynamic per-token activations);
- ``block``: the shape as a block-wise FP8 checkpoint would declare it
  (``quantization_config``: e4m3, 128 x 128 weight blocks, dynamic 1 x 128 activation groups),
  dummy e4m3 weights made in place.

Each run gives tokens/s, MFU (bf16 FLOPs over the bf16 peak: the same work in each variant),
the KV pool's tokens and the token budget the server chose (from /metrics), and the ratio of
each FP8 variant to bf16 in the same round.

  python bench/bench_fp8_e2e.py --model-size 8b --workload W1 --rounds 2
  python bench/bench_fp8_e2e.py --model-size 32b --workload W4 --variants bf16,row
  python bench/bench_fp8_e2e.py --model-size 30b-a3b --workload W5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine
from bench_engine import MODELS, bench_http, provenance
from workloads import BLOCK_FP8_CONFIG, make_workload, tiny, with_layers, write_config


def model_dirs(root: Path, cfg: dict, name: str) -> dict[str, tuple[Path, list[str]]]:
    """Each variant's model folder and extra server arguments."""
    bf16 = write_config(root / name, cfg)
    block = write_config(root / f"{name}-fp8-block", dict(cfg, quantization_config=BLOCK_FP8_CONFIG))
    return {"bf16": (bf16, []), "row": (bf16, ["--quantization", "fp8"]), "block": (block, []),
            # the row-wise products promoted to float32 (no fast accumulation): what that setting is worth
            "row_promoted": (bf16, ["--quantization", "fp8", "--no-fp8-fast-accum"])}


def workload(name: str, vocab: int) -> list:
    """The requests of ``name``; W5 (DESIGN: the MoE shape on 128 W1f-shaped requests) is two
    W1f draws."""
    if name == "W5":
        return make_workload("W1f", vocab) + make_workload("W1f", vocab, seed=1)
    return make_workload(name, vocab)


def server_gauges(url: str) -> dict[str, float]:
    """The KV pool's tokens, the token budget and whether the expert layers' fused gate/up kernels
    are on (bf16's ``ops.moe_gate_up``: ``moe_gate_up_kernel``; FP8's ``ops.fp8_moe``:
    ``fp8_moe_kernel``), from /metrics."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name, key in (("teacher_server_kv_cache_tokens", "kv_pool_tokens"),
                          ("teacher_server_token_budget", "token_budget")):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
        for kernel in ("moe_gate_up_kernel", "fp8_moe_kernel"):
            if line.startswith("teacher_server_kernel_enabled{") and f'kernel="{kernel}"' in line:
                out[kernel] = float(line.rsplit(" ", 1)[1])
    return out


def http_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What bench_engine's ``bench_http`` (and ``server_args``) read of its arguments, from ours:
    one GPU, no parallelism, dummy weights (tests/test_bench_fp8.py checks every name)."""
    return argparse.Namespace(budget=args.budget, tensor_parallel_size=1, pipeline_parallel_size=1,
                              load_format="dummy", tp_comm_parts=None, quantization=None, moe_parallel=None,
                              step_trace="", http_client=["httpx"], repeats=args.repeats,
                              concurrency=args.concurrency, max_model_len=args.max_model_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="8b", choices=sorted(MODELS))
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--variants", default="bf16,row,block", help="comma-separated: bf16, row, block, row_promoted")
    ap.add_argument("--rounds", type=int, default=2, help="each variant's servers, alternating")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per server (the median is its result)")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the server's own)")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench-fp8")
    ap.add_argument("--tiny", action="store_true", help="a small model of the family (CPU smoke runs)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the shape's first N layers (a card too small for its depth; per-layer rates unchanged)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - {"bf16", "row", "block", "row_promoted"}:
        ap.error(f"unknown variants in {args.variants!r}")
    cfg, family, _ = MODELS[args.model_size]
    if args.tiny:
        cfg = tiny(cfg)
    if args.num_layers and args.num_layers != cfg["num_hidden_layers"]:
        cfg = with_layers(cfg, args.num_layers)
    name = f"{family}-{args.model_size}" + ("-tiny" if args.tiny else "") + f"-{cfg['num_hidden_layers']}l"
    dirs = model_dirs(Path(args.ckpt_dir), cfg, name)
    reqs = workload(args.workload, cfg["vocab_size"])
    sargs = http_namespace(args)
    bench_engine.GPUS = 1
    import torch

    if torch.cuda.is_available():
        from gpu_telemetry import GpuTelemetry

        bench_engine.TELEMETRY = GpuTelemetry.start([0])
    gauges: dict[str, dict] = {}
    orig_wait = bench_engine.wait_ready

    def wait_and_read(url: str, proc, timeout_s: float = 900) -> None:  # noqa: ANN001
        orig_wait(url, proc, timeout_s)
        gauges["last"] = server_gauges(url)

    bench_engine.wait_ready = wait_and_read
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "provenance": provenance(), "shape": args.model_size,
                     "num_layers": cfg["num_hidden_layers"],
                     "workload": args.workload, "tokens": sum(len(r.tokens) for r in reqs), "requests": len(reqs),
                     "variants": {v: {"model": str(dirs[v][0]), "server_args": dirs[v][1]} for v in variants},
                     "rounds": []}
    out = Path(args.out or f"bench/results/fp8_e2e_{args.model_size}_{args.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # the first of a round is not always the same
        rnd = {}
        for v in order:
            model_dir, extra = dirs[v]
            t = time.perf_counter()
            try:
                run = bench_http(model_dir, sargs, cfg, args.workload, reqs, extra=list(extra), key=f"{v}-{r}")
            except Exception as e:  # a variant that fails leaves the others' results
                rnd[v] = {"error": repr(e)[:400]}
                print(f"round {r} {v}: failed {e!r}", flush=True)
                continue
            run.update(gauges.pop("last", {}))
            run["server_total_s"] = time.perf_counter() - t
            rnd[v] = run
            print(f"round {r} {v}: {run['tokens_per_s']:,.0f} tok/s, MFU {run['mfu']:.3f}, "
                  f"KV pool {run.get('kv_pool_tokens', float('nan')):,.0f} tokens, budget "
                  f"{run.get('token_budget', float('nan')):,.0f}, fused expert gate/up bf16 "
                  f"{run.get('moe_gate_up_kernel', float('nan')):.0f} FP8 {run.get('fp8_moe_kernel', float('nan')):.0f}",
                  flush=True)
        for v in variants:
            if v != "bf16" and "tokens_per_s" in rnd.get(v, {}) and "tokens_per_s" in rnd.get("bf16", {}):
                rnd[v]["x_bf16"] = rnd[v]["tokens_per_s"] / rnd["bf16"]["tokens_per_s"]
                rnd[v]["kv_pool_x_bf16"] = rnd[v].get("kv_pool_tokens", 0) / max(rnd["bf16"].get("kv_pool_tokens", 1), 1)
        results["rounds"].append(rnd)
        out.write_text(json.dumps(results, indent=1))  # a call cut short keeps the rounds done
    summary = {}
    for v in variants:
        runs = [rnd[v] for rnd in results["rounds"] if "tokens_per_s" in rnd.get(v, {})]
        if not runs:
            continue
        summary[v] = {"tokens_per_s": [round(x["tokens_per_s"]) for x in runs],
                      "mfu_bf16_flops": [round(x["mfu"], 4) for x in runs],
                      "kv_pool_tokens": runs[0].get("kv_pool_tokens"), "token_budget": runs[0].get("token_budget"),
                      "moe_gate_up_kernel": runs[0].get("moe_gate_up_kernel"),
                      "fp8_moe_kernel": runs[0].get("fp8_moe_kernel")}
        if v != "bf16":
            ratios = [x["x_bf16"] for x in runs if "x_bf16" in x]
            summary[v]["x_bf16_per_round"] = [round(x, 3) for x in ratios]
            summary[v]["x_bf16_median"] = round(statistics.median(ratios), 3) if ratios else None
    results["summary"] = summary
    if bench_engine.TELEMETRY is not None:
        bench_engine.TELEMETRY.close()
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
