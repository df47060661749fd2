"""Two teachers behind one service against each alone: the Qwen3-8B shape and the Qwen3-30B-A3B
shape (random weights made in place: load_format dummy), one GPU each, W1 requests.

  python bench/bench_teachers.py --out out/teachers_h200x2.json          # two GPUs
  python bench/bench_teachers.py --tiny --workload W1:tiny --repeats 1    # CPU smoke run (the path only:
                                                                          # its numbers are the CPU's contention)

First each teacher alone (``teacher-server serve`` on its GPU), then both in one service
(``--teachers``, GPU 0 and GPU 1) under a mixed load: both teachers' requests interleaved and in
flight at once, ``--concurrency`` per teacher. A teacher's tokens/s under the mixed load is its
tokens over the time from the first send to its own last answer. Target (issue 51): each at
>= 0.95 of its single-teacher tokens/s. The median of ``--repeats`` runs is reported; a warm-up
on other requests (seed 99) comes first, and run r uses seed r, the same requests in both settings.
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
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engine import http_body, wait_ready
from workloads import QWEN3_8B, QWEN3_30B_A3B, Req, make_workload, tiny, write_config

from teacher_server.benchmark.local_server import free_port, stop_server

SHAPES = {"8b": QWEN3_8B, "30b-a3b": QWEN3_30B_A3B}


def start(flags: list[str], args: argparse.Namespace, gpus: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--port", str(port), "--host", "127.0.0.1",
           "--log-level", "warning", "--max-model-len", str(args.max_model_len), "--load-format", "dummy",
           *(["--device", "cpu"] if args.tiny else []), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}))
    proc = subprocess.Popen(cmd, env=env, cwd=str(Path(__file__).parents[1]))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, timeout_s=1200)
    return proc, url


async def run(url: str, load: dict[str | None, list[Req]], concurrency: int) -> dict[str | None, float]:
    """Every teacher's requests at once (``concurrency`` each), interleaved; tokens/s per teacher."""
    t0 = time.perf_counter()
    done: dict[str | None, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=concurrency * len(load))) as c:
        async def teacher(name: str | None, reqs: list[Req]) -> None:
            sem = asyncio.Semaphore(concurrency)

            async def one(r: Req) -> None:
                body = http_body(r)
                if name is not None:
                    body = orjson.dumps({**orjson.loads(body), "model": name})
                async with sem:
                    resp = await c.post("/inference/v1/generate", content=body,
                                        headers={"content-type": "application/json"})
                    assert resp.status_code == 200, resp.text[:300]

            await asyncio.gather(*(one(r) for r in reqs))
            done[name] = time.perf_counter() - t0

        await asyncio.gather(*(teacher(n, reqs) for n, reqs in load.items()))
    return {n: sum(len(r.tokens) for r in load[n]) / done[n] for n in load}


def measure(url: str, names: list[str | None], vocab: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    """tokens/s per teacher of each run; ``names``: the teachers loaded together (None: the one served)."""
    asyncio.run(run(url, {n: make_workload(args.workload, vocab[n], seed=99)[:16] for n in names}, args.concurrency))
    out: dict[str, list[float]] = {}
    for r in range(args.repeats):
        tps = asyncio.run(run(url, {n: make_workload(args.workload, vocab[n], seed=r) for n in names},
                              args.concurrency))
        for n, v in tps.items():
            out.setdefault(str(n), []).append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight per teacher")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (a smoke run of this script)")
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ckpts, vocab = {}, {}
    for name, shape in SHAPES.items():
        cfg = tiny(shape) if args.tiny else shape
        ckpts[name] = write_config(Path(args.ckpt_dir) / (f"tiny-{name}" if args.tiny else f"qwen3-{name}"), cfg)
        vocab[name] = vocab[None] = cfg["vocab_size"]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    alone = {}
    for i, name in enumerate(SHAPES):
        proc, url = start(["--model", str(ckpts[name])], args, None if args.tiny else str(i))
        try:
            vocab[None] = vocab[name]
            alone[name] = median(measure(url, [None], vocab, args)["None"])
        finally:
            stop_server(proc)
        print(f"{name} alone: {alone[name]:.0f} tok/s", flush=True)
    specs = [f"{n}={ckpts[n]}" + ("" if args.tiny else f",gpus=[{i}]") for i, n in enumerate(SHAPES)]
    proc, url = start(["--teachers", *specs], args, None)
    try:
        mixed = {n: median(v) for n, v in measure(url, list(SHAPES), vocab, args).items()}
    finally:
        stop_server(proc)
    results = {"workload": args.workload, "concurrency_per_teacher": args.concurrency, "tiny": args.tiny,
               "teachers": {n: {"alone_tokens_per_s": alone[n], "mixed_tokens_per_s": mixed[n],
                                "ratio": mixed[n] / alone[n]} for n in SHAPES}}
    print(f"{'teacher':<10}{'alone':>10}{'mixed':>10}{'ratio':>8}")
    for n, res in results["teachers"].items():
        print(f"{n:<10}{res['alone_tokens_per_s']:>10.0f}{res['mixed_tokens_per_s']:>10.0f}{res['ratio']:>8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
