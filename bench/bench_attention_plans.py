"""Does another of cuDNN's plans run a step's attention faster than the one its heuristic
picks? For steps the engine runs (W1 at the 32768- and 16384-token budgets, W1f's 8 x 4096,
W3's 32768-token sequence; Qwen3-8B's heads and Qwen3-32B's), the ``cudnn_fe`` backend builds
the step's graph as the engine does; then every plan cuDNN's heuristics list for it is built,
checked against the heuristic's pick and timed, in interleaved rounds: a burst (median of
short CUDA-event timings, clocks up) and a sustained loop (back to back for a second, the
power limit in force, as between the engine's multiplies).

    python bench/bench_attention_plans.py [--heur-modes A,B,FALLBACK] [--out bench/results/attention_plans.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

import bench_attention as ba  # noqa: E402
from bench_kernel import time_ms  # noqa: E402

from teacher_server.attention import make_backend  # noqa: E402
from teacher_server.attention.cudnn_fe import FeCall  # noqa: E402

HEADS = {"8b": (32, 8, 128), "32b": (64, 8, 128)}
TOL = 0.05  # bf16 outputs of O(1): two correct kernels differ by about 1e-2 at most


def steps() -> dict[str, list[tuple[int, int]]]:
    return {"w1_32k": ba.w1_step(32768), "w1_16k": ba.w1_step(16384), "w1f": [(4096, 4096)] * 8,
            "w3": [(32768, 32768)]}


def sustained_ms(run, seconds: float) -> float:  # noqa: ANN001
    """Milliseconds a call, back to back for ``seconds``."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t, n = time.perf_counter(), 0
    start.record()
    while time.perf_counter() - t < seconds:
        for _ in range(4):
            run()
        n += 4
        if n % 64 == 0:
            torch.cuda.synchronize()  # (keep the launch queue short: the clock stops with the work)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="8b,32b")
    ap.add_argument("--steps", default="w1_32k,w1_16k,w1f,w3")
    ap.add_argument("--heur-modes", default="A,B,FALLBACK")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sustain-s", type=float, default=1.0)
    ap.add_argument("--out", default="bench/results/attention_plans.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "heur_modes": args.heur_modes, "cases": {}}
    all_steps = steps()
    for hname in args.heads.split(","):
        ba.HQ, ba.HK, ba.D = HEADS[hname]
        for sname in args.steps.split(","):
            lens = all_steps[sname]
            tensors, ctx, flop = ba.make(lens, None)
            scale = ba.D ** -0.5
            be = make_backend("cudnn_fe", dev)
            be.split = None
            be.heur_modes = tuple(args.heur_modes.split(","))
            ref = be(tensors, ctx, scale, None).float()
            items = [it for it in ctx.attn_plan.items if isinstance(it, FeCall)]
            assert len(items) == 1, len(items)
            (full, (g, _)), = ((k, e) for k, e in be._graphs.items() if k[:4] == items[0].key)
            picked = getattr(g, "_plan_index", None)
            n = g.get_execution_plan_count()
            case = {"lens": lens, "graph": [str(x) for x in full], "plans": n, "picked": picked, "plan": {}}

            def select(i: int, g=g, be=be, full=full) -> None:  # noqa: ANN001
                g.build_plan_at_index(i)
                be._graphs[full] = (g, g.get_workspace_size())

            def run(be=be, tensors=tensors, ctx=ctx, scale=scale) -> None:  # noqa: ANN001
                be(tensors, ctx, scale, None)

            usable = []
            for i in range(n):
                name = g.get_plan_name_at_index(i)
                row = case["plan"][i] = {"name": name}
                try:
                    select(i)
                    diff = (be(tensors, ctx, scale, None).float() - ref).abs().max().item()
                except Exception as e:  # a plan that does not build or run here
                    row["refused"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                    continue
                row.update(max_abs_diff=diff, workspace=be._graphs[full][1], burst_ms=[], sustained_ms=[])
                if diff <= TOL:
                    usable.append(i)
            for r in range(args.rounds):  # interleaved, the order rotated
                for i in usable[r % len(usable):] + usable[:r % len(usable)]:
                    select(i)
                    case["plan"][i]["burst_ms"].append(time_ms(run, 20, 3))
                    case["plan"][i]["sustained_ms"].append(sustained_ms(run, args.sustain_s))
            for i in usable:
                row = case["plan"][i]
                row["burst"] = statistics.median(row["burst_ms"])
                row["sustained"] = statistics.median(row["sustained_ms"])
                row["burst_tflops"], row["sustained_tflops"] = flop / row["burst"] / 1e9, flop / row["sustained"] / 1e9
                print(f"{hname:3s} {sname:7s} plan {i:2d}{'*' if i == picked else ' '} {row['name'][:60]:60s} "
                      f"burst {row['burst']:7.3f} ms ({row['burst_tflops']:4.0f})  sustained {row['sustained']:7.3f} ms "
                      f"({row['sustained_tflops']:4.0f})  diff {row['max_abs_diff']:.3g}", flush=True)
            for i, row in case["plan"].items():
                if "refused" in row or i not in usable:
                    print(f"{hname:3s} {sname:7s} plan {i:2d} {row['name'][:60]:60s} not timed: "
                          f"{row.get('refused') or 'differs by {:.3g}'.format(row['max_abs_diff'])}", flush=True)
            if picked in usable:
                best = min(usable, key=lambda i: case["plan"][i]["sustained"])
                case["best_sustained"] = best
                case["best_over_picked"] = case["plan"][best]["sustained"] / case["plan"][picked]["sustained"]
                print(f"{hname:3s} {sname:7s} best sustained: plan {best}, {case['best_over_picked']:.3f} of the "
                      f"pick's time", flush=True)
            results["cases"][f"{hname}_{sname}"] = case
            be._graphs.clear()
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
