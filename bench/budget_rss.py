"""The in-flight byte budget against many concurrent large bodies: starts the server (CPU,
demo model, a process of its own), posts N concurrent bodies of S MB each (valid requests
whose bulk is an ignored vLLM field, ``features``: the case that held 4.6 GB for 16 x 200 MB
before the budget), and reports the server's peak RSS growth over its RSS just before the
burst (VmHWM after resetting it through /proc/PID/clear_refs), against the budget.

  python bench/budget_rss.py --bodies 16 --size-mb 200 --budget-mb 1024 --out bench/results/budget_rss.json
  python bench/budget_rss.py --bodies 16 --size-mb 200 --budget-mb 65536   # no effective budget: the old case

Linux only (reads /proc). Each refused body is answered 429 before it is read, and the client
may see its connection closed under the upload instead ("reset"); neither is read into memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from teacher_server.benchmark.local_server import free_port

ROOT = Path(__file__).resolve().parents[1]
GEN = "/inference/v1/generate"
MiB = 1 << 20


def bulk_body(size: int) -> bytes:
    head = b'{"token_ids":[1,2,3,4],"sampling_params":{"prompt_logprob_token_ids":[5,6]},"features":"'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def post_raw(port: int, payload: bytes, out: list) -> None:
    head = (f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        try:
            sock.sendall(head)
            sock.sendall(payload)
        except OSError:
            pass
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else "reset"
    out.append((status, round(time.monotonic() - t0, 3)))


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=16)
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--budget-mb", type=int, default=1024, help="max_inflight_bytes in MiB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    size, budget = int(args.size_mb * 1e6), args.budget_mb * MiB
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "teacher_server", "serve", "--device", "cpu", "--host",
                                 "127.0.0.1", "--port", str(port), "--demo-model-dir", str(Path(tmp) / "m"),
                                 "--log-level", "warning", "--max-inflight-bytes", str(budget)],
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))), cwd=ROOT, stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
            payload = bulk_body(size)
            warm: list = []
            post_raw(port, payload, warm)  # one body alone first (the allocator's first large blocks)
            base = kib(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            out: list = []
            t0 = time.monotonic()
            threads = [threading.Thread(target=post_raw, args=(port, payload, out)) for _ in range(args.bodies)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            peak = kib(proc.pid, "VmHWM")
            metrics = httpx.get(url + "/metrics", timeout=10).text
        finally:
            proc.kill()
            proc.wait()
    inflight = [float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith("teacher_server_inflight_bytes{")]
    res = {"bodies": args.bodies, "body_bytes": size, "budget_bytes": budget, "rss_before_mib": round(base / 1024, 1),
           "peak_rss_growth_mib": round((peak - base) / 1024, 1), "budget_mib": budget / MiB,
           "statuses": sorted(str(s) for s, _ in out), "warm_status": warm[0][0], "wall_s": round(wall, 2),
           "inflight_bytes_after": inflight[0] if inflight else None}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
