"""ops.top_k: the teacher's top-K over the vocabulary. The Triton path must equal torch.topk
(values, and ids that point at them, distinct) on every row, including the rows its bound
does not narrow (all ties, fewer finite values than k, a run of ties above the rest: the
bisection) and NaN. CPU: the kernel in Triton's interpreter where triton is installed; GPU:
the compiled kernel at the vocabulary of Qwen3 and the engine's chunk size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from teacher_server.ops import top_k as tk


def hard_rows(rows: int, vocab: int, k: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=device) * 4
    x[1] = 1.5  # every element tied
    x[2] = float("-inf")
    few = torch.arange(5, vocab, max(1, vocab // max(1, k // 2)), device=device)  # fewer finite than k
    x[2, few] = torch.randn(len(few), generator=g, device=device)
    x[3, : 4 * tk.cap_for(k)] = 100.0  # more ties above the rest than the slots
    x[4, 7] = float("nan")  # torch.topk ranks NaN first
    x[5, -3:] = 50.0  # the largest in the columns after the last whole group
    return x


def same_as_torch(x: torch.Tensor, k: int, vals: torch.Tensor, ids: torch.Tensor) -> None:
    ref = x.topk(k, dim=-1).values
    assert torch.equal(vals.nan_to_num(-7.0), ref.nan_to_num(-7.0))
    assert torch.equal(x.gather(1, ids).nan_to_num(-7.0), vals.nan_to_num(-7.0))
    assert ids.dtype == torch.int64 and bool((ids.sort(dim=-1).values.diff(dim=-1) != 0).all())


def test_slots_and_the_fallback_on_cpu() -> None:
    assert [tk.cap_for(k) for k in (1, 64, 65, 128, 129, 256)] == [128, 128, 256, 256, 512, 512]
    x = hard_rows(6, 9000, 20, torch.device("cpu"))
    assert not tk.usable(x, 20)  # CPU: torch.topk
    v, i = tk.top_k(x, 20)
    same_as_torch(x, 20, v, i)
    tk.prepare(9000, torch.device("cpu"))  # nothing to compile off CUDA
    assert not tk._CHECKED


_INTERPRETED = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_top_k import hard_rows, same_as_torch
from teacher_server.ops import top_k as tk
for k in (1, 20, 64, 200):
    x = hard_rows(7, 8 * tk.GROUPS + 37, k, torch.device("cpu"), seed=k)
    same_as_torch(x, k, *tk.top_k_triton(x, k))
print("ok")
"""


def test_kernel_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETED.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 20, 64, 100, 256])
def test_kernel_on_the_gpu(k: int) -> None:
    dev = torch.device("cuda")
    tk.check_top_k(151936, k, dev)
    x = hard_rows(4096, 151936, k, dev, seed=k)
    assert tk.usable(x, k)
    same_as_torch(x, k, *tk.top_k(x, k))
    # a shard's columns (a strided view of a wider chunk, as under tensor parallel) and a row subset
    y = hard_rows(64, 2 * 75968, k, dev)[:, :75968]
    same_as_torch(y, k, *tk.top_k(y, k))
    assert tk._CHECKED[(151936, tk.cap_for(k), str(x.device))]  # the kernel took it
