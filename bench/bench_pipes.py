"""How long a W1f-shaped request takes to reach its replica process, and its scores to come
back, through the pipes the front and a replica share: as the system makes them (64 KiB on
Linux) and widened (``teacher_server.replicas.pipes``), with the receiving process's other
thread busy in Python (a replica's engine thread launching a step; a front's event loop
reading uploads) or idle.

Each message is sent as the server sends it (``AddMsg`` of a parsed request through a
``multiprocessing`` queue; the scores, a [3072, 64] float32 matrix in a ``ResultMsg``, through a
one-way pipe), stamped with ``time.monotonic()`` (one clock for the host's processes), one at a
time, and timed to when the receiver has it unpickled. And a W1f step's plan (~6.6 MB of bytes)
as the engine sends it to a tensor-parallel rank over a socket pair, read in pieces
(``recv_bytes``) or whole (``engine.wire.PlanReader``), with how long the sender waited in its
send (the engine's thread, before it launches the step).

    python bench/bench_pipes.py [--messages 40] [--out bench/results/pipes_<commit>.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench_engine import http_body, provenance  # noqa: E402

from teacher_server.benchmark.workloads import make_workload  # noqa: E402
from teacher_server.engine.request import ScoreResult  # noqa: E402
from teacher_server.engine.wire import PlanReader  # noqa: E402
from teacher_server.replicas.messages import AddMsg, ResultMsg  # noqa: E402
from teacher_server.replicas.pipes import pipe_bytes, queue_writer, widen  # noqa: E402
from teacher_server.server.parsing import parse_request  # noqa: E402
from teacher_server.validation import Limits  # noqa: E402

# A W1f step's plan to a tensor-parallel rank: 8 requests' tokens and candidate rows (3,072 x 64 int32 each)
PLAN_BYTES = 8 * (3072 * 64 * 4 + 4096 * 8)


def w1f_request() -> object:
    """A parsed W1f-shaped request (4,096 tokens, 3,072 rows of 64 candidates), as the front hands it on."""
    r = make_workload("W1f", 163840)[0]  # (Moonlight's vocabulary)
    limits = Limits(vocab_size=163840, max_model_len=8192, max_logprobs=64, max_rows_x_k=1 << 24)
    return parse_request(http_body(r), limits, "m", None, ("m",), None)[1]


def busy(stop: threading.Event) -> None:
    """Python bytecode without pause: holds the GIL but for the interpreter's switches."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def receive(kind: str, source: object, n: int, busy_thread: bool, back: object, switch_s: float | None,
            widened: bool) -> None:
    """The receiving process: ``n`` messages from ``source`` (a queue or a connection), each one's
    latency (send stamp to unpickled) sent back on ``back``; ``switch_s``: its interpreter's
    switch interval (None: Python's 5 ms)."""
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    stop = threading.Event()
    if busy_thread:
        threading.Thread(target=busy, args=(stop,), daemon=True).start()
    lat = []
    whole = PlanReader(source) if kind == "plan" and widened else None  # (a plan: "widened" reads it whole)
    back.send("ready")
    for _ in range(n):
        if kind == "plan":  # a step's plan as the engine sends it to a tensor-parallel rank: bytes
            data = whole.recv_bytes() if whole is not None else source.recv_bytes()
            lat.append(time.monotonic() - float(data[:32].decode()))
            continue
        msg = source.get() if kind == "request" else source.recv()
        sent = msg.req.arrival if kind == "request" else msg.res.finished_at
        lat.append(time.monotonic() - sent)
    stop.set()
    back.send(lat)


def measure(kind: str, widened: bool, busy_thread: bool, n: int, switch_s: float | None = None) -> dict:
    ctx = mp.get_context("spawn")
    back_r, back_w = ctx.Pipe(duplex=False)
    if kind == "request":
        q = ctx.Queue()
        if widened:
            widen(queue_writer(q))
        src, size = q, pipe_bytes(queue_writer(q))
    elif kind == "plan":  # (a duplex connection: a socket pair, as the engine's to its ranks)
        src, w = ctx.Pipe()
        size = None
    else:
        src, w = ctx.Pipe(duplex=False)
        if widened:
            widen(w)
        size = pipe_bytes(w)
    p = ctx.Process(target=receive, args=(kind, src, n, busy_thread, back_w, switch_s, widened))
    p.start()
    req = w1f_request()
    scores = np.random.default_rng(1).standard_normal((3072, 64)).astype(np.float32)
    plan = bytes(PLAN_BYTES)
    blocked = []  # the sender's time in the send (a plan: rank 0's engine thread, held until the rank has it)
    assert back_r.recv() == "ready"  # the receiver up and waiting (its busy thread too)
    for _ in range(n):
        if kind == "plan":
            t = time.monotonic()
            w.send_bytes(f"{t:<32.6f}".encode() + plan)
            blocked.append(time.monotonic() - t)
        elif kind == "request":
            req.arrival = time.monotonic()
            q.put(AddMsg(req))
        else:
            res = ScoreResult(req.request_id, req.uid, req.length, token_id_logprobs=scores, finished_at=time.monotonic())
            w.send(ResultMsg(res))
        time.sleep(0.1)  # one at a time: each crosses an idle pipe
    lat = [1e3 * x for x in back_r.recv()[2:]]  # (the first two: the receiver's own warm-up)
    p.join()
    return {"message": kind, "pipe_bytes": size, **({"read_whole": widened} if kind == "plan" else {}),
            "receiver_busy": busy_thread, "switch_ms": 1e3 * (switch_s or 0.005),
            "messages": len(lat),
            "median_ms": round(statistics.median(lat), 2), "p90_ms": round(float(np.percentile(lat, 90)), 2),
            "max_ms": round(max(lat), 2),
            **({"sender_blocked_median_ms": round(1e3 * statistics.median(blocked[2:]), 2)} if blocked else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=40)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    cases = {kind: ((True, False, None), (True, True, None), (True, True, 0.001), (False, False, None),
                    (False, True, None)) for kind in ("request", "result")}
    # a plan's socket: "widened" is read whole (``engine.wire.PlanReader``), else recv_bytes
    cases["plan"] = ((True, False, None), (True, False, 0.001), (True, True, None), (False, False, None),
                     (False, True, None))
    for kind, variants in cases.items():
        for busy_thread, widened, switch_s in variants:
            r = measure(kind, widened, busy_thread, args.messages, switch_s)
            rows.append(r)
            where = f"pipe {r['pipe_bytes']:>8} B" if r["pipe_bytes"] else f"socket, {'whole' if widened else 'pieces'}"
            print(f"{kind:8s} receiver {'busy' if busy_thread else 'idle'}  {where:16s}  "
                  f"switch {r['switch_ms']:g} ms: median {r['median_ms']:6.2f} ms  p90 {r['p90_ms']:6.2f}  "
                  f"max {r['max_ms']:6.2f}" + (f"  sender blocked {r['sender_blocked_median_ms']:.2f} ms"
                                                if "sender_blocked_median_ms" in r else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "cpus": mp.cpu_count(), "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
