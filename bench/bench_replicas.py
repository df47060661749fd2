"""Replicas through HTTP: W1 and the GRPO workload G1 against one server per setting
(``--data-parallel-size`` 1 and 2, prefix-affinity and round-robin routing), same requests.

  python bench/bench_replicas.py --runs dp1,dp2,dp2-rr --workloads W1,G1
  python bench/bench_replicas.py --runs dp2,dp2-rr --dp1-from out/replicas_dp1.json  # in two calls
  python bench/bench_replicas.py --tiny --runs dp1,dp2 --workloads W1:tiny --repeats 1  # CPU smoke run (the
                                                                          # path only: its numbers are the CPU's)

Each setting is a fresh ``teacher-server serve`` process (prefix cache on, as in service).
A warm-up on other requests (seed 99) precedes the measured runs; run r uses the workload
drawn with seed r, so repeats never meet a cache the previous run filled and every setting
scores the same requests. Reports tokens/s, its ratio to dp1, and the prefix-cache hit rate
(hit tokens / cacheable tokens looked up, summed over replicas, from /metrics) per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engine import http_run, summarize, wait_ready
from workloads import QWEN3_8B, make_workload, tiny, write_random_checkpoint

from teacher_server.benchmark.local_server import stop_server

RUNS = {"dp1": (1, "affinity"), "dp2": (2, "affinity"), "dp2-rr": (2, "round_robin"),
        "dp4": (4, "affinity"), "dp4-rr": (4, "round_robin")}


def prefix_counters(url: str) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) summed over the replicas."""
    hits = queries = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("teacher_server_prefix_cache_hits_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("teacher_server_prefix_cache_queries_total{"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def start_server(ckpt: Path, dp: int, routing: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = 18500 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--model", str(ckpt), "--port", str(port),
           "--host", "127.0.0.1", *(["--max-num-batched-tokens", str(args.budget)] if args.budget else []),
           "--log-level", "warning", *(["--device", "cpu"] if args.tiny else []),
           "--max-model-len", str(args.max_model_len), "--data-parallel-size", str(dp), "--routing", routing]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=str(Path(__file__).parents[1]))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout_s=900)
    except BaseException:  # (a server that never got ready is not left running)
        stop_server(proc, grace_s=10)
        raise
    return proc, url


def bench_setting(ckpt: Path, cfg: dict, name: str, args: argparse.Namespace, workloads: list[str]) -> dict:
    dp, routing = RUNS[name]
    proc, url = start_server(ckpt, dp, routing, args)
    out: dict = {"data_parallel_size": dp, "routing": routing}
    try:
        for w in workloads:
            warm = make_workload(w, cfg["vocab_size"], seed=99)
            asyncio.run(http_run(url, warm[: max(2 * dp, len(warm) // 8)], args.concurrency))
            runs = []
            for r in range(args.repeats):
                reqs = make_workload(w, cfg["vocab_size"], seed=r)
                time.sleep(1.0)  # replicas report their counters every 0.25 s: the warm-up's or last run's too
                h0, q0 = prefix_counters(url)
                res = asyncio.run(http_run(url, reqs, args.concurrency))
                time.sleep(1.0)
                h1, q1 = prefix_counters(url)
                # MFU counts the computed tokens only: each answer's cache hits are left out
                run = summarize(f"{w}-{name}", cfg, reqs, res.seconds, res.latencies, float("nan"),
                                cached=res.cached, gpus=dp)
                run["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                run["prefix_hit_tokens"] = h1 - h0
                runs.append(run)
                print(name, w, f"run {r}: {run['tokens_per_s']:.0f} tok/s, hit rate {run['prefix_hit_rate']:.3f}",
                      flush=True)
            mid = sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2]
            out[w] = dict(mid, runs_tokens_per_s=[x["tokens_per_s"] for x in runs],
                          runs_prefix_hit_rate=[x["prefix_hit_rate"] for x in runs])
    finally:
        proc.terminate()
        proc.wait(timeout=180)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="dp1,dp2,dp2-rr", help=f"settings, of {sorted(RUNS)}")
    ap.add_argument("--workloads", default="W1,G1")
    ap.add_argument("--repeats", type=int, default=3, help="runs per workload; the median is reported")
    ap.add_argument("--budget", type=int, default=None,
                    help="max_num_batched_tokens (default: the server's own, from the GPU's memory)")
    ap.add_argument("--concurrency", type=int, default=128, help="requests in flight (per setting, not per GPU)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="a small model of the shape on the CPU (a smoke run of this "
                                                        "script; workloads W1:tiny, W2:tiny)")
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dp1-from", default=None, help="results file of an earlier call whose dp1 run the ratios use")
    args = ap.parse_args()
    cfg = tiny(QWEN3_8B) if args.tiny else QWEN3_8B
    ckpt = Path(args.ckpt_dir) / ("tiny-qwen3-8b" if args.tiny else "qwen3-8b")
    write_random_checkpoint(ckpt, cfg)
    workloads = [w for w in args.workloads.split(",") if w]
    results: dict = {"model": "Qwen3-8B shape, random bf16 weights", "tiny": args.tiny, "budget_tokens": args.budget,
                     "concurrency": args.concurrency, "runs": {}}
    for name in [r for r in args.runs.split(",") if r]:
        results["runs"][name] = bench_setting(ckpt, cfg, name, args, workloads)
    base = results["runs"].get("dp1")
    if base is None and args.dp1_from:
        base = json.loads(Path(args.dp1_from).read_text())["runs"]["dp1"]
    print(f"{'setting':<10}{'workload':<10}{'tok/s':>10}{'x dp1':>8}{'hit rate':>10}")
    for name, res in results["runs"].items():
        for w in workloads:
            tps = res[w]["tokens_per_s"]
            ratio = tps / base[w]["tokens_per_s"] if base else float("nan")
            res[w]["x_dp1"] = ratio
            print(f"{name:<10}{w:<10}{tps:>10.0f}{ratio:>8.2f}{res[w]['prefix_hit_rate']:>10.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
