"""The server's own host work per request, outside the engine: parsing and validating a
body, and building the response body, on a workload's requests (the bodies the HTTP
benchmark sends; responses of the same shape). No GPU or model needed.

That work runs in the server's process, beside the engine thread, and holds the GIL: while
it runs the engine thread cannot launch kernels. So beside the time itself this measures
what it takes from a probe thread shaped like the engine's launch loop (1 ms of Python
work, then 1 ms waiting with the GIL released, as on a CUDA event), with the request path
running in another thread: the probe's lost work is what the launch loop would lose.

Each part is timed with the base64 codec the server uses (pybase64) and with the standard
library's, and the token-count precheck with and without its verifying parse. Then the
burst's parsed requests through a replica's inbox (the engine's own process, as the server
runs it on a GPU), with the candidates as parsed (int32) and widened to int64.

  python bench/bench_request_path.py --workload W1 --http 128 --out bench/results/request_path.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from workloads import make_workload  # noqa: E402

from teacher_server import b64  # noqa: E402
from teacher_server.engine.request import ScoreResult  # noqa: E402
from teacher_server.server import parsing  # noqa: E402
from teacher_server.server.responses import generate_body  # noqa: E402
from teacher_server.validation import Limits, parse_candidates  # noqa: E402

VOCAB = 151936


def bodies(name: str) -> list[bytes]:
    """The HTTP benchmark's request bodies."""
    from bench_engine import http_body

    return [http_body(r) for r in make_workload(name, VOCAB)]


def request_path(raws: list[bytes], limits: Limits) -> None:
    """What the server does per request besides the engine: parse, then the response body."""
    for raw in raws:
        _, req = parsing.parse_request(raw, limits, "m")
        res = ScoreResult.empty_for(req)
        res.token_id_logprobs = np.zeros(req.candidates.shape, np.float32)
        generate_body(req, res, "m", False)


def probe(stop: threading.Event, work_s: float = 1e-3, wait_s: float = 1e-3) -> int:
    """The launch loop's shape: Python work, then a wait with the GIL released. Returns how
    many work slices it completed."""
    n = 0
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < work_s:
            pass
        n += 1
        time.sleep(wait_s)
    return n


def probe_rate(seconds: float, load: list[bytes] | None, limits: Limits) -> tuple[float, float]:
    """Probe slices per second over ``seconds``, with the request path running over ``load``
    (repeated) in another thread; and the request path's requests per second."""
    stop = threading.Event()
    done = [0]

    def background() -> None:
        while not stop.is_set():
            request_path(load, limits)
            done[0] += len(load)

    th = threading.Thread(target=background) if load else None
    counted = {}
    t0 = time.perf_counter()
    pt = threading.Thread(target=lambda: counted.setdefault("n", probe(stop)))
    pt.start()
    if th:
        th.start()
    time.sleep(seconds)
    stop.set()
    pt.join()
    if th:
        th.join()
    dt = time.perf_counter() - t0
    return counted["n"] / dt, done[0] / dt


def front_cpu(requests: int, concurrency: int) -> dict:
    """The HTTP front's own CPU time per request, end to end through a real server: the engine
    (a small model of the Qwen3-8B family, on the CPU) runs in a process of its own
    (``--engine-process``), so the front process's CPU time is all front work: uvicorn/h11 on
    the bodies, parsing, the response bodies, asyncio, the pipe to the engine. With the engine
    on a thread of that process, this is the work that shares its GIL."""
    import asyncio
    import os
    import subprocess

    from bench_engine import http_run, tiny, wait_ready
    from workloads import QWEN3_8B, write_random_checkpoint

    cfg = tiny(QWEN3_8B)
    ckpt = write_random_checkpoint(Path("/tmp/ts-bench/qwen3-8b-tiny"), cfg)
    reqs = make_workload("W1", cfg["vocab_size"])[:requests]
    port = 19000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--model", str(ckpt), "--device", "cpu", "--port", str(port),
           "--host", "127.0.0.1", "--engine-process", "--no-enable-prefix-caching", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"

    def cpu_s() -> np.ndarray:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return np.array([int(fields[11]), int(fields[12])]) / os.sysconf("SC_CLK_TCK")  # utime, stime

    try:
        wait_ready(url, proc, 300)
        asyncio.run(http_run(url, reqs[:4], concurrency))  # warm-up
        c0 = cpu_s()
        wall = asyncio.run(http_run(url, reqs, concurrency)).seconds
        c1 = cpu_s()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    (user, system), total = c1 - c0, float((c1 - c0).sum())
    return {"requests": len(reqs), "concurrency": concurrency, "wall_s": wall, "front_cpu_s": total,
            "front_user_s": float(user), "front_system_s": float(system),
            "front_cpu_ms_per_request": total / len(reqs) * 1e3}


