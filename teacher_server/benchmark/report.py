"""The benchmark's results: the table printed at the end and the PNG plot of tokens/s and MFU
(``png.py``), both from the JSON the run writes, so ``--from-json`` redraws them anywhere."""

from __future__ import annotations

from pathlib import Path

from teacher_server.benchmark.png import Panel, bar_chart_png


def table(results: dict) -> str:
    head = f"{'workload':<10} {'requests':>8} {'tokens':>10} {'seconds':>9} {'tok/s':>10} {'MFU':>7} " \
           f"{'p50 s':>7} {'p99 s':>7} {'cached':>7}"
    lines = [f"{results['model']} at {results['url']}; MFU against {results['peak_tflops']:g} TFLOP/s "
             f"x {results['gpus']} GPU(s)" + ("" if results.get("flops_config") else " (no config.json: no MFU)"),
             head, "-" * len(head)]
    for name, w in results["workloads"].items():
        mfu = _mfu(w["mfu"]) if w.get("mfu") is not None else "-"
        lines.append(f"{name:<10} {w['requests']:>8} {w['tokens']:>10} {w['seconds']:>9.2f} {w['tok_s']:>10,.0f} "
                     f"{mfu:>7} {w['p50_s']:>7.2f} {w['p99_s']:>7.2f} {w['cached_share']:>7.1%}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    names = list(results["workloads"])
    ws = [results["workloads"][n] for n in names]
    panels = [Panel("tokens/s", names, [("teacher-server", [w["tok_s"] for w in ws])])]
    if any(w.get("mfu") is not None for w in ws):
        panels.append(Panel("MFU", names, [("teacher-server", [w.get("mfu") for w in ws])], fmt=_mfu))
    path.write_bytes(bar_chart_png(panels, title=results["model"][:70]))


def _mfu(v: float) -> str:
    """Three decimals, as the results files' MFU are read; a CPU run's tiny values in powers of ten."""
    return f"{v:.3f}" if v >= 0.01 else f"{v:.1e}"
