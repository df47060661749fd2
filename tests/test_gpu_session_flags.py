"""bench/gpu_session.sh runs the device steps, where a call costs minutes of a rationed lease: a
flag a bench script no longer takes fails that step only there. Every flag the session passes
to a bench script (its defaults in ${VAR:-...} included) must be one the script's parser
knows."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"
_CALL = re.compile(r"python3 (bench/[\w]+\.py)(.*?)(?:2>&1|\s\|\s|;;|\s>\s|$)")
_FLAG = re.compile(r"(?<!\w)--([a-zA-Z][\w-]*)")


def flags_passed(text: str) -> dict[str, set[str]]:
    """{script: the flags gpu_session.sh passes it}, backslash-continued lines joined; the
    flags ``fit_layers`` prints go to bench_engine.py."""
    joined = text.replace("\\\n", " ")
    calls: dict[str, set[str]] = {}
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in _CALL.finditer(line):
            calls.setdefault(m.group(1), set()).update(_FLAG.findall(m.group(2)))
    fit = re.search(r"fit_layers\(\) \{(.*?)\n\}", text, re.S)
    assert fit, "fit_layers not found"
    calls.setdefault("bench/bench_engine.py", set()).update(_FLAG.findall(fit.group(1)))
    return calls


def known_flags(script: str) -> set[str]:
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{script} --help: {out.stderr[-2000:]}"
    return set(_FLAG.findall(out.stdout))


def test_the_parser_reads_the_sessions_calls() -> None:
    calls = flags_passed('fit_layers() {\n  echo "--num-layers 9"\n}\n'
                         '    qwen35) python3 bench/bench_engine.py ${A:---workloads W1 --http W1 \\\n'
                         '      --max-model-len 8192} --out "$OUT/x.json" 2>&1 | tee y --not-this\n'
                         '    # python3 bench/bench_gemm.py --commented-out\n')
    assert calls == {"bench/bench_engine.py": {"workloads", "http", "max-model-len", "out", "num-layers"}}


def test_every_flag_the_gpu_session_passes_is_one_its_script_takes() -> None:
    calls = flags_passed(SCRIPT.read_text())
    assert "bench/bench_engine.py" in calls and len(calls) >= 10, sorted(calls)
    with ThreadPoolExecutor(4) as pool:
        known = dict(zip(calls, pool.map(known_flags, calls)))
    unknown = {script: sorted(flags - known[script]) for script, flags in calls.items() if flags - known[script]}
    assert not unknown, f"gpu_session.sh passes flags its scripts do not take: {unknown}"


def test_every_ablation_the_gpu_session_names_is_a_variant() -> None:
    """The names after --ablate-only (bench_engine checks them only when it starts, on the device)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_engine

    named = re.findall(r"--ablate-only ([\w,#]+)", SCRIPT.read_text().replace("\\\n", " "))
    assert named, "no --ablate-only in gpu_session.sh"
    unknown = {v for group in named for v in group.split(",") if v not in bench_engine.ABLATIONS}
    assert not unknown, f"gpu_session.sh names ablations bench_engine has not: {sorted(unknown)}"
