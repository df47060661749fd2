"""bench/bench_fp8.py runs on the CPU at tiny shapes (its smoke mode) and writes every case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_run_writes_every_case(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_fp8.py"), "--tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    dense, moe = res["models"]["tiny"], res["models"]["tiny_moe"]
    assert set(dense["cases"]) == {"bf16_gemm", "bf16_layer"} | {f"fp8_{m}_{k}" for m in ("tensor", "row", "block")
                                                                 for k in ("gemm", "separate", "fused")}
    assert set(moe["cases"]) == {"bf16_gemm", "bf16_layer"} | {f"fp8_{m}_{k}" for m in ("row", "block")
                                                               for k in ("gemm", "separate", "fused")}
    assert set(moe["rel_rms_error_vs_bf16"]) == {"row", "block"}
    for mode, err in dense["rel_rms_error_vs_bf16"].items():  # FP8 on both operands: a few percent
        assert 0 < err < 0.1, (mode, err)
    assert all(c["speedup"] > 0 and c["ms"] > 0 for c in dense["cases"].values())
    assert all(r["gb_per_s"] > 0 for r in res["quant_kernels"].values())


def test_e2e_bench_gives_the_http_runner_every_argument_it_reads() -> None:
    """bench_fp8_e2e.py hands bench_engine's HTTP runner a namespace of its own: every
    ``args.<name>`` that ``bench_http`` and ``server_args`` read is in it (a name added there
    and not here failed every variant of the device run), and the server's arguments build."""
    import argparse
    import inspect
    import re

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_engine
    import bench_fp8_e2e

    ns = bench_fp8_e2e.http_namespace(argparse.Namespace(budget=None, repeats=1, concurrency=8, max_model_len=8192))
    read = set()
    for fn in (bench_engine.bench_http, bench_engine.server_args):
        read |= set(re.findall(r"\bargs\.([a-z_]+)", inspect.getsource(fn)))
    assert read and read <= set(vars(ns)), sorted(read - set(vars(ns)))
    argv = bench_engine.server_args(Path("/m"), ns, 8000, None, ["--quantization", "fp8"], "k")
    assert argv[:2] == ["--model", "/m"] and "--pipeline-parallel-size" not in argv


