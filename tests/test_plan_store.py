"""The cuDNN plan store's bookkeeping: a graph's saved bytes come back under the same key and
versions only, a failed load forgets the file, an unwritable directory costs the saving only."""

from __future__ import annotations

import logging

import pytest

from teacher_server.attention.plan_store import PlanStore, store_from_env

KEY = (False, 4, 1024, 1024, 32, 8, 128, "torch.bfloat16", 128 ** -0.5, (4096, 128, 1), (1024, 128, 1))
VERSIONS = {"gpu": "NVIDIA H200", "cc": "9.0", "driver": "13000", "cudnn": "91600", "frontend": "1.32.0",
            "torch": "2.11.0", "cuda": "13.0"}


def test_a_saved_graph_comes_back_under_its_key_and_versions_only(tmp_path) -> None:
    store = PlanStore(tmp_path / "cudnn_fe", VERSIONS)
    assert store.load(KEY) is None
    store.save(KEY, b"\x00plan\xff")
    assert store.load(KEY) == b"\x00plan\xff" and store.saved == 1
    assert PlanStore(tmp_path / "cudnn_fe", dict(reversed(VERSIONS.items()))).load(KEY) == b"\x00plan\xff"
    assert store.load((True, *KEY[1:])) is None  # another graph
    for name in VERSIONS:  # another GPU, driver, cuDNN, frontend, torch or CUDA: never read
        other = PlanStore(tmp_path / "cudnn_fe", {**VERSIONS, name: VERSIONS[name] + "x"})
        assert other.load(KEY) is None, name
    assert not list((tmp_path / "cudnn_fe").glob("*.tmp"))  # written whole, then renamed
    store.drop(KEY)
    assert store.load(KEY) is None
    store.drop(KEY)  # (twice: nothing to forget)


def test_an_unwritable_directory_warns_once_and_keeps_nothing(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = PlanStore(blocker / "cudnn_fe", VERSIONS)
    with caplog.at_level(logging.WARNING):
        store.save(KEY, b"plan")
        store.save(KEY, b"plan")
    assert caplog.text.count("not kept") == 1 and store.load(KEY) is None and store.saved == 0


def test_no_store_without_the_compile_cache(monkeypatch) -> None:
    monkeypatch.delenv("TEACHER_SERVER_PLAN_DIR", raising=False)
    assert store_from_env("cuda:0") is None


@pytest.mark.gpu
def test_a_restart_reads_back_real_cudnn_plans(tmp_path) -> None:
    """With cuDNN's frontend on the GPU: a backend's check builds and keeps its graphs; a second
    backend (a restart) reads every one back, passes the check on them, and a step gives the
    same output bit for bit. Prints what a build and a load take."""
    import time

    import torch
    from attn_util import make_step

    from teacher_server.attention.cudnn_fe import CudnnFrontendBackend
    from teacher_server.attention.cudnn_fe_check import checked
    from teacher_server.attention.plan_store import plan_versions

    pytest.importorskip("cudnn")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    versions = plan_versions(dev)
    lens = [(700, 2100), (300, 800), (1300, 1300), (512, 512), (40, 40)]
    outs, secs = [], []
    for i in range(2):
        attn = CudnnFrontendBackend(plans=PlanStore(tmp_path, versions))
        t = time.perf_counter()
        assert checked(attn, dev, torch.bfloat16)
        x, ctx, _ = make_step(lens, 32, 8, 128, "cuda", torch.bfloat16)
        outs.append(attn(x, ctx, 128 ** -0.5, None))
        torch.cuda.synchronize()
        secs.append((time.perf_counter() - t) / len(attn._graphs))
        assert attn.enabled and attn.plans is not None
        if i == 0:
            assert not attn.loaded and attn.plans.saved == len(attn._graphs) > 0
        else:
            assert len(attn.loaded) == len(attn._graphs) and attn.plans.saved == 0
    assert torch.equal(outs[0], outs[1])
    print(f"per graph: built {1e3 * secs[0]:.0f} ms, read back {1e3 * secs[1]:.0f} ms; "
          f"{sum(f.stat().st_size for f in tmp_path.glob('*.plan')) / 1e3:.0f} kB in {len(list(tmp_path.glob('*.plan')))} files")


def test_the_graphs_code_digest_is_the_same_in_another_process() -> None:
    """The store names a graph by the code that makes it: the same in every process (a digest
    with an address in it would never read a plan back), another for other code."""
    import subprocess
    import sys

    from teacher_server.attention.cudnn_fe import CudnnFrontendBackend
    from teacher_server.attention.plan_store import code_digest

    here = code_digest(CudnnFrontendBackend._graph.__code__)
    code = ("from teacher_server.attention.cudnn_fe import CudnnFrontendBackend; from teacher_server.attention.plan_store import code_digest; "
            "print(code_digest(CudnnFrontendBackend._graph.__code__))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    assert here == there and here != code_digest(CudnnFrontendBackend._build.__code__)
