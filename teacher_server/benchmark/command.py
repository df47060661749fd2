"""``teacher-server bench``: the canonical workloads (docs/design.md, sections 3 and 4) through the HTTP
endpoint, with a progress bar, a table and a PNG plot of tokens/s and MFU.

  teacher-server bench --url http://127.0.0.1:8000            # a running server
  teacher-server bench --model /path/to/checkpoint             # starts one on a free port
  teacher-server bench --shape qwen3-8b --workloads W1,W1f     # random weights of a shape (GPU)
  teacher-server bench --shape qwen3-8b --tiny                 # the same path at a tiny size (CPU)

Throughput is every token of every request over the wall time from the first send to the
last answer (128 requests in flight by default, as DESIGN measures); MFU counts the FLOPs of
the tokens the server computed (prefix-cache hits left out) against --peak-tflops per GPU."""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from teacher_server import __version__
from teacher_server.benchmark import workloads as wl
from teacher_server.benchmark.report import plot, table
from teacher_server.client import TeacherServerError, fetch_model_card, normalise_base_url

SHAPES = {"qwen3-8b": wl.QWEN3_8B, "qwen3-32b": wl.QWEN3_32B, "qwen3-30b-a3b": wl.QWEN3_30B_A3B,
          "qwen3.5-9b": wl.QWEN3_5_9B, "llama-3.3-70b": wl.LLAMA33_70B, "moonlight-16b-a3b": wl.MOONLIGHT_16B_A3B,
          "gpt-oss-20b": wl.GPT_OSS_20B, "qwen3-next-80b-a3b-24l": wl.QWEN3_NEXT_80B_A3B_LAYERS,
          "gemma-3-27b": wl.GEMMA3_27B, "glm-4.5-air-layers": wl.GLM45_AIR_LAYERS}
