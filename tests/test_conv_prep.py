"""The Gated DeltaNet layers' fused input stage (``ops.conv_prep``: causal convolution + SiLU,
q/k L2 norms, contiguous q/k/v, gates in one Triton pass) against the two passes it replaces
(the torch convolution then ``linear_prep``): sequences shorter than the kernel, sequences
starting from stored states, strided inputs as the in-projection leaves them; on CUDA also
against fla-core's convolution + the compiled stage, at the Qwen3.5-9B layer's shapes. Without
a GPU the kernel runs in Triton's interpreter where triton is installed (a subprocess: the
interpreter is chosen when the kernels are defined)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interp import interpreted

from teacher_server.ops.conv_prep import conv_prep, conv_prep_reference, random_inputs
from teacher_server.ops.gated_delta import bounds_of, causal_conv1d, make_plan, seq_of_tokens

NAMES = ("q", "k", "v", "beta", "g", "end")


def compare(lens: list[int], nk: int, dk: int, nv: int, dv: int, w: int, dtype: torch.dtype, device: torch.device,
            init: bool) -> dict[str, float]:
    """Per output: max abs difference, kernel against the torch reference, over the
    reference's max abs value."""
    x, weight, initial, b, a, a_log, dt_bias = random_inputs(lens, nk, dk, nv, dv, w, dtype, device, init)
    plan = make_plan(lens, torch.tensor(bounds_of(lens), device=device), init, True)
    got = conv_prep(x, weight, plan, initial, True, b, a, a_log, dt_bias, nk, dk, nv, dv)
    ref = conv_prep_reference(x, weight, bounds_of(lens), initial, True, b, a, a_log, dt_bias, nk, dk, nv, dv)
    out = {}
    for name, g, r in zip(NAMES, got, ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype, r.dtype)
        if name in "qkv":
            assert g.is_contiguous(), name
        out[name] = (g.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-6)
    return out


def tolerance(dtype: torch.dtype) -> float:
    """Relative to an output's largest value: float32, the same sums in another order; bf16,
    two rounding steps (2^-8 relative each: the convolution's output, then q and k after their
    norm) where float32 sums in another order round differently."""
    return 1e-5 if dtype == torch.float32 else 2 ** -6


def test_seq_of_tokens() -> None:
    cu = torch.tensor([0, 3, 4, 4, 9])
    assert seq_of_tokens(cu, 9).tolist() == [0, 0, 0, 1, 3, 3, 3, 3, 3]


_INTERPRETED = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_conv_prep import compare
res = {{}}
for dtype in (torch.float32, torch.bfloat16):
    for init in (False, True):
        res[f"{{dtype}}-{{init}}"] = compare([9, 1, 2, 3, 40, 0, 5], 2, 16, 4, 8, 4, dtype, torch.device("cpu"), init)
print(json.dumps(res))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    """The kernel's logic on the CPU: varlen sequences (one empty, some shorter than the kernel)
    with and without stored states, in float32 (same sums: exact to rounding) and bf16 (one
    rounding steps apart at most)."""
    import json

    res = json.loads(interpreted(_INTERPRETED.format(tests=str(Path(__file__).parent))))
    for case, errs in res.items():
        tol = tolerance(torch.float32 if "float32" in case else torch.bfloat16)
        assert max(errs.values()) <= tol, (case, errs)
        assert errs["end"] == 0.0, case  # the end state is a copy


_ENGINE = """
import sys, numpy as np, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
import teacher_server.models.gated_delta as layer
from test_gated_delta import group_scores_with_switch, make_qwen3_5

calls = []
fused = layer.conv_prep
layer.conv_prep = lambda *a, **k: (calls.append(a[4] is not None), fused(*a, **k))[1]
out, hits = group_scores_with_switch(make_qwen3_5(Path({tmp!r}) / "m", seed=3), "conv_kernel")
assert min(hits) > 0, hits
err = max(float(np.abs(a - b).max()) for a, b in zip(out[False], out[True]))
print(len(calls), sum(calls), err)
"""


def test_engine_with_the_kernel_in_the_triton_interpreter(tmp_path: Path) -> None:
    """The layer's use of the kernel through the public ``LLM`` on the CPU (the kernel forced on,
    run by Triton's interpreter): a GRPO-like group at a 32-token step budget (sequences in
    several chunks, the later ones starting from the prompt's cached snapshot) scores as with
    the two-pass path within 1e-4 in float32 (the bound the CPU tests hold against transformers;
    a lost state is off by nats), and the kernel ran, also from stored states."""
    pytest.importorskip("transformers")
    calls, from_states, err = interpreted(_ENGINE.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)),
                                          900).split()
    assert int(calls) > 0 and int(from_states) > 0, (calls, from_states)
    assert float(err) < 1e-4, err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("init", [False, True])
def test_kernel_on_cuda(dtype: torch.dtype, init: bool) -> None:
    """At the Qwen3.5-9B layer's shapes (16 key heads, 32 value heads of 128, kernel 4) over a
    varlen step: against the torch reference, and in bf16 against fla-core's convolution + the
    compiled stage, the path it replaces (TF32 nowhere: no products but the taps'), no further
    from it than two rounding steps."""
    dev = torch.device("cuda")
    lens = [1000, 1, 3, 257, 64, 2048]
    errs = compare(lens, 16, 128, 32, 128, 4, dtype, dev, init)
    tol = tolerance(dtype)
    assert max(errs.values()) <= tol and errs["end"] == 0.0, errs
    from teacher_server.ops.fused import FusedOps

    x, weight, initial, b, a, a_log, dt_bias = random_inputs(lens, 16, 128, 32, 128, 4, dtype, dev, init)
    cu = torch.tensor(bounds_of(lens), device=dev)
    plan = make_plan(lens, cu, init, True)
    got = conv_prep(x, weight, plan, initial, True, b, a, a_log, dt_bias, 16, 128, 32, 128)
    y, end = causal_conv1d(x, weight, plan, initial, True)
    two = (*FusedOps(kernels=False, compile=True).linear_prep(y, b, a, a_log, dt_bias, 16, 128, 32, 128), end)
    for name, g, r in zip(NAMES, got, two, strict=True):
        err = (g.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-6)
        assert err <= tol, (name, err)
