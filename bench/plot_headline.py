"""The README's headline plot, drawn from the results files that hold its numbers: tokens/s
and MFU of teacher-server against the in-process transformers baseline measured in the same
run (one H200, random weights of the real shapes). Writes docs/headline.png.

  python bench/plot_headline.py [--out docs/headline.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from teacher_server.benchmark.png import Panel, bar_chart_png  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# (label, results file, workload): the README's headline rows (bench/README.md says why these runs)
HEADLINE = [
    ("W1", "engine_8b_w1_w3_w2_baseline_96ea40f.json", "W1"),
    ("W1f", "engine_8b_ceiling_last_layer_2c6084b.json", "W1f"),
    ("W3", "engine_8b_ceiling_last_layer_2c6084b.json", "W3"),
    ("W4 (32B)", "engine_32b_w4_budget_auto_960b47b.json", "W4"),
]


def headline() -> list[dict]:
    """Per headline row: label, file, and teacher-server's / the baseline's tok/s and MFU (None
    where the baseline was not run)."""
    rows = []
    for label, file, workload in HEADLINE:
        data = json.loads((RESULTS / file).read_text())
        ours, base = data["engine"][workload], data.get("baseline", {}).get(workload)
        rows.append({"label": label, "file": file, "tok_s": ours["tokens_per_s"], "mfu": ours["mfu"],
                     "base_tok_s": base["tokens_per_s"] if base else None, "base_mfu": base["mfu"] if base else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "headline.png"))
    args = ap.parse_args()
    rows = headline()
    labels = [r["label"] for r in rows]
    panels = [Panel("tokens/s", labels, [("teacher-server", [r["tok_s"] for r in rows]),
                                         ("transformers", [r["base_tok_s"] for r in rows])]),
              Panel("MFU", labels, [("teacher-server", [r["mfu"] for r in rows]),
                                    ("transformers", [r["base_mfu"] for r in rows])], fmt=lambda v: f"{v:.3f}")]
    Path(args.out).write_bytes(bar_chart_png(panels, title="One H200, Qwen3-8B / Qwen3-32B shapes, K=64"))
    for r in rows:
        print(r)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