def test_the_e2e_variants_are_server_arguments_the_cli_takes(tmp_path: Path) -> None:
    """Each bench_fp8_e2e variant's server arguments parse (``row_promoted``: the row-wise
    products without fast accumulation), and the block variant's config is a block-wise FP8 one."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_fp8_e2e

    from teacher_server.cli import build_parser
    from teacher_server.config import Config

    dirs = bench_fp8_e2e.model_dirs(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}, "m")
    assert set(dirs) == {"bf16", "row", "block", "row_promoted"}
    for name, (path, extra) in dirs.items():
        args = vars(build_parser().parse_args(["serve", str(path), *extra]))
        assert (args.get("fp8_fast_accum") is False) == (name == "row_promoted"), (name, args.get("fp8_fast_accum"))
    assert Config.model_fields["fp8_fast_accum"].default is True
    block = json.loads((dirs["block"][0] / "config.json").read_text())["quantization_config"]
    assert block["weight_block_size"] == [128, 128] and block["quant_method"] == "fp8"


def test_the_engine_bench_serves_a_block_fp8_checkpoint_of_a_shape(tmp_path: Path) -> None:
    """``bench_engine.py --fp8-block``: the shape as a block-wise FP8 checkpoint (DeepSeek-V3's
    release format; tiny: 16 x 16 blocks), dummy weights, scored on the CPU; no baseline."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_engine.py"), "--model-size", "deepseek-v3-layers", "--tiny",
           "--fp8-block", "--workloads", "W1:tiny", "--repeats", "1", "--max-model-len", "1024",
           "--ckpt-dir", str(tmp_path), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert "block-wise FP8" in res["model"] and res["engine"]["W1:tiny"]["tokens_per_s"] > 0
    written = json.loads(next(tmp_path.glob("*-fp8-block/config.json")).read_text())
    assert written["quantization_config"]["weight_block_size"] == [16, 16]
    r = subprocess.run(cmd + ["--baseline", "W1:tiny"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode != 0 and "no baseline" in r.stderr


def test_the_silu_and_fast_accumulation_benches_run_on_the_cpu(tmp_path: Path) -> None:
    """bench_fp8_silu.py and probe_fast_accum.py in their smoke modes: every case written, the
    SiLU-mul cases equal to the reference (an error would be written instead of a time), and a
    1% scale error moving the slope by about 1%."""
    for script, out in (("bench_fp8_silu.py", tmp_path / "silu.json"), ("probe_fast_accum.py", tmp_path / "p.json")):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", "--out", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
    cases = json.loads((tmp_path / "silu.json").read_text())["widths"]["tiny"]["cases"]
    assert len(cases) == 3 and all("ms" in c for c in cases.values()), cases
    probe = json.loads((tmp_path / "p.json").read_text())["cases"]
    assert len(probe) == 8
    assert all(abs(c["slope"] - (0.01 if c["scale"] > 1 else 0)) < 1e-3 for c in probe), probe


def test_transformers_fp8_kernel_from_a_source_folder(tmp_path: Path) -> None:
    """bench/hf_fp8_kernel.py: a finegrained-fp8 kernel folder (its ops registered through the
    ``_ops`` module its build would write, made in memory) becomes the kernel transformers' FP8
    integration loads, as the hub's download would; a folder lacking an entry point is refused."""
    import torch
    from transformers.integrations import finegrained_fp8 as tf_fp8
    from transformers.integrations import hub_kernels

    sys.path.insert(0, str(ROOT / "bench"))
    import hf_fp8_kernel

    pkg = tmp_path / "finegrained-fp8" / "torch-ext" / "finegrained_fp8"
    pkg.mkdir(parents=True)
    (tmp_path / "finegrained-fp8" / "build.toml").write_text('[general]\nname = "finegrained-fp8"\nversion = 4\n')
    (pkg / "mm.py").write_text(
        "import torch\nfrom torch.library import custom_op\nfrom ._ops import add_op_namespace_prefix, ops\n\n"
        "@custom_op(add_op_namespace_prefix('twice'), mutates_args=())\n"
        "def _twice(x: torch.Tensor) -> torch.Tensor:\n    return 2 * x\n\n"
        "def matmul_2d(a, b, *rest, **kw):\n    return ops.twice(a @ b.T)\n")
    (pkg / "__init__.py").write_text("from .mm import matmul_2d\nmatmul_batched = matmul_grouped = matmul_2d\n")
    saved = (dict(hub_kernels._KERNEL_MODULE_MAPPING), tf_fp8.is_kernels_available, tf_fp8._FINEGRAINED_FP8)
    try:
        info = hf_fp8_kernel.install(pkg)
        assert info["kernel_version"] == 4 and info["path"] == str(pkg.resolve())
        kernel = tf_fp8.load_finegrained_fp8_kernel()  # transformers' own loader
        a, b = torch.randn(3, 4), torch.randn(5, 4)
        torch.testing.assert_close(kernel.matmul(a, b), 2 * a @ b.T)
    finally:
        hub_kernels._KERNEL_MODULE_MAPPING.clear()
        hub_kernels._KERNEL_MODULE_MAPPING.update(saved[0])
        tf_fp8.is_kernels_available, tf_fp8._FINEGRAINED_FP8 = saved[1], saved[2]
        hf_fp8_kernel.unload()
    bad = tmp_path / "bad" / "finegrained_fp8"
    bad.mkdir(parents=True)
    (bad / "__init__.py").write_text("def matmul_2d(*a):\n    pass\n")
    try:
        with pytest.raises(ImportError, match="matmul_batched, matmul_grouped"):
            hf_fp8_kernel.install(bad)
    finally:
        hf_fp8_kernel.unload()
