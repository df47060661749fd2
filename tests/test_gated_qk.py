"""Qwen3.5's gated attention input stage in one Triton pass (``ops.gated_qk``) against the eager
stage it replaces (``partial_rope.gated_qk_prep``): q and k normed and partly rotated, v copied,
into buffers with slack rows; float32 and zero-centred (float32) or model-dtype norm weights;
rotary on part of the head, all of it, or one pair. Without a GPU the kernel runs in Triton's
interpreter (a subprocess: the interpreter is chosen when the kernels are defined); the layer's
use of it through the public ``LLM`` too. On CUDA: the Qwen3.5-9B heads, and the warm-up's pick."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from triton_interp import interpreted

from teacher_server.ops.partial_rope import gated_qk_prep
from teacher_server.ops.qkv_rope import HeadLayout


def errors(n: int, heads: HeadLayout, r: int, dtype: torch.dtype, weight_dtype: torch.dtype,
           device: torch.device) -> dict[str, float]:
    """Per output, max |kernel - eager| over the eager output's max |value|."""
    from teacher_server.ops import gated_qk

    g = torch.Generator(device="cpu").manual_seed(n + r)
    n_q, n_kv, d = heads.n_q, heads.n_kv, heads.d
    qkv = (3 * torch.randn(n, (2 * n_q + 2 * n_kv) * d, generator=g)).to(device, dtype)
    ang = torch.randn(n, r // 2, generator=g)
    cs = torch.cat([ang.cos(), ang.sin()], 1).to(device)
    qn, kn = ((1 + 0.3 * torch.randn(d, generator=g)).to(device, weight_dtype) for _ in range(2))
    outs = []
    for stage in (gated_qk.gated_qk, gated_qk_prep):
        bufs = gated_qk._buffers(qkv, n, heads)
        outs.append((*bufs, stage(qkv, cs, qn, kn, n_q, n_kv, d, heads.eps, *bufs)))
    res = {}
    for name, got, ref in zip(("q", "k", "v", "gate"), *outs):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        res[name] = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    return res


_INTERPRETED = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_gated_qk import errors
from teacher_server.ops import gated_qk, partial_rope
from teacher_server.ops.qkv_rope import HeadLayout
cpu = torch.device("cpu")
res = {{}}
for dtype in (torch.float32, torch.bfloat16):
    for wd in (torch.float32, dtype):
        for r in (8, 32, 2):
            for n in (1, 19):
                res[f"{{dtype}} {{wd}} r{{r}} n{{n}}"] = errors(n, HeadLayout(4, 2, 32, 1e-6), r, dtype, wd, cpu)
# the start-up check passes, and refuses a kernel that rotates the wrong way
ang = torch.randn(64, 4)
heads, table = HeadLayout(4, 2, 32, 1e-6), torch.cat([ang.cos(), ang.sin()], 1)
w = torch.ones(32)
gated_qk.check(heads, w, w, table, cpu, torch.float32, counts=(3, 17))  # (bf16: the interpreter truncates)
wrong = lambda qkv, cs, *a: partial_rope.gated_qk_prep(qkv, torch.cat([cs[:, :4], -cs[:, 4:]], 1), *a)
gated_qk.gated_qk_prep = wrong
try:
    gated_qk.check(heads, w, w, table, cpu, torch.float32, counts=(3,))
    refused = False
except RuntimeError:
    refused = True
print(json.dumps({{"errors": res, "refused": refused}}))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    """Every output within rounding of the eager stage: float32 alike to float32 sums in another
    order; bf16 within two rounding steps of the output (the interpreter's float32 -> bf16 casts
    truncate, a step of 2^-7 relative each, where torch rounds to nearest: the GPU test holds
    the kernel to 2^-7); v and the gate exact (a copy, a view). A kernel that rotates the wrong
    way fails the start-up check."""
    res = json.loads(interpreted(_INTERPRETED.format(tests=str(Path(__file__).parent))))
    assert res["refused"]
    for case, errs in res["errors"].items():
        tol = 1e-5 if case.startswith("torch.float32 torch.float32") else 2 ** -6
        assert errs["q"] <= tol and errs["k"] <= tol, (case, errs)
        assert errs["v"] == 0.0 and errs["gate"] == 0.0, (case, errs)


_ENGINE = """
import sys, numpy as np, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from teacher_server.ops import gated_qk
from test_gated_delta import group_scores_with_switch, make_qwen3_5

calls = []
kernel = gated_qk.gated_qk
gated_qk.gated_qk = lambda *a, **k: (calls.append(a[0].shape[0]), kernel(*a, **k))[1]
out, _ = group_scores_with_switch(make_qwen3_5(Path({tmp!r}) / "m", seed=4), "gated_qk_kernel")
err = max(float(np.abs(a - b).max()) for a, b in zip(out[False], out[True]))
print(len(calls), err)
"""


def test_the_layer_with_the_kernel_in_the_triton_interpreter(tmp_path: Path) -> None:
    """Qwen3.5's attention layers through the public ``LLM`` on the CPU with the kernel forced on
    (Triton's interpreter): a group of sequences over several 32-token steps scores as with the
    eager stage within 1e-4 in float32, and the kernel ran."""
    pytest.importorskip("transformers")
    calls, err = interpreted(_ENGINE.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)), 900).split()
    assert int(calls) > 0, calls
    assert float(err) < 1e-4, err


def test_the_pick_stays_off_on_the_cpu() -> None:
    """The warm-up decides on CUDA only: on the CPU the switch stays off, the eager stage runs."""
    from teacher_server.ops.fused import FusedOps

    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    asked = []
    ops.pick_gated_qk(lambda: asked.append(1) or True, torch.device("cpu"))
    assert not ops.gated_qk_kernel and not asked
    off = FusedOps(kernels=False, compile=False)
    off.pick_gated_qk(lambda: True, torch.device("cuda"))
    assert not off.gated_qk_kernel  # no kernels asked for: never on


@pytest.mark.gpu
@pytest.mark.parametrize(("n_q", "n_kv"), [(16, 4), (8, 2), (16, 2)])  # Qwen3.5-9B, its TP2 shard, the 35B-A3B
def test_kernel_on_cuda_at_qwen35_heads(n_q: int, n_kv: int) -> None:
    """Head dim 256 with 64 rotary dims, bf16 with zero-centred float32 norm weights: within one
    rounding step of the eager stage, v and the gate exact; the warm-up's pick runs (it times
    the kernel against the compiled stage) and says which is faster."""
    from teacher_server.ops import gated_qk

    dev = torch.device("cuda")
    heads = HeadLayout(n_q, n_kv, 256, 1e-6)
    for n in (1, 777, 16384):
        errs = errors(n, heads, 64, torch.bfloat16, torch.float32, dev)
        assert errs["q"] <= 2 ** -7 and errs["k"] <= 2 ** -7 and errs["v"] == 0.0 and errs["gate"] == 0.0, (n, errs)
    ang = torch.randn(4096, 32)
    table = torch.cat([ang.cos(), ang.sin()], 1).to(dev)
    w = (1 + 0.1 * torch.randn(256)).to(dev)
    stage = torch.compile(gated_qk_prep, dynamic=True, fullgraph=True)
    print("kernel faster than the compiled stage:", gated_qk.pick(stage, heads, w, w, table, dev, torch.bfloat16))
