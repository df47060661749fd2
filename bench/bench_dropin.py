"""The trainers' ways of asking for the teacher's top-K beside the candidate path, through one
server in one run, on the same requests (W1 by default: Qwen3-8B shape, random weights written
as safetensors as bench_engine.py does):

- ``candidate``: ``POST /inference/v1/generate`` with K per-row binary candidates (the house path);
- ``native_topk``: the same endpoint with ``prompt_logprob_topk`` = K (the teacher's own top-K as
  two binary arrays; no candidates sent);
- ``completions``: ``POST /v1/completions`` with the token ids and ``prompt_logprobs`` = K (vLLM's
  JSON, every position of the sequence, as TRL / ms-swift ask it).

Each: tokens/s over the requests (all tokens, the HTTP benchmark's measure), repeated, median;
the ratio native_topk / candidate (target >= 0.95). The JSON path's cost: the server's time to
build the ``/v1/completions`` bodies of the run's requests (timed here with the server's own
builder on results of the same shape), as a fraction of that mode's wall time, and the cap
that bounds one response (``max_prompt_logprobs_entries``). Then one long request (131,072
tokens by default) with teacher top-K through the in-process engine: its seconds, the peak GPU
memory above the engine's resting allocation, and the process's peak RSS.

  python bench/bench_dropin.py --out bench/results/dropin_h200.json              (H200, Qwen3-8B shape)
  python bench/bench_dropin.py --tiny --long-tokens 4096 --repeats 1 --out /tmp/dropin_cpu.json   (CPU smoke)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_engine import MODELS, http_body, tiny, wait_ready  # noqa: E402
from workloads import Req, make_workload, write_config, write_random_checkpoint  # noqa: E402

from teacher_server.config import Config  # noqa: E402

MODES = ("candidate", "native_topk", "completions")


def body(mode: str, r: Req, k: int) -> tuple[str, bytes]:
    """(path, JSON body) of request ``r`` in ``mode``."""
    import orjson

    if mode == "candidate":
        return "/inference/v1/generate", http_body(r)
    if mode == "native_topk":
        return "/inference/v1/generate", orjson.dumps({"token_ids": r.tokens.tolist(), "sampling_params": {
            "max_tokens": 1, "prompt_logprob_start": r.start, "prompt_logprob_topk": k}})
    return "/v1/completions", orjson.dumps({"prompt": r.tokens.tolist(), "max_tokens": 1, "prompt_logprobs": k})


def _npy(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


def check(mode: str, r: Req, k: int, data: dict) -> None:
    """The answer has the mode's shape (checked after the clock stops)."""
    if mode == "candidate":
        assert _npy(data["prompt_token_id_logprobs"]).shape == r.cand.shape
    elif mode == "native_topk":
        ids, lps = _npy(data["prompt_topk_token_ids"]), _npy(data["prompt_topk_logprobs"])
        assert ids.shape == lps.shape == (r.rows, k) and ids.dtype == np.int32 and np.isfinite(lps).all()
    else:
        plp = data["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(r.tokens) and plp[0] is None and len(plp[-1]) >= k


async def run_mode(url: str, mode: str, reqs: list[Req], k: int, concurrency: int) -> tuple[float, list[float], int]:
    """Seconds for all of ``reqs`` at ``concurrency`` (one httpx pool), each latency, and the
    429s answered (the server's in-flight byte budget: each retried after its Retry-After, as
    the trainers' clients do)."""
    import httpx

    bodies = [body(mode, r, k) for r in reqs]
    sem = asyncio.Semaphore(concurrency)
    lat = [0.0] * len(reqs)
    answers: list = [None] * len(reqs)
    busy = [0]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one(i: int) -> None:
            async with sem:
                s = time.perf_counter()
                path, raw = bodies[i]
                while True:
                    resp = await c.post(path, content=raw, headers={"content-type": "application/json"})
                    if resp.status_code != 429:
                        break
                    busy[0] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                assert resp.status_code == 200, resp.text[:300]
                answers[i] = resp.content
                lat[i] = time.perf_counter() - s

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(reqs))))
        dt = time.perf_counter() - t0
    for r, a in zip(reqs, answers):
        check(mode, r, k, json.loads(a))
    return dt, lat, busy[0]


