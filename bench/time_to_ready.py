"""Seconds from `teacher-server serve` to /health ready, on a first start with an empty compile
cache and on a restart that keeps it (what a Kubernetes restart or rolling update pays with
the chart's compile-cache volume).

Each start is a fresh server process with dummy weights of a model shape (random weights made
in place: the time is start-up, not disk), ``--compile-cache-dir`` set to one directory that
starts empty. The server's own log line gives the seconds of each start-up phase (weights,
attention plans, compiles and autotuning, warm-up requests); both go into the JSON.

  python bench/time_to_ready.py --model-size 8b                  # H200: Qwen3-8B shape
  python bench/time_to_ready.py --model-size qwen3.5-9b          # H200: Qwen3.5-9B shape
  python bench/time_to_ready.py --model-size demo --device cpu   # CPU: the built-in demo model

The CUDA kernel library is built (or found) before the first start and kept outside the cache
(TEACHER_SERVER_EXT_DIR, as the image ships it prebuilt); the compilers' own variables are
cleared so that nothing outside the cache directory is reused."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import QWEN3_5_9B, QWEN3_8B, QWEN3_30B_A3B, QWEN3_32B, write_config

from teacher_server.benchmark.local_server import free_port, stop_server

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"demo": None, "8b": QWEN3_8B, "qwen3.5-9b": QWEN3_5_9B, "32b": QWEN3_32B, "30b-a3b": QWEN3_30B_A3B}
# issue 52's restart targets on the H200 (seconds to ready with the cache kept)
TARGETS = {"8b": 30.0, "qwen3.5-9b": 60.0}
# what the compilers would otherwise read or write outside the cache directory
COMPILER_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")
STARTUP_LINE = re.compile(r"start-up took ([\d.]+)s \((.*?)\); compile cache (.*)")
# the log's timestamp (text form: local time, milliseconds) and the front's line just before it
# starts the engine (in a process of its own, or on a thread of its own)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
ENGINE_STARTS = re.compile(r"starting the engine of|starting \d+ replicas of|loading model ")



def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until /health is 200 (from now); RuntimeError when the process ends first."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up")
        time.sleep(0.05)
    raise TimeoutError(f"server at {url} not ready after {timeout_s:.0f}s")


def parse_phases(log_text: str) -> dict:
    """The server's start-up line: total seconds, seconds per phase, the cache before and after."""
    found = list(STARTUP_LINE.finditer(log_text))
    if not found:
        return {}
    m = found[-1]  # the last one (one engine per start)
    phases = {}
    for part in m.group(2).split(", "):
        name, _, secs = part.rpartition(" ")
        if secs.endswith("s"):
            phases[name] = float(secs[:-1])
    return {"engine_s": float(m.group(1)), "phases": phases, "compile_cache": m.group(3).strip()}


def stamp(line: str) -> float | None:
    """The epoch seconds of a text log line, or None."""
    m = STAMP.match(line)
    if m is None:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3


def outside_engine(log_text: str, launched: float, ready: float) -> dict:
    """Where the seconds outside the engine's own start-up went (epoch ``launched`` and
    ``ready``, the log's stamps): ``front`` from the launch to the front starting the engine
    (the interpreter, imports, the app); ``engine process`` from there to the engine's first
    phase (a process spawned, its imports); ``after the engine`` from its start-up line to
    /health answering ready. {} when the log lacks a line."""
    front_at = end_at = None
    engine_s = None
    for line in log_text.splitlines():
        if front_at is None and ENGINE_STARTS.search(line):
            front_at = stamp(line)
        m = STARTUP_LINE.search(line)
        if m is not None:
            end_at, engine_s = stamp(line), float(m.group(1))
    if front_at is None or end_at is None:
        return {}
    return {"front": round(front_at - launched, 2), "engine process": round(end_at - engine_s - front_at, 2),
            "after the engine": round(ready - end_at, 2)}