# dense bf16 peak per GPU by name, for MFU when the server runs here; elsewhere --peak-tflops (default H200's)
# (the first name found in the GPU's name: the PCIe and NVL cards before the SXM ones they contain)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H200": 989.0, "H100": 989.0,
               "H20": 148.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def build_parser(prog: str = "teacher-server bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="base URL of a running server")
    src.add_argument("--model", help="a checkpoint directory or hub id: a server is started for the run")
    src.add_argument("--shape", choices=list(SHAPES), help="random weights of this shape (dummy load: nothing written)")
    src.add_argument("--from-json", metavar="FILE", help="redraw the table and plot of an earlier run's bench.json")
    p.add_argument("--workloads", default=None,
                   help="comma-separated: W1, W1f, W2, W3, W4, G1, L<tokens> (default W1; with --tiny W1:tiny,W2:tiny)")
    p.add_argument("--tiny", action="store_true", help="the workloads (and a --shape) scaled down: a CPU smoke run")
    p.add_argument("--k", type=int, default=64, help="candidates per scored row (default 64)")
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight (default 128)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per workload; the median is reported")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="time each workload cold (default: an untimed pass of an eighth of its shape first, other ids)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--wait-ready-s", type=float, default=0.0,
                   help="with --url, wait up to this long for the server's /health to be 200 (a server still loading)")
    p.add_argument("--model-config", help="the model's config.json for the FLOP count (default: the served "
                                          "checkpoint's, when this machine can read it)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 TFLOP/s of one GPU for MFU (default: from the local GPU's name, else 989, an H200)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the server uses (MFU is per GPU)")
    p.add_argument("--serve-args", default="", help="extra `teacher-server serve` flags for --model/--shape")
    p.add_argument("--out", default="teacher-server-bench", help="folder for bench.json, bench.png (and server.log)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        try:
            results = _run(args, out)
        except TeacherServerError as e:  # one line, not the client's traceback
            hint = (": the server cannot take this workload in time (on a CPU, --tiny runs the small versions)"
                    if e.status in (429, 503, 504) else "")
            raise SystemExit(f"teacher-server bench: a request failed: {e}{hint}") from None
        (out / "bench.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "bench.png")
    print(table(results))
    print(f"wrote {out / 'bench.png'}" if args.from_json else f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


def _run(args: argparse.Namespace, out: Path) -> dict:
    names = (args.workloads or ("W1:tiny,W2:tiny" if args.tiny else "W1")).split(",")
    names = [n + ":tiny" if args.tiny and not n.endswith(":tiny") else n for n in names if n]
    for name in names:  # before a server starts or a checkpoint is made
        try:
            wl.check_name(name)
        except ValueError as e:
            raise SystemExit(f"teacher-server bench: --workloads: {e}") from None
    if args.url:
        from teacher_server.benchmark.local_server import wait_ready

        url = normalise_base_url(args.url)
        wait_ready(url, args.wait_ready_s, args.api_key)
        return _measure(args, url, names, local_gpu=None)
    from teacher_server.benchmark.local_server import local_server

    serve = args.serve_args.split()
    gpu = _local_gpu()
    if args.shape:
        cfg = wl.tiny(SHAPES[args.shape]) if args.tiny else SHAPES[args.shape]
        if gpu is None and not args.tiny:
            raise SystemExit(f"teacher-server bench: no GPU here; a {args.shape} shape "
                             f"({wl.checkpoint_bytes(cfg) / 1e9:.0f} GB of weights) would take hours on the CPU. "
                             "Add --tiny for the same path at a small size, or run on a GPU machine")
        with tempfile.TemporaryDirectory(prefix="ts-bench-") as tmp:
            ckpt = Path(tmp) / args.shape
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps(cfg))  # dummy load: weights made in place, none written
            serve = ["--model", str(ckpt), "--load-format", "dummy", "--served-model-name",
                     f"{args.shape}{'-tiny' if args.tiny else ''}-random", *serve]
            with local_server(serve, str(out / "server.log")) as url:
                results = _measure(args, url, names, local_gpu=gpu, cfg=cfg)
        return results
    with local_server(["--model", args.model, *serve], str(out / "server.log")) as url:
        return _measure(args, url, names, local_gpu=gpu)


def _local_gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _measure(args: argparse.Namespace, url: str, names: list[str], local_gpu: str | None,
             cfg: dict | None = None) -> dict:
    from teacher_server.benchmark.runner import run_pass, warm_up

    card = fetch_model_card(url, args.api_key)
    cfg = cfg or _flops_config(args.model_config, card.get("root"))
    peak = args.peak_tflops or gpu_peak(local_gpu)
    results = {"url": url, "model": card["id"], "vocab_size": card["vocab_size"],
               "max_model_len": card["max_model_len"], "device": local_gpu, "peak_tflops": peak, "gpus": args.gpus,
               "concurrency": args.concurrency,
               "k": args.k, "version": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "flops_config": cfg is not None, "workloads": {}}
    warm_up(url, card["vocab_size"], args.api_key)
    salt = secrets.randbelow(card["vocab_size"])  # (another run against the same server: other ids)
    for name in names:
        reqs = wl.make_workload(name, card["vocab_size"], k=args.k)
        longest = max(len(r.tokens) for r in reqs)
        if longest > card["max_model_len"]:
            print(f"skipping {name}: its longest request ({longest} tokens) exceeds the server's max_model_len "
                  f"({card['max_model_len']})", file=sys.stderr)
            continue
        if args.warm_up:  # other random ids (no prefix of the timed pass cached), not timed
            warm = wl.make_workload(name, card["vocab_size"], k=args.k, seed=1)
            run_pass(url, warm[: max(2, len(warm) // 8)], args.concurrency, args.api_key, f"{name} warm-up")
        passes = []
        for i in range(args.repeats):
            salt += 1
            passes.append(run_pass(url, salted(reqs, salt, card["vocab_size"]), args.concurrency, args.api_key,
                                   f"{name} {i + 1}/{args.repeats}"))
        results["workloads"][name] = _summary(reqs, passes, cfg, peak * 1e12 * args.gpus)
    return results


def gpu_peak(name: str | None) -> float:
    """Dense bf16 TFLOP/s of a GPU by its name (989, an H200's, for one not listed or none)."""
    return next((v for k, v in PEAK_TFLOPS.items() if name and k in name), 989.0)


def salted(reqs: list[wl.Req], salt: int, vocab: int) -> list[wl.Req]:
    """The requests with every token id shifted by ``salt`` (mod the vocabulary): the same shapes
    and the same prefixes shared within the workload (W2's groups), but none with an earlier
    pass or workload, whose prefixes the server's cache still holds (W2's prompts begin as W1f's:
    a repeat, or W2 after W1f, had timed cache hits as throughput)."""
    return [wl.Req((r.tokens + salt) % vocab, r.start, r.cand) for r in reqs]


def _flops_config(path: str | None, root: str | None) -> dict | None:
    for candidate in ([path] if path else []) + ([str(Path(root) / "config.json")] if root else []):
        if Path(candidate).is_file():
            return json.loads(Path(candidate).read_text())
    if path:
        raise SystemExit(f"teacher-server bench: --model-config {path} does not exist")
    return None


def _summary(reqs: list[wl.Req], passes: list, cfg: dict | None, peak_flops: float) -> dict:
    mid = sorted(passes, key=lambda p: p.seconds)[len(passes) // 2]  # the median pass
    tokens = sum(len(r.tokens) for r in reqs)
    lat = sorted(mid.latencies_s)
    mfu = None
    try:
        if cfg is not None:
            mfu = wl.flops(cfg, reqs, computed_only=True, cached=mid.cached_tokens) / mid.seconds / peak_flops
    except (KeyError, ValueError) as e:  # a config.json the FLOP count cannot read: no MFU, said so
        print(f"no MFU: the model's config.json lacks {e}", file=sys.stderr)
    return {"requests": len(reqs), "tokens": tokens, "scored_rows": sum(r.rows for r in reqs),
            "seconds": mid.seconds, "tok_s": tokens / mid.seconds, "mfu": mfu,
            "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "cached_share": sum(mid.cached_tokens) / tokens, "all_seconds": [p.seconds for p in passes],
            "all_cached_shares": [sum(p.cached_tokens) / tokens for p in passes]}