def json_build_seconds(reqs: list[Req], k: int, vocab: int) -> float:
    """The server's own ``/v1/completions`` builder on results shaped as the run's (random
    values): what building those bodies costs the server."""
    import orjson

    from teacher_server.engine.request import ScoreResult
    from teacher_server.server.completions import build_completion, parse_completion
    from teacher_server.validation import Limits

    limits = Limits(vocab, 1 << 20, 256, 1 << 30, None)
    rng = np.random.default_rng(0)
    total = 0.0
    for r in reqs:
        parsed = parse_completion(orjson.dumps({"prompt": r.tokens.tolist(), "max_tokens": 1, "prompt_logprobs": k}),
                                  limits, "m", None)
        (req,) = parsed.reqs
        res = ScoreResult.empty_for(req)
        res.plp_token_logprob[:] = -rng.random(res.plp_token_logprob.shape) * 10
        res.plp_token_rank[:] = rng.integers(1, 1000, res.plp_token_rank.shape)
        res.plp_topk_ids[:] = rng.integers(0, vocab, res.plp_topk_ids.shape)
        res.plp_topk_logprobs[:] = -np.sort(rng.random(res.plp_topk_logprobs.shape) * 10, axis=1)
        res.next_token = 1
        t = time.perf_counter()
        build_completion(parsed, [res], "m", None)
        total += time.perf_counter() - t
    return total


