"""``teacher-server bench``: found from ``--help``, run against a running server (the demo
model on CPU, the workloads at their tiny size) it prints a table and writes its JSON and a
PNG; a full-size shape is refused where there is no GPU, and so is writing a full-size random
checkpoint (``make bench-engine``), which leaves no partial file behind when stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from teacher_server.benchmark.command import main as bench_main
from teacher_server.benchmark.png import FONT, Panel, bar_chart_png
from teacher_server.benchmark.progress_bar import ProgressBar
from teacher_server.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def test_help_lists_bench() -> None:
    r = subprocess.run([sys.executable, "-m", "teacher_server", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0 and "bench" in r.stdout and "--url" in r.stdout


def test_bench_against_a_running_server(demo_server, tmp_path, capsys) -> None:
    cli_main(["bench", "--url", demo_server.url, "--tiny", "--workloads", "W1,W2", "--repeats", "2",
              "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    res = json.loads((tmp_path / "bench.json").read_text())
    assert list(res["workloads"]) == ["W1:tiny", "W2:tiny"]
    w1, w2 = res["workloads"]["W1:tiny"], res["workloads"]["W2:tiny"]
    assert w1["requests"] == 8 and w2["requests"] == 16 and len(w1["all_seconds"]) == 2
    assert w1["tok_s"] == pytest.approx(w1["tokens"] / w1["seconds"])
    assert w1["mfu"] is not None and w1["mfu"] > 0  # the demo checkpoint's config.json is readable here
    assert w2["cached_share"] > 0  # the groups' prompts came from the prefix cache
    # every pass alike: a repeat, or W2 after W1, finds nothing of an earlier pass in the cache
    assert w1["all_cached_shares"] == [0.0, 0.0] and len(set(w2["all_cached_shares"])) == 1
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and b"IEND" in png[-12:]
    assert "W1:tiny" in printed and "tok/s" in printed and "MFU" in printed
    # the same table and plot again from the JSON alone
    again = tmp_path / "again"
    capsys.readouterr()
    bench_main(["--from-json", str(tmp_path / "bench.json"), "--out", str(again)])
    assert (again / "bench.png").read_bytes() == png
    assert not (again / "bench.json").exists()  # (and not said to be written)
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {again / 'bench.png'}")


def test_salted_passes_keep_shapes_and_shared_prefixes() -> None:
    from teacher_server.benchmark import workloads as wl
    from teacher_server.benchmark.command import gpu_peak, salted

    reqs = wl.make_workload("W2:tiny", 1000)
    again = salted(reqs, 3, 1000)
    assert [len(r.tokens) for r in again] == [len(r.tokens) for r in reqs]
    assert all((a.tokens != r.tokens).all() and a.start == r.start and (a.cand == r.cand).all()
               for a, r in zip(again, reqs))
    shared = lambda rs: [(rs[0].tokens[:n] == r.tokens[:n]).all() for r in rs for n in [50]]  # noqa: E731
    assert shared(again) == shared(reqs)
    assert gpu_peak("NVIDIA H100 PCIe") == 756 and gpu_peak("NVIDIA H200 NVL") == 835
    assert gpu_peak("NVIDIA H100 80GB HBM3") == gpu_peak("NVIDIA H200") == gpu_peak(None) == 989


@pytest.mark.parametrize(("argv", "says"), [
    (["--tiny", "--workloads", "W1,W1f"], "no tiny variant of 'W1f': --tiny takes W1, W2"),
    (["--workloads", "W9"], "no workload 'W9': one of W1, W1f, W2, W3, W4, G1, or L<tokens>"),
    (["--workloads", "L12"], "no workload 'L12'")])
def test_an_unknown_workload_is_one_line_before_anything_starts(tmp_path, argv: list[str], says: str) -> None:
    # (no server listens on port 1: a name checked only later would fail on the connection instead)
    with pytest.raises(SystemExit, match=f"^teacher-server bench: --workloads: {says}"):
        bench_main(["--url", "http://127.0.0.1:1", *argv, "--out", str(tmp_path)])


def test_a_failed_request_is_one_line(tmp_path, monkeypatch) -> None:
    from teacher_server.benchmark import command
    from teacher_server.client import TeacherServerError

    def refused(*a: object, **k: object) -> dict:
        raise TeacherServerError("queue too long", status=429, type="RateLimitError", attempts=6)

    monkeypatch.setattr(command, "_run", refused)
    with pytest.raises(SystemExit, match="^teacher-server bench: a request failed: .*queue too long.*--tiny"):
        bench_main(["--url", "http://127.0.0.1:1", "--out", str(tmp_path)])


@no_gpu
def test_a_full_size_shape_is_refused_without_a_gpu(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no GPU here.*--tiny"):
        bench_main(["--shape", "qwen3-8b", "--out", str(tmp_path)])


@no_gpu
def test_make_bench_engine_does_not_write_a_giant_checkpoint_on_cpu(tmp_path) -> None:
    from workloads import QWEN3_8B, write_random_checkpoint

    with pytest.raises(SystemExit, match=r"no GPU here: not writing a 16\.4 GB"):
        write_random_checkpoint(tmp_path / "8b", QWEN3_8B)
    assert not (tmp_path / "8b").exists()


def test_a_stopped_checkpoint_write_leaves_no_partial_shard(tmp_path, monkeypatch) -> None:
    import safetensors.torch
    from workloads import QWEN3_8B, tiny, write_random_checkpoint

    def stopped(tensors, filename, metadata=None):  # as if Ctrl-C came mid-write
        Path(filename).write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_random_checkpoint(tmp_path / "t", tiny(QWEN3_8B))
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["config.json"]


def test_progress_bar_and_png() -> None:
    import io

    out = io.StringIO()
    bar = ProgressBar("W1", 4, stream=out, width=8, always=True)
    for _ in range(4):
        bar.update()
    bar.close()
    assert "W1 [########] 4/4" in out.getvalue()
    assert {*"0123456789.,/%-:()"} <= set(FONT)
    png = bar_chart_png([Panel("tokens/s", ["W1"], [("a", [1.0]), ("b", [None])])])
    assert png[12:16] == b"IHDR"
