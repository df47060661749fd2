"""A soak through HTTP: a server under a steady mix of W1-, W2- and W3-shaped requests for a
given time, some clients disconnecting mid-request, every answer checked, memory sampled.

1. Starts ``teacher_server serve`` (Qwen3-8B shape with dummy weights on CUDA, or the built-in
   demo model on the CPU with ``--demo``) in a process of its own.
2. Scores each request of the pool alone, one at a time: the reference answers.
3. For ``--duration-s``, ``--concurrency`` clients post requests drawn from the pool at random;
   a ``--disconnect`` share of them gives up after a random 0.05-1 s (the connection closes
   under the request, which the server must drop). Every answer that comes is compared with
   the reference of its request: within bf16 batch-composition noise on the GPU (the mean
   |difference| over a matrix at most ``--atol-mean``, its largest at most ``--atol-max``: a
   step's GEMMs tile and reduce differently with what else is in the batch, and bf16 keeps 8
   bits; the tensor-parallel tests bound the same kind of noise by 2e-2 and 0.25), bit for bit
   with ``--deterministic``, within 1e-4 in float32 on the CPU. An answer beyond the bound is
   also tested for being another's (``misplaced``: as close to another request's reference,
   or as far from its own as a one-row shift of it), which numerical noise never is.
4. Every ``--sample-s`` it samples the RSS of the server's processes (the HTTP front, and the
   engine or replica processes under it) and the GPU's used memory (nvidia-smi), and per minute
   the latency percentiles of the answered requests.

Writes JSON (after every minute too, so a run cut short keeps what it measured): per minute
(``--bucket-s``) p50/p99 latency, requests, scored rows/s; memory over the first minute against
the last (a quarter of the run each when it is shorter than 4 minutes); errors and the checks. ``ok`` is true when every answer matched, nothing but the disconnected requests
failed, and RSS and GPU memory grew by less than ``--flat-mib`` from the first minute to the last.

  python bench/soak.py --duration-s 480 --out bench/results/soak_8b.json            # one H200
  python bench/soak.py --demo --duration-s 45 --out /tmp/soak_cpu.json               # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from workloads import QWEN3_8B, Req, make_workload, write_config  # noqa: E402

from teacher_server.benchmark.local_server import free_port, stop_server  # noqa: E402

GEN = "/inference/v1/generate"
MiB = 1 << 20


def pool_gpu() -> list[tuple[str, Req]]:
    """48 W1 requests, two W2 groups (16), four W3 requests: shapes of each, K=64 per row."""
    v = QWEN3_8B["vocab_size"]
    return ([("W1", r) for r in make_workload("W1", v)[:48]] + [("W2", r) for r in make_workload("W2", v)[:16]]
            + [("W3", r) for r in make_workload("W3", v)[:4]])


def pool_cpu() -> list[tuple[str, Req]]:
    """The same mix scaled to the demo model: tiny W1 and W2, and two long requests (W3's shape:
    a 64-token prompt, a 1,984-token response)."""
    v = 4096
    rng = np.random.default_rng(3)
    long = [Req(rng.integers(0, v, 2048), 63, rng.integers(0, v, (1984, 8)).astype(np.int32)) for _ in range(2)]
    return ([("W1", r) for r in make_workload("W1:tiny", v)] + [("W2", r) for r in make_workload("W2:tiny", v)]
            + [("W3", r) for r in long])


def body(r: Req) -> bytes:
    buf = io.BytesIO()
    np.save(buf, r.cand)
    return json.dumps({"token_ids": r.tokens.tolist(), "sampling_params": {
        "prompt_logprob_start": r.start, "prompt_logprob_token_ids": base64.b64encode(buf.getvalue()).decode()}}
    ).encode()


def matrix(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(json.loads(data)["prompt_token_id_logprobs"])))



def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out += tree(int(k))
    return out


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def gpu_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return float(out.splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def compare(got: np.ndarray, want: np.ndarray, args: argparse.Namespace) -> str | None:
    """Why ``got`` is not ``want`` within the run's tolerance, or None."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if args.deterministic:
        return None if np.array_equal(got, want) else "not bit-identical"
    fin = np.isfinite(want)
    if not np.array_equal(fin, np.isfinite(got)):
        return "non-finite entries differ"
    d = np.abs(got[fin] - want[fin])
    if d.size and (d.mean() > args.atol_mean or d.max() > args.atol_max):
        return f"mean |diff| {d.mean():.3g}, max {d.max():.3g}"
    return None


def mean_diff(a: np.ndarray, b: np.ndarray) -> float:
    fin = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[fin] - b[fin]).mean()) if fin.any() else 0.0


