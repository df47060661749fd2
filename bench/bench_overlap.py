"""Does splitting a step into two halves on two streams hide its memory-bound passes under the
other half's multiplies (nano-batch overlap)? A dense layer's sequence at a step's token count,
without attention: RMSNorm, the QKV projection, a pass over its output standing for rotary and
the KV write, the o projection onto the residual, RMSNorm, gate/up, SiLU-mul, down onto the
residual. Each schedule runs for several seconds (the clock settles under the power limit)
with the SM clock and power sampled:

- ``gemms``: the multiplies alone, whole step (what the passes' removal could at best reach);
- ``serial``: the engine's order, whole step, one stream;
- ``serial_halves``: two halves one after the other, one stream (the cost of smaller GEMMs);
- ``overlap_halves``: the halves on two streams, their multiplies alternating (half A's k-th,
  half B's k-th, A's k+1-th, ...), so each half's passes can run while the other's multiply
  does.

``hidden`` is the share of the passes' time that the overlap removes:
(serial - overlap_halves) / (serial - gemms).

  python bench/bench_overlap.py --model-size 8b --tokens 16384 --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_gemm import MODELS, Sampler, header, shapes, timed  # noqa: E402
from workloads import H200_PEAK  # noqa: E402

from teacher_server.ops import extension  # noqa: E402
from teacher_server.ops.silu_mul import silu_mul_reference  # noqa: E402


class Half:
    """One half-step's buffers and its layer as a list of (is_gemm, call)."""

    def __init__(self, m: int, cfg: dict, w: dict, dev: torch.device, dt: torch.dtype, layers: int) -> None:
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        qkv_n = w["qkv"].shape[0]
        self.resid = torch.randn(m, h, device=dev, dtype=dt)
        # every input random, never zeros: a multiply's power draw (and so its clock under the
        # power cap) depends on its data
        self.x = torch.randn(m, h, device=dev, dtype=dt)
        self.qkv = torch.randn(m, qkv_n, device=dev, dtype=dt)
        self.attn = torch.randn(m, w["o"].shape[1], device=dev, dtype=dt)  # attention's output (not run)
        self.gu = torch.randn(m, 2 * inter, device=dev, dtype=dt)
        self.act = torch.randn(m, inter, device=dev, dtype=dt)
        self.flops = 2.0 * m * sum(t.shape[0] * t.shape[1] for t in w.values() if t.dim() == 2)
        nw, eps = w["norm"], 1e-6

        ext = extension.load()  # the engine's SiLU-mul kernel (the torch version without it)

        def norm() -> None:
            self.x = F.rms_norm(self.resid, (h,), nw, eps)

        def act() -> None:
            if ext is not None:
                ext.silu_mul_out(self.gu, self.act)
            else:
                self.act = silu_mul_reference(self.gu)

        self.ops = [
            (False, norm),
            (True, lambda: torch.mm(self.x, w["qkv"].t(), out=self.qkv)),
            (False, lambda: self.qkv.mul_(1.0)),  # rotary + KV write: one read and write of qkv
            (True, lambda: self.resid.addmm_(self.attn, w["o"].t())),
            (False, norm),
            (True, lambda: torch.mm(self.x, w["gate_up"].t(), out=self.gu)),
            (False, act),
            (True, lambda: self.resid.addmm_(self.act, w["down"].t())),
        ] * layers  # a few layers per call: the overlap carries across layer boundaries


def weights(cfg: dict, dev: torch.device, dt: torch.dtype) -> dict:
    """The layer's projection weights ([N, K], the shapes of bench_gemm) and the norm's."""
    h = cfg["hidden_size"]
    w = {name: torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
         for name, k, n, _ in shapes(cfg) if name in ("qkv", "o", "gate_up", "down")}
    w["norm"] = torch.ones(h, device=dev, dtype=dt)
    return w


def schedules(full: Half, a: Half, b: Half, s1: torch.cuda.Stream, s2: torch.cuda.Stream) -> dict:
    def gemms() -> None:
        for g, op in full.ops:
            if g:
                op()

    def serial() -> None:
        for _, op in full.ops:
            op()

    def serial_halves() -> None:
        for half in (a, b):
            for _, op in half.ops:
                op()

    def up_to_next_multiply(half: Half, at: int, stream: torch.cuda.Stream, after: list, done: list) -> int:
        """Launch ``half``'s ops from ``at`` through its next multiply on ``stream``, the
        multiply after the other half's last (``after``); returns where it stopped."""
        with torch.cuda.stream(stream):
            while at < len(half.ops):
                g, op = half.ops[at]
                if g and after:
                    stream.wait_event(after[-1])
                op()
                at += 1
                if g:
                    done.append(torch.cuda.Event())
                    done[-1].record(stream)
                    break
        return at

    def overlap_halves() -> None:
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        done_a: list[torch.cuda.Event] = []
        done_b: list[torch.cuda.Event] = []
        # A's ops up to and including its k-th multiply, then B's, alternating: B's k-th multiply
        # waits for A's k-th, A's k+1-th for B's k-th, so the multiplies never share the GPU and
        # each half's passes overlap the other half's multiply
        ia = ib = 0
        while ia < len(a.ops) or ib < len(b.ops):
            ia = up_to_next_multiply(a, ia, s1, done_b, done_a)
            ib = up_to_next_multiply(b, ib, s2, done_a, done_b)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    return {"gemms": gemms, "serial": serial, "serial_halves": serial_halves, "overlap_halves": overlap_halves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="8b", choices=list(MODELS))
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--sustain-s", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=8, help="layers per timed call")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, dt, dev = MODELS[args.model_size], torch.bfloat16, torch.device("cuda")
    res: dict = {**header(args.model_size), "silu_mul_kernel": extension.load() is not None, "runs": {}}
    w = weights(cfg, dev, dt)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for m in (int(t) for t in args.tokens.split(",")):
        full, a, b = (Half(n, cfg, w, dev, dt, args.layers) for n in (m, m // 2, m - m // 2))
        row: dict = {}
        for name, fn in schedules(full, a, b, s1, s2).items():
            per = timed(fn, 3)
            iters = max(1, int(args.sustain_s / per))
            with Sampler() as smp:
                s = timed(fn, iters) / args.layers  # per layer
            gemm_flops = full.flops
            row[name] = {"ms_per_layer": s * 1e3, "gemm_tflops": gemm_flops / s / 1e12,
                         "gemm_frac_peak": gemm_flops / s / H200_PEAK, **smp.summary()}
            print(f"M={m} {name:>15}: {s * 1e3:7.3f} ms/layer, multiplies at {gemm_flops / s / 1e12:5.0f} TF/s "
                  f"({gemm_flops / s / H200_PEAK:.3f} of peak) {smp.summary()}", flush=True)
        passes = row["serial"]["ms_per_layer"] - row["gemms"]["ms_per_layer"]
        row["passes_ms"] = passes
        row["hidden"] = (row["serial"]["ms_per_layer"] - row["overlap_halves"]["ms_per_layer"]) / passes
        row["overlap_vs_serial"] = row["overlap_halves"]["ms_per_layer"] / row["serial"]["ms_per_layer"]
        print(f"M={m}: passes {passes:.3f} ms/layer; overlap hides {row['hidden']:.1%} of them; "
              f"overlap/serial {row['overlap_vs_serial']:.3f}", flush=True)
        res["runs"][str(m)] = row
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