def _drain(q, n: int, rounds: int, done) -> None:  # noqa: ANN001
    """A replica's side of its inbox: take ``rounds`` bursts of n messages (each unpickled),
    saying when each burst's last one is in."""
    for _ in range(rounds):
        for _ in range(n):
            q.get()
        done.put(time.monotonic())


def inbox_burst(reqs: list, rounds: int = 3) -> dict:
    """A burst of parsed requests through a replica's inbox as the front sends them (an AddMsg
    each on a multiprocessing queue, pickled by its feeder thread, to a spawned process that
    unpickles them): milliseconds from the first put to the last get, each round (after a
    warm-up round), and the candidates' megabytes."""
    import multiprocessing as mp

    from teacher_server.replicas.messages import AddMsg

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_drain, args=(q, len(reqs), rounds + 1, done), daemon=True)
    proc.start()
    ms = []
    for r in range(rounds + 1):
        t = time.monotonic()
        for req in reqs:
            q.put(AddMsg(req))
        end = done.get()
        if r:
            ms.append(1e3 * (end - t))
    proc.join(timeout=10)
    return {"candidate_mb": sum(x.candidates.nbytes for x in reqs) / 1e6, "burst_ms": ms}


def timed(fn, reps: int = 3) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--probe-seconds", type=float, default=4.0)
    ap.add_argument("--http", type=int, default=0, metavar="N",
                    help="also serve the workload's first N requests through a real server (engine in its own "
                         "process, a small model on the CPU) and report the front process's CPU time per request")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    limits = Limits(vocab_size=VOCAB, max_model_len=40960, max_logprobs=4096, max_rows_x_k=10**9)
    raws = bodies(args.workload)
    n = len(raws)
    out: dict = {"workload": args.workload, "requests": n, "body_mb": sum(map(len, raws)) / 1e6,
                 "pybase64": b64.fast(), "per_request_ms": {}}
    fast = b64._fast
    base_probe, _ = probe_rate(args.probe_seconds, None, limits)
    out["probe_alone_slices_per_s"] = base_probe
    for codec in ("pybase64", "stdlib"):
        b64._fast = fast if codec == "pybase64" else None
        if codec == "pybase64" and fast is None:
            continue
        row = {"parse": timed(lambda: [parsing.parse_request(r, limits, "m") for r in raws]) / n * 1e3,
               "parse_and_response": timed(lambda: request_path(raws, limits)) / n * 1e3}
        rate, reqs_per_s = probe_rate(args.probe_seconds, raws, limits)
        row["probe_slices_per_s"] = rate
        row["probe_work_lost"] = 1 - rate / base_probe
        # the launch loop's Python work lost per request served beside it
        row["probe_ms_lost_per_request"] = (base_probe - rate) / reqs_per_s  # (a slice is 1 ms)
        row["request_path_requests_per_s"] = reqs_per_s
        out["per_request_ms"][codec] = row
        print(codec, json.dumps(row), flush=True)
    b64._fast = fast
    # the candidates' part of parsing alone: each body's base64 .npy to the int32 array the
    # engine gets (decode, range check, conversion), the best of 5 rounds
    sent = [(sp["prompt_logprob_token_ids"], len(b["token_ids"]) - sp["prompt_logprob_start"] - 1)
            for b in map(json.loads, raws) for sp in [b["sampling_params"]]]  # (candidates, rows)
    out["candidates_ms"] = timed(lambda: [parse_candidates(c, k, limits, "c") for c, k in sent], reps=5) / n * 1e3
    print("candidates", out["candidates_ms"], "ms a request", flush=True)
    out["precheck_ms"] = {
        "count_and_verify": timed(lambda: [parsing.count_token_ids(r) for r in raws]) / n * 1e3,
        "count_only_within_limit": timed(lambda: [parsing.count_token_ids(r, above=limits.max_model_len)
                                                  for r in raws]) / n * 1e3}
    # the burst through a replica's inbox: the candidates as parsed (int32), and as int64 (their
    # form before 2026-12)
    parsed = [parsing.parse_request(r, limits, "m")[1] for r in raws]
    out["inbox_burst"] = {"int32": inbox_burst(parsed)}
    for req in parsed:
        req.candidates = req.candidates.astype(np.int64)
    out["inbox_burst"]["int64"] = inbox_burst(parsed)
    print("inbox burst", json.dumps(out["inbox_burst"]), flush=True)
    if args.http:
        out["http_front"] = front_cpu(args.http, 128)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