def misplaced(got: np.ndarray, i: int, refs: list[np.ndarray]) -> bool:
    """Whether an answer beyond the tolerance looks like another one's rather than its own with
    noise: at least as close to another request's reference of its shape, or no closer to its
    own than that reference is to itself shifted by one row (what a misaligned answer differs
    by). Numerical differences (a cached prompt against a recomputed one) stay far below both."""
    own = mean_diff(got, refs[i])
    ref = refs[i]
    if ref.shape[0] > 1 and own >= 0.5 * mean_diff(ref[1:], ref[:-1]):
        return True
    return any(mean_diff(got, r) <= own for j, r in enumerate(refs) if j != i and r.shape == got.shape)


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def summarize(args: argparse.Namespace, state: dict) -> dict:
    """Per-minute latency and throughput, memory first vs last minute, the verdict."""
    t0, minutes, bucket = state["t0"], {}, args.bucket_s
    for done_at, lat, kind, rows in state["answers"]:
        m = minutes.setdefault(int((done_at - t0) // bucket), {"lat": [], "rows": 0, "kinds": {}})
        m["lat"].append(lat)
        m["rows"] += rows
        m["kinds"][kind] = m["kinds"].get(kind, 0) + 1
    per_minute = [{"from_s": k * bucket, "requests": len(m["lat"]), "p50_s": pct(m["lat"], 50),
                   "p99_s": pct(m["lat"], 99), "scored_rows_per_s": round(m["rows"] / bucket, 1), "by_kind": m["kinds"]}
                  for k, m in sorted(minutes.items())]
    samples = state["samples"]
    last_t = samples[-1]["t"] if samples else 0.0
    span = min(60.0, args.duration_s / 4)  # the first and last minute (a quarter of a short run)

    def window(key: str, first: bool) -> float | None:
        vals = [s[key] for s in samples if s.get(key) is not None
                and (s["t"] < span if first else s["t"] >= max(last_t - span, span))]
        return round(float(np.mean(vals)), 1) if vals else None

    memory = {}
    for key in ("front_rss_mib", "engine_rss_mib", "gpu_used_mib"):
        a, b = window(key, True), window(key, False)
        memory[key] = {"first": a, "last": b, "window_s": span,
                       "growth": None if a is None or b is None else round(b - a, 1)}
    flat = all(v["growth"] is None or v["growth"] < args.flat_mib for v in memory.values())
    full = [m for m in per_minute if m["requests"] >= 10]
    p99_ratio = round(full[-1]["p99_s"] / full[0]["p99_s"], 3) if len(full) >= 2 and full[0]["p99_s"] else None
    mism, errors = state["mismatches"], state["errors"]
    return {"device": args.device_name, "model": state["model"], "duration_s": args.duration_s,
            "concurrency": args.concurrency, "disconnect_share": args.disconnect, "pool": state["pool"],
            "reference_s": state.get("reference_s"), "answers_checked": state["checked"],
            "mismatches": mism[:20], "mismatch_count": len(mism),
            "misplaced": state["misplaced"][:20], "misplaced_count": len(state["misplaced"]), "errors": errors[:20], "error_count": len(errors),
            "disconnected": state["disconnected"], "tolerance": "bit-identical" if args.deterministic else
            {"atol_mean": args.atol_mean, "atol_max": args.atol_max}, "per_minute": per_minute,
            "p99_last_over_first_bucket": p99_ratio, "memory_mib": memory, "flat_mib": args.flat_mib,
            "memory_flat": flat, "samples": samples,
            "ok": not mism and not errors and flat and state["checked"] > 0}


async def soak(args: argparse.Namespace, url: str, proc: subprocess.Popen, state: dict) -> None:
    import httpx

    pool = state["reqs"]
    bodies = [body(r) for _, r in pool]
    refs: list[np.ndarray] = []
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=args.concurrency + 8)) as c:
        t = time.monotonic()
        for b in bodies:  # alone, one at a time
            r = await c.post(GEN, content=b, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]
            refs.append(matrix(r.content))
        state["reference_s"] = round(time.monotonic() - t, 1)
        print(f"references: {len(refs)} requests alone in {state['reference_s']}s", flush=True)
        rng = random.Random(args.seed)
        t0 = state["t0"] = time.monotonic()
        end = t0 + args.duration_s
        rows = [r.rows for _, r in pool]

        async def client() -> None:
            while time.monotonic() < end:
                i = rng.randrange(len(pool))
                cut = rng.uniform(0.05, 1.0) if rng.random() < args.disconnect else None
                s = time.monotonic()
                try:
                    r = await c.post(GEN, content=bodies[i], headers={"content-type": "application/json"},
                                     timeout=cut if cut is not None else 3600)
                except httpx.TimeoutException:
                    if cut is None:
                        state["errors"].append(f"request {i}: timed out")
                    else:
                        state["disconnected"] += 1
                    continue
                except httpx.HTTPError as e:
                    state["errors"].append(f"request {i}: {type(e).__name__}: {e}"[:300])
                    continue
                lat = time.monotonic() - s
                if r.status_code != 200:
                    state["errors"].append(f"request {i}: HTTP {r.status_code} {r.text[:200]}")
                    continue
                got = matrix(r.content)
                why = compare(got, refs[i], args)
                state["checked"] += 1
                if why is not None:
                    state["mismatches"].append(f"request {i} ({pool[i][0]}): {why}")
                    if misplaced(got, i, refs):
                        state["misplaced"].append(f"request {i} ({pool[i][0]}): {why}")
                state["answers"].append((time.monotonic(), lat, pool[i][0], rows[i]))

        async def sampler() -> None:
            next_write = t0 + 60
            while time.monotonic() < end:
                pids = tree(proc.pid)
                state["samples"].append({"t": round(time.monotonic() - t0, 1), "front_rss_mib": round(rss_mib(pids[0]), 1),
                                         "engine_rss_mib": round(sum(rss_mib(p) for p in pids[1:]), 1) or None,
                                         "gpu_used_mib": await asyncio.to_thread(gpu_used_mib)})
                if time.monotonic() >= next_write and args.out:
                    Path(args.out).write_text(json.dumps(summarize(args, state), indent=1) + "\n")
                    next_write += 60
                await asyncio.sleep(args.sample_s)

        await asyncio.gather(sampler(), *(client() for _ in range(args.concurrency)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=480)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.05, help="share of requests whose client gives up")
    ap.add_argument("--demo", action="store_true", help="the built-in demo model on the CPU (smoke runs)")
    ap.add_argument("--deterministic", action="store_true", help="serve in deterministic mode; answers bit-exact")
    ap.add_argument("--atol-mean", type=float, default=None, help="default 2e-2 on CUDA (bf16), 1e-4 on the CPU")
    ap.add_argument("--atol-max", type=float, default=None, help="default 0.5 on CUDA (bf16), 1e-4 on the CPU")
    ap.add_argument("--flat-mib", type=float, default=256.0, help="largest first-to-last-minute memory growth")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--bucket-s", type=float, default=60.0, help="latency percentiles per this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench")
    ap.add_argument("--server-args", default="", help="more arguments of `teacher_server serve`")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cpu = args.demo
    args.atol_mean = args.atol_mean if args.atol_mean is not None else (1e-4 if cpu else 2e-2)
    args.atol_max = args.atol_max if args.atol_max is not None else (1e-4 if cpu else 0.5)
    args.device_name = "cpu" if cpu else (subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                         capture_output=True, text=True).stdout.strip() or "cuda")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="soak-")
    if cpu:
        model = ["--device", "cpu", "--demo-model-dir", str(Path(tmp) / "demo"), "--max-model-len", "4096"]
        name, pool = "demo model (CPU, float32)", pool_cpu()
    else:
        ckpt = write_config(Path(args.ckpt_dir) / "qwen3-8b-dummy", QWEN3_8B)
        model = ["--model", str(ckpt), "--load-format", "dummy"]
        name, pool = "Qwen3-8B shape, dummy bf16 weights", pool_gpu()
    cmd = [sys.executable, "-m", "teacher_server", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *(["--deterministic"] if args.deterministic else []), *args.server_args.split()]
    log = open(Path(tmp) / "server.log", "w")
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))), cwd=ROOT, stdout=log, stderr=log)
    state = {"model": name, "reqs": pool, "answers": [], "samples": [], "mismatches": [], "misplaced": [], "errors": [],
             "checked": 0, "disconnected": 0, "t0": time.monotonic(),
             "pool": {k: sum(1 for kk, _ in pool if kk == k) for k in ("W1", "W2", "W3")}}
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"
        t = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                tail = (Path(tmp) / "server.log").read_text()[-3000:]
                raise SystemExit(f"server exited during start-up; the end of its log:\n{tail}")
            time.sleep(0.5)
        print(f"server ready in {time.monotonic() - t:.0f}s", flush=True)
        asyncio.run(soak(args, url, proc, state))
    finally:
        stop_server(proc)
    res = summarize(args, state)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