def server_command(model: Path | None, cache: Path, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--compile-cache-dir", str(cache), "--device", args.device]
    if model is not None:
        cmd += [str(model), "--load-format", "dummy"]
    return cmd + shlex.split(args.server_args)


def one_start(name: str, cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
    """Start the server, time it to ready, stop it (SIGTERM, as an orchestrator does)."""
    port = int(cmd[cmd.index("--port") + 1])
    with open(log_path, "w") as log:
        launched = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s)
            ready = time.perf_counter() - t0  # from the launch: imports and all
        finally:
            stop_server(proc)
    text = log_path.read_text(errors="replace")
    out = {"name": name, "ready_s": round(ready, 2), **parse_phases(text),
           "outside_engine": outside_engine(text, launched, launched + ready)}
    print(f"{name:<28} ready in {ready:7.1f}s   engine {out.get('engine_s', float('nan')):6.1f}s   "
          + ", ".join(f"{k} {v:.1f}s" for k, v in out.get("phases", {}).items()) + "   outside it: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in out["outside_engine"].items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=list(SHAPES), default="8b",
                    help="model shape (dummy weights); demo: the built-in demo model")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--restarts", type=int, default=1, help="starts after the first, each keeping the cache")
    ap.add_argument("--cache-dir", help="the compile cache to use; emptied first (default: a temporary one)")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "ts-time-to-ready"),
                    help="where config.json, the logs and the kernel library go")
    ap.add_argument("--server-args", default="", help="more `teacher-server serve` flags, one string")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", help="JSON results (default bench/results/time_to_ready_<size>_<device>.json)")
    args = ap.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir) if args.cache_dir else work / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)  # the first start finds it empty
    shape = SHAPES[args.model_size]
    model = write_config(work / args.model_size, shape) if shape is not None else None

    env = {k: v for k, v in os.environ.items() if k not in COMPILER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TEACHER_SERVER_EXT_DIR", str(work / "ext"))
    if args.model_size == "demo":
        env.setdefault("XDG_CACHE_HOME", str(work / "xdg"))  # the demo checkpoint, written once, outside the cache
    gpu = args.device == "cuda" or (args.device == "auto" and _cuda())
    if gpu:  # the kernel library, as the image ships it: built before, not timed
        subprocess.run([sys.executable, "-m", "teacher_server.ops.extension"], env=env, cwd=ROOT, check=False)

    starts = []
    for i in range(1 + args.restarts):
        name = "first start (empty cache)" if i == 0 else f"restart {i} (cache kept)"
        cmd = server_command(model, cache, free_port(), args)
        starts.append(one_start(name, cmd, env, work / f"server_{i}.log", args.timeout_s))

    first, last = starts[0], starts[-1]
    # what the kept cache saved, phase by phase (positive: the restart was faster there)
    saved = {k: round(v - last.get("phases", {}).get(k, 0.0), 2) for k, v in first.get("phases", {}).items()}
    result = {"model_size": args.model_size, "device": "cuda" if gpu else "cpu", "cache_dir": str(cache),
              "server_args": args.server_args, "starts": starts,
              "restart_saved_s": round(first["ready_s"] - last["ready_s"], 2), "restart_saved_by_phase_s": saved,
              "restart_target_s": TARGETS.get(args.model_size) if gpu else None,
              "restart_within_target": (all(s["ready_s"] <= TARGETS[args.model_size] for s in starts[1:])
                                        if gpu and args.model_size in TARGETS else None),
              "provenance": provenance()}
    out = Path(args.out or ROOT / "bench" / "results" / f"time_to_ready_{args.model_size}_{result['device']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for i in range(len(starts)):  # the servers' logs beside the JSON: each phase's own lines
        shutil.copyfile(work / f"server_{i}.log", out.with_name(f"{out.stem}_server_{i}.log"))
    print(f"wrote {out}")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def provenance() -> dict:
    """The commit and the versions the start-up depends on."""
    import importlib.metadata as md

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for dist in ("torch", "triton", "fla-core", "nvidia-cudnn-frontend"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return {"commit": commit or os.environ.get("TEACHER_SERVER_COMMIT"), "argv": sys.argv, "versions": versions}


if __name__ == "__main__":
    main()