def long_request(ckpt: Path, load_format: str, tokens: int, k: int, budget: int | None) -> dict:
    """One ``tokens``-long request with teacher top-K through the in-process engine."""
    import torch

    from teacher_server.engine.engine import Engine
    from teacher_server.engine.request import ScoreRequest

    cfg = Config(model=str(ckpt), load_format=load_format, max_model_len=tokens, enable_prefix_caching=False,
                 **({"max_num_batched_tokens": budget} if budget else {}))
    engine = Engine(cfg)
    try:
        rng = np.random.default_rng(0)
        vocab = engine.spec.vocab_size
        prompt = 1024 if tokens > 2048 else tokens // 4
        req = lambda: ScoreRequest("long", rng.integers(0, vocab, tokens), prompt - 1, top_k=k, actual=True)  # noqa: E731
        cuda = torch.cuda.is_available()
        engine.run_to_completion([ScoreRequest("warm", rng.integers(0, vocab, 4096), 1023, top_k=k)])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resting = torch.cuda.memory_allocated()
        t = time.perf_counter()
        (res,) = engine.run_to_completion([req()])
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        assert res.error is None, res.error
        assert res.topk_ids.shape == (tokens - prompt, k) and np.isfinite(res.topk_logprobs).all()
        out = {"tokens": tokens, "k": k, "rows": tokens - prompt, "seconds": round(dt, 3),
               "tokens_per_s": round(tokens / dt, 1),
               "result_mib": round((res.topk_ids.nbytes + res.topk_logprobs.nbytes) / 2**20, 1),
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
        if cuda:
            out["gpu_resting_gib"] = round(resting / 2**30, 2)  # weights and the KV pool
            out["gpu_peak_above_resting_gib"] = round((torch.cuda.max_memory_allocated() - resting) / 2**30, 3)
            out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return out
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--k", type=int, default=64, help="K of the candidates and of the teacher's top-K")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the server's)")
    ap.add_argument("--long-tokens", type=int, default=131072, help="the long request's length (0: skip it)")
    ap.add_argument("--tiny", action="store_true", help="a small Qwen3 of the same layer pattern (CPU smoke runs)")
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="dummy",
                    help="dummy: config.json only, random weights made in place (the cost does not depend on the "
                         "weights); auto: a random safetensors checkpoint written and loaded")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg, family, _ = MODELS["8b"]
    if args.tiny:
        cfg = tiny(cfg)
    ckpt = Path(args.ckpt_dir) / (f"{family}-8b" + ("-tiny" if args.tiny else ""))
    if args.load_format == "dummy":
        write_config(ckpt, cfg)
    else:
        write_random_checkpoint(ckpt, cfg)
    vocab = cfg["vocab_size"]
    reqs = make_workload(args.workload + (":tiny" if args.tiny else ""), vocab, k=args.k)
    k = int(reqs[0].cand.shape[1])  # (the tiny workloads carry fewer candidates)
    modes = [m for m in args.modes.split(",") if m]
    total_tokens = sum(len(r.tokens) for r in reqs)
    import torch

    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "workload": args.workload + (":tiny" if args.tiny else ""),
                     "model": f"{cfg['architectures'][0]} 8B shape{' (tiny)' if args.tiny else ''}, random weights "
                              f"({args.load_format})",
                     "k": k, "requests": len(reqs), "tokens": total_tokens, "concurrency": args.concurrency,
                     "modes": {}}
    max_len = max(len(r.tokens) for r in reqs)
    cap = Config().max_prompt_logprobs_entries
    port = 18500 + os.getpid() % 500
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--model", str(ckpt), "--port", str(port),
           "--host", "127.0.0.1", "--log-level", "warning", "--max-model-len", str(max_len),
           "--no-enable-prefix-caching", "--load-format", args.load_format, *(["--max-num-batched-tokens", str(args.budget)] if args.budget else [])]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        for mode in modes:  # warm-up: each mode once on a few requests
            asyncio.run(run_mode(url, mode, reqs[: max(2, len(reqs) // 8)], k, args.concurrency))
        runs: dict[str, list[float]] = {m: [] for m in modes}
        busy: dict[str, int] = {m: 0 for m in modes}
        for _ in range(args.repeats):  # the modes alternate, so a drift of the machine touches all
            for mode in modes:
                dt, lat, n429 = asyncio.run(run_mode(url, mode, reqs, k, args.concurrency))
                runs[mode].append(dt)
                busy[mode] += n429
                print(f"{mode}: {dt:.2f}s {total_tokens / dt:,.0f} tok/s ({n429} answered 429 and retried)", flush=True)
        for mode in modes:
            med = sorted(runs[mode])[len(runs[mode]) // 2]
            results["modes"][mode] = {"seconds": round(med, 3), "tokens_per_s": round(total_tokens / med, 1),
                                      "runs_seconds": [round(x, 3) for x in runs[mode]],
                                      "answered_429_and_retried": busy[mode]}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    m = results["modes"]
    if "candidate" in m and "native_topk" in m:
        results["native_topk_over_candidate"] = round(m["native_topk"]["tokens_per_s"] / m["candidate"]["tokens_per_s"],
                                                      4)
    if "completions" in m:
        build = json_build_seconds(reqs, k, vocab)
        entries = max((len(r.tokens) - 1) * (k + 1) for r in reqs)
        results["json"] = {
            "build_seconds": round(build, 3),
            "fraction_of_completions_wall": round(build / m["completions"]["seconds"], 4),
            "build_us_per_entry": round(1e6 * build / sum((len(r.tokens) - 1) * (k + 1) for r in reqs), 3),
            "largest_request_entries": entries, "cap_max_prompt_logprobs_entries": cap,
            "note": "the server builds these bodies on one thread beside the engine (the plp pool); the fraction is of "
                    "the mode's wall time"}
        if "candidate" in m:
            results["completions_over_candidate"] = round(m["completions"]["tokens_per_s"]
                                                          / m["candidate"]["tokens_per_s"], 4)
    if args.long_tokens:
        results["long_request"] = long_request(ckpt, args.load_format, args.long_tokens, k, args.budget)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
