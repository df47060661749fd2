"""The FP8 experts' fused gate/up kernel (``ops.fp8_moe``): gather, gate/up product, SiLU-mul
and the down input's 1x128 quantization in one pass, against the passes it replaces and the
float32 definition, with every scale layout (per-row or 1x128 inputs, one static scale;
per-channel or 128x128 weights), empty experts and an expert-parallel rank's rows past its end;
its start-up check, which can fail; and an FP8 expert model scoring through it as through the
passes. Without a GPU the kernel runs in Triton's interpreter (a subprocess), whose float32 ->
bfloat16 and -> e4m3 casts are not round-to-nearest (the kernel rounds on the bits there, and
torch makes its e4m3 codes: ``fp8_moe``'s docstring). On the GPU, at a model's shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_fp8 import engine, fp8_checkpoints, requests  # noqa: F401  (the fixture)
from triton_interp import interpreted

from teacher_server.layers.formats import fp8 as fp8_format
from teacher_server.ops import fp8, fp8_mm, fp8_moe
from teacher_server.ops.guarded import FirstLaunch
from teacher_server.ops.moe_gate_up import _routing

_OPS = """
import json, torch
import torch.nn.functional as F
from teacher_server.ops import fp8, fp8_moe
from teacher_server.ops.guarded import FirstLaunch
from teacher_server.ops.moe_gate_up import _routing

res = {}
g = torch.Generator().manual_seed(0)
def deq(q, s):
    return q.float() * s.float().repeat_interleave(128, 1)
def rel(a, b):  # per 1x128 group, the largest difference over the group's largest value
    m = a.shape[0]
    return float(((a - b).abs().view(m, -1, 128).amax(-1) / b.abs().view(m, -1, 128).amax(-1).clamp_min(1e-6)).max())
for dt, e, k, i, top, t in ((torch.bfloat16, 5, 256, 256, 2, 37), (torch.float16, 3, 128, 384, 3, 20),
                            (torch.bfloat16, 1, 256, 128, 1, 9)):
    w = torch.randn(e, 2 * i, k, generator=g) * k ** -0.5
    h = torch.randn(t, k, generator=g).to(dt)
    tokens, offs = _routing(t, top, e, torch.device("cpu"))
    m = int(offs[-1])
    for xmode in ("row", "group", "static"):
        for wb in (False, True):
            wq, ws = fp8.quantize_weight(w, "block" if wb else "row")
            if xmode == "static":
                xq, xs = fp8.quantize_tensor(h, torch.tensor([0.02]))
            else:
                xq, xs = fp8.quantize_groups(h) if xmode == "group" else fp8.quantize_rows(h)
            kw = dict(x_groups=xmode == "group", w_blocks=wb, dtype=dt)
            q, s = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, wq, ws, **kw)
            q2, s2 = fp8_moe.two_pass(xq, xs, tokens, offs, wq, ws, **kw)
            # the float32 definition on the dequantized operands
            xd = fp8.grouped_scaled_linear_reference(
                xq.view(torch.uint8).index_select(0, tokens).view(xq.dtype),
                xs.reshape(1, 1).expand(t, 1).index_select(0, tokens) if xs.numel() == 1 else xs.index_select(0, tokens),
                wq, ws if wb else ws.reshape(e, -1, 1), offs, "block" if wb else "row", torch.float32)
            ref = F.silu(xd[:, :i]) * xd[:, i:]
            name = f"{e}x{k}x{i} top-{top} x {xmode} w {'block' if wb else 'row'}"
            res[name] = {
                "codes_differ": float((q[:m].view(torch.uint8) != q2[:m].view(torch.uint8)).float().mean()),
                "vs_passes": rel(deq(q[:m], s[:m]), deq(q2[:m], s2[:m])),
                "vs_f32": rel(deq(q[:m], s[:m]), ref[:m]),
                "shape": list(q.shape), "scales": list(s.shape)}
    res[f"check {e}x{k}x{i}"] = fp8_moe.check(wq, ws, top, x_groups=True, w_blocks=True, dtype=dt)
dt = torch.bfloat16
# an expert-parallel rank: 2 experts' rows first, the others' after its last row end
wq, ws = fp8.quantize_weight(torch.randn(2, 256, 128, generator=g) / 11, "row")
xq, xs = fp8.quantize_rows(torch.randn(20, 128, generator=g).to(dt))
tokens = torch.randint(0, 20, (31,), generator=g)
offs = torch.tensor([7, 19], dtype=torch.int32)
q, s = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, wq, ws, x_groups=False, w_blocks=False, dtype=dt)
q2, s2 = fp8_moe.two_pass(xq, xs, tokens, offs, wq, ws, x_groups=False, w_blocks=False, dtype=dt)
res["past the end"] = rel(deq(q[:19], s[:19]), deq(q2[:19], s2[:19]))
# power-of-two group scales (the down input with per-channel weights): the passes' bits, powers of two
qp, sp = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, wq, ws, x_groups=False, w_blocks=False, dtype=dt, pow2=True)
qp2, sp2 = fp8_moe.two_pass(xq, xs, tokens, offs, wq, ws, x_groups=False, w_blocks=False, dtype=dt, pow2=True)
res["pow2"] = [bool(torch.equal(sp[:19], sp2[:19])),
               float((qp[:19].view(torch.uint8) != qp2[:19].view(torch.uint8)).float().mean()),
               bool((torch.frexp(sp[:19])[0] == 0.5).all()), rel(deq(qp[:19], sp[:19]), deq(q[:19], s[:19]))]
res["pow2 check"] = fp8_moe.check(wq, ws, 2, x_groups=False, w_blocks=False, dtype=dt, pow2=True)
res["past the end shape"] = list(q.shape)
# the check fails where the two disagree
real = fp8_moe.two_pass
fp8_moe.two_pass = lambda *a, **kw: (lambda q, s: (q, s * 1.5))(*real(*a, **kw))
try:
    fp8_moe.check(wq, ws, 2, x_groups=False, w_blocks=False, dtype=dt)
    res["check fails"] = False
except RuntimeError as e:
    res["check fails"] = "fused FP8 expert gate/up" in str(e)
print(json.dumps(res))
"""


def test_the_kernel_in_the_triton_interpreter() -> None:
    res = json.loads(interpreted(_OPS))
    cases = [k for k in res if " x " in k]
    assert len(cases) == 18
    for name in cases:
        r = res[name]
        # the passes' codes, bit for bit but for an e4m3 rounding flipped by the exp's last bit (at
        # most a step: 32 / 448 of the group's largest value)
        assert r["codes_differ"] <= 0.01 and r["vs_passes"] <= 0.072, (name, r)
        assert r["vs_f32"] <= 0.08, (name, r)  # half an e4m3 step at the top (1/28) and float16's roundings
        m = r["shape"][0]
        assert r["scales"] == [m, r["shape"][1] // 128], (name, r)
    assert all(res[k] is True for k in res if k.startswith("check "))
    assert res["past the end"] <= 0.072 and res["past the end shape"] == [31, 128]
    # power-of-two scales: the passes' scales and codes, every scale a power of two, the values
    # within an e4m3 step of the other scales' (each rounded once, on another grid)
    same_scales, codes_differ, powers, vs_plain = res["pow2"]
    assert same_scales and codes_differ <= 0.01 and powers and 0 < vs_plain <= 0.13, res["pow2"]
    assert res["pow2 check"] is True
    assert res["check fails"] is True


def test_where_the_kernel_does_not_apply_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widths not whole groups of 128, a float32 model, operands of other dtypes: None (the
    layer takes its passes); the CPU without Triton's interpreter has no kernel either."""
    tokens, offs = _routing(8, 2, 3, torch.device("cpu"))
    x = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    xs = torch.ones(8, 1)
    w = torch.zeros(3, 256, 256, dtype=torch.float8_e4m3fn)
    assert fp8_moe.gate_up_silu_quant(x, xs, tokens, offs, w, torch.ones(3, 256), x_groups=False,
                                      w_blocks=False) is None  # the CPU
    monkeypatch.setattr(fp8_moe, "runs_on", lambda x: True)  # where it runs, the other reasons
    for w in (torch.zeros(3, 2 * 96, 256, dtype=torch.float8_e4m3fn),  # I = 96
              torch.zeros(3, 256, 256, dtype=torch.bfloat16)):
        assert fp8_moe.gate_up_silu_quant(x, xs, tokens, offs, w, torch.ones(3, w.shape[1]), x_groups=False,
                                          w_blocks=False) is None
    w = torch.zeros(3, 256, 256, dtype=torch.float8_e4m3fn)
    assert fp8_moe.gate_up_silu_quant(x, xs, tokens, offs, w, torch.ones(3, 256), x_groups=False, w_blocks=False,
                                      dtype=torch.float32) is None
    assert fp8_moe.gate_up_silu_quant(x[:, :200], xs, tokens, offs, w[..., :200].contiguous(), torch.ones(3, 256),
                                      x_groups=False, w_blocks=False) is None


def test_row_weights_take_1x128_input_groups() -> None:
    """The experts' down product with per-channel weights takes its input in 1x128 groups (what
    the fused kernel and the SiLU-mul pass make for it): each group's scale applied to its own
    columns, as the float32 product of the dequantized operands; a scale of neither shape is
    refused."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(19, 384, generator=g), torch.randn(4, 64, 384, generator=g)
    offs = torch.tensor([5, 5, 12, 19], dtype=torch.int32)
    xq, xs = fp8.quantize_groups(x.bfloat16())
    wq, ws = fp8.quantize_weight(w, "row")
    got = fp8.grouped_scaled_linear(xq, xs, wq, ws, offs, "row")
    want = fp8_mm.grouped_mm_reference(xq.float() * xs.repeat_interleave(128, 1), (wq.float() * ws).transpose(1, 2),
                                       offs)
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="1x128 groups"):
        fp8.grouped_scaled_linear(xq, xs[:, :2], wq, ws, offs, "row")


_REGROUP = """
import json, torch
from teacher_server.ops import fp8, fp8_moe
g = torch.Generator().manual_seed(4)
out = []
for m, i in ((1, 256), (37, 768), (300, 1536), (5, 384)):
    # groups of very different sizes, a zero group and a zero row
    x = torch.randn(m, i, generator=g) * torch.rand(m, i // 128, generator=g).repeat_interleave(128, 1) * 30
    x[0, 128:256] = 0
    x[-1] = 0 if m > 1 else x[-1]
    q, s = fp8.quantize_groups(x.bfloat16())
    srow = s.float().amax(1, keepdim=True)  # the definition: the largest group's scale, codes rescaled
    want = (q.float().view(m, -1, 128) * (s.float() / srow)[..., None]).view(m, i).to(q.dtype)
    gq, gs = fp8_moe.rows_of_groups(q.clone(), s)
    out.append([torch.equal(gq.view(torch.uint8), want.view(torch.uint8)), torch.equal(gs, srow)])
print(json.dumps(out))
"""


def test_rows_of_groups_rescales_each_group_to_its_rows_scale() -> None:
    """The experts' down input with per-channel weights: 1x128 groups -> one scale per row (its
    largest group's) and each group's codes rescaled, rounded once more: the largest group's
    codes unchanged, every value within half an e4m3 step of the row's scale of the group's;
    the Triton kernel (in the interpreter) gives the torch path's bits; a 128-wide input is
    already per row; other shapes are refused."""
    g = torch.Generator().manual_seed(5)
    m, i = 41, 768
    x = torch.randn(m, i, generator=g) * torch.rand(m, i // 128, generator=g).repeat_interleave(128, 1) * 30
    q, s = fp8.quantize_groups(x.bfloat16())
    rq, rs = fp8_moe.rows_of_groups(q, s)
    assert rq.dtype == q.dtype and rq.shape == (m, i) and rs.shape == (m, 1)
    assert torch.equal(rs, s.amax(1, keepdim=True))
    top = s.argmax(1)
    for r in range(m):  # the largest group keeps its codes
        cols = slice(int(top[r]) * 128, int(top[r]) * 128 + 128)
        assert torch.equal(rq[r, cols].view(torch.uint8), q[r, cols].view(torch.uint8))
    grouped = q.float() * s.repeat_interleave(128, 1)
    assert ((rq.float() * rs - grouped).abs() <= 16 * rs).all()  # half the e4m3 step at [256, 448] (32)
    assert not torch.equal(rq.view(torch.uint8), q.view(torch.uint8))  # (the others were rescaled)
    # power-of-two group scales: the codes move by their exponents only, exactly (but below e4m3's
    # normal range, 2^-6 of the row's scale, where a half of its smallest step, 2^-10, bounds them)
    pq, ps = fp8.quantize_groups(x.bfloat16(), pow2=True)
    prq, prs = fp8_moe.rows_of_groups(pq, ps)
    pg, pr = pq.float() * ps.repeat_interleave(128, 1), prq.float() * prs
    normal = pg.abs() >= 2 ** -6 * prs
    assert torch.equal(pr[normal], pg[normal]) and ((pr - pg).abs() <= 2 ** -10 * prs).all()
    assert not normal.all()  # (the bound was needed somewhere)
    q1, s1 = fp8.quantize_groups(x[:, :128].bfloat16())
    same = fp8_moe.rows_of_groups(q1, s1)
    assert same[0] is q1 and same[1].shape == (m, 1) and torch.equal(same[1][:, 0], s1[:, 0])
    with pytest.raises(ValueError, match="1x128 scales"):
        fp8_moe.rows_of_groups(q, s[:, :2])
    assert all(all(r) for r in json.loads(interpreted(_REGROUP)))


def test_rows_of_groups_takes_its_torch_path_where_its_kernel_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose first launch fails (a compile error on this GPU) leaves rows_of_groups to
    its torch path from then on, the same bits; a failure after a success is the call's error."""
    class Fails:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise RuntimeError("no kernel here")
            return launch

    g = torch.Generator().manual_seed(7)
    q, s = fp8.quantize_groups(torch.randn(9, 384, generator=g).bfloat16(), pow2=True)
    want = fp8_moe.rows_of_groups(q, s)
    monkeypatch.setattr(fp8_moe, "runs_on", lambda x: True)
    monkeypatch.setattr(fp8_moe, "_K", {"regroup": Fails()})
    monkeypatch.setattr(fp8_moe, "REGROUP", FirstLaunch("rows_of_groups' kernel"))
    got = fp8_moe.rows_of_groups(q, s)
    assert not fp8_moe.REGROUP.usable() and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])
    monkeypatch.setattr(fp8_moe, "REGROUP", FirstLaunch("rows_of_groups' kernel"))
    fp8_moe.REGROUP.launched.add(None)
    with pytest.raises(RuntimeError, match="no kernel here"):
        fp8_moe.rows_of_groups(q, s)


_MODEL = """
import json, sys, numpy as np, torch
sys.path.insert(0, "tests")
from test_fp8 import engine, requests
from teacher_server.layers.formats import fp8 as fmt
from teacher_server.layers.formats.fp8_dispatch import ExpertInputs
from teacher_server.models.moe import pick_gate_up
from teacher_server.ops.fused import FusedOps
fmt.fp8_compute = lambda device: True  # the FP8 modes on the CPU (their references)
# the warm-up's decision on the FP8 kernel as on the GPU (it skips the CPU); the others as here
real_decide = FusedOps.decide
FusedOps.decide = lambda self, switch, name, decide, device: (
    setattr(self, switch, bool(decide())) if switch == "fp8_moe_kernel" else real_decide(self, switch, name, decide, device))
made = []  # (layer, whether the kernel made its down input)
real = ExpertInputs.fused_gate_up
ExpertInputs.fused_gate_up = lambda self, layer, *a: (lambda r: made.append((id(layer), r is not None)) or r)(
    real(self, layer, *a))
def diff(a, b):  # the largest difference where finite; inf where one is finite and the other not
    if a is None or not a.size:
        return 0.0
    fa, fb = np.isfinite(a), np.isfinite(b)
    return float(np.abs(a[fa] - b[fa]).max()) if (fa == fb).all() else float("inf")
out = {}
for path, online in json.loads(sys.argv[1]):
    kw = dict(dtype="bfloat16", quantization="fp8" if online else None)
    reqs = requests("moe128")
    plain = engine(path, **kw).run_to_completion(reqs)
    on = engine(path, **kw)
    sparse = [layer.mlp for layer in on.model.layers if layer.sparse]
    assert not on.runner.ops.fp8_moe_kernel
    pick_gate_up(on.runner.ops, sparse[0], torch.bfloat16)  # the warm-up checks the first expert layer
    made.clear()
    got = on.run_to_completion(reqs)
    out[path] = {"on": on.runner.ops.fp8_moe_kernel, "layers": len(sparse),
                 "layers_made": len({m for m, r in made if r}), "passes": sum(not r for _, r in made),
                 "errors": [r.error for r in got + plain],
                 "max_diff": max(diff(a.token_id_logprobs, b.token_id_logprobs) for a, b in zip(got, plain)),
                 "same": float(np.mean(np.concatenate([(a.token_id_logprobs == b.token_id_logprobs).ravel()
                                                       for a, b in zip(got, plain) if a.token_id_logprobs.size])))}
print(json.dumps(out))
"""


def test_an_fp8_expert_model_scores_through_the_kernel_as_through_the_passes(fp8_checkpoints,  # noqa: F811
                                                                             monkeypatch) -> None:
    """Block-wise and quantized-at-load (row) experts, three expert layers: the warm-up checks
    the first (``pick_gate_up``, as on the GPU), every expert layer of its shapes then takes the
    kernel, and the scores are the passes' but where a code rounds the other way (in the
    interpreter its exp is numpy's; on the GPU the tensor cores' order of summation)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    fp8_path, twin = fp8_checkpoints("moe128x3", "block", (128, 128))
    paths = [(str(fp8_path), False), (str(twin), True)]  # the bf16 twin, quantized at load
    res = json.loads(interpreted(_MODEL.replace("sys.argv[1]", repr(json.dumps(paths)))))
    for path, r in res.items():
        assert r["on"] and r["layers"] == 3 and r["layers_made"] == 3 and r["passes"] == 0, (path, r)
        assert not any(r["errors"]), (path, r)
        # the same bits but where an exp's last bit (the interpreter's is numpy's, the passes' torch's)
        # rounds a silu, then an e4m3 code, the other way: a few scores move by up to a few 1e-2
        assert r["same"] >= 0.8 and r["max_diff"] <= 0.1, (path, r)


@pytest.mark.parametrize(("family", "pow2"), [("moe256", True), ("moe128", False)])
def test_on_the_cpu_the_layer_keeps_its_passes(fp8_checkpoints, monkeypatch, family: str,  # noqa: F811
                                               pow2: bool) -> None:
    """Off CUDA the warm-up never turns the kernel on, and the experts' down input is the
    SiLU-mul pass's, in 1x128 groups also with per-row weights (quantized at load): with two or
    more groups (I = 256) their scales powers of two, taken per row (``rows_of_groups``) by the
    down product with fast accumulation (its check passes: on the CPU the float32 reference),
    which gives the float32 product of the groups' dequantized rows; with one group (I = 128)
    plain amax / 448 scales, per row already."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    modes, regrouped, downs = [], [], []
    real = fp8.silu_mul_quant
    monkeypatch.setattr(fp8, "silu_mul_quant", lambda gu, mode, *a, **kw: modes.append(mode) or real(gu, mode, *a, **kw))
    real_rg = fp8_moe.rows_of_groups
    monkeypatch.setattr(fp8_moe, "rows_of_groups", lambda q, s: regrouped.append((q, s)) or real_rg(q, s))
    products = []  # (input scales' shape, fast accumulation) of each grouped multiply
    real_mm = fp8.grouped_scaled_linear

    def mm(xq, xs, w, ws, offs, *a, fast_accum=False, **kw):
        products.append((xs.shape[1], fast_accum))
        y = real_mm(xq, xs, w, ws, offs, *a, fast_accum=fast_accum, **kw)
        if fast_accum:
            downs.append((xq, xs, w, ws, offs, y))
        return y

    monkeypatch.setattr(fp8, "grouped_scaled_linear", mm)
    _, twin = fp8_checkpoints(family, "block", (128, 128))
    eng = engine(twin, quantization="fp8")
    assert not eng.runner.ops.fp8_moe_kernel and not eng.runner.ops.moe_gate_up_kernel
    experts = [m for m in eng.model.modules() if getattr(m, "role", None) == "experts"]
    assert experts and all(m.fp8_mode == "row" and m.fp8_down_groups and m.fp8_fast_down for m in experts)
    assert all(m.fp8_down_pow2 == pow2 for m in experts)
    modes.clear()
    products.clear()
    got = eng.run_to_completion(requests("moe128"))
    assert all(r.error is None and not np.isnan(r.token_id_logprobs).any() for r in got)
    assert modes and set(modes) == {"group_pow2" if pow2 else "group"}, modes
    # gate/up per row; down per row (from two groups, or one) with fast accumulation
    assert products and set(products) == {(1, False), (1, True)}, products
    assert bool(regrouped) == pow2 and downs
    assert all((torch.frexp(s)[0] == 0.5).all() for _, s in regrouped)  # the groups' scales powers of two
    for (q, s), (xq, xs, w, ws, offs, y) in zip(regrouped, downs):  # the product of the groups' values
        m = int(offs[-1])
        x, rows = (q.float() * s.repeat_interleave(128, 1))[:m], (xq.float() * xs)[:m]
        normal = x.abs() >= 2 ** -6 * xs[:m]  # exact there; below, within half e4m3's smallest step
        assert torch.equal(rows[normal], x[normal]) and ((rows - x).abs() <= 2 ** -10 * xs[:m]).all()
        want = fp8_mm.grouped_mm_reference(rows, (w.float() * ws).transpose(1, 2), offs)
        torch.testing.assert_close(y[:m].float(), want.bfloat16().float(), rtol=0, atol=0)


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 matrix multiplies (sm89+)")
@pytest.mark.parametrize("block", [False, True])
def test_the_kernel_on_the_gpu_at_an_expert_models_shapes(block: bool) -> None:
    """Qwen3-30B-A3B's expert widths (16 of its 128 experts), bf16: the start-up check passes,
    and on 4,096 tokens routed top-8 the codes are the two passes' but for a few e4m3 roundings."""
    cuda = torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(0)
    w = torch.randn(16, 1536, 2048, device=cuda, generator=g) * 2048 ** -0.5
    wq, ws = fp8.quantize_weight(w, "block" if block else "row")
    ws = ws if block else ws.reshape(16, -1)
    assert fp8_moe.check(wq, ws, 8, x_groups=block, w_blocks=block)
    x = torch.randn(4096, 2048, device=cuda, generator=g).bfloat16()
    xq, xs = fp8.quantize_groups(x) if block else fp8.quantize_rows(x)
    tokens, offs = _routing(4096, 8, 16, cuda)
    m = int(offs[-1])
    for pow2 in (False,) if block else (False, True):  # (per-channel weights: the engine's power-of-two scales)
        q, s = fp8_moe.gate_up_silu_quant(xq, xs, tokens, offs, wq, ws, x_groups=block, w_blocks=block, pow2=pow2)
        q2, s2 = fp8_moe.two_pass(xq, xs, tokens, offs, wq, ws, x_groups=block, w_blocks=block, pow2=pow2)
        assert (q[:m].view(torch.uint8) != q2[:m].view(torch.uint8)).float().mean().item() <= 1e-4
        assert (s[:m] - s2[:m]).abs().max().item() <= 1e-2 * s2[:m].abs().max().item()


def test_the_checks_answer_is_kept_per_shape_and_input_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up checks one expert layer and its answer holds for the layers like it: not for
    a layer of the same shapes whose down input is quantized otherwise (a static scale: another
    engine in the process), whose answer does not overwrite it; a check that raises leaves its
    key off."""
    from types import SimpleNamespace

    from teacher_server.layers.formats import fp8_dispatch
    from teacher_server.layers.formats.fp8 import Fp8Weights
    from teacher_server.layers.formats.fp8_config import Fp8Scheme

    monkeypatch.setattr(fp8_dispatch, "_FUSED", {})
    monkeypatch.setattr(fp8_moe, "check", lambda *a, **kw: True)

    def layer(activations: str) -> SimpleNamespace:
        fmt = Fp8Weights("fp8", Fp8Scheme("channel", activations=activations))
        return SimpleNamespace(fmt=fmt, fp8_mode="row", fp8_down_groups=True, fp8_down_pow2=True, fp8_kernel=False,
                               model_dtype=torch.bfloat16,
                               gate_up=torch.zeros(4, 512, 256, dtype=fp8.FP8), down=torch.zeros(4, 256, 256),
                               gate_up_weight_scale_inv=torch.ones(4, 512, 1))

    dynamic, static = layer("dynamic"), layer("static")
    assert dynamic.fmt.check_fused_gate_up(dynamic, 2) is True
    assert static.fmt.check_fused_gate_up(static, 2) is False
    assert fp8_dispatch._FUSED[fp8_dispatch._fused_key(dynamic)] is True  # still
    other = layer("dynamic")
    tokens, offs = _routing(4, 2, 4, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(fp8_moe, "gate_up_silu_quant", lambda *a, **kw: seen.append(1))
    other.fmt.fused_gate_up(other, torch.zeros(4, 256, dtype=torch.bfloat16), tokens, offs)  # a layer like it: on
    assert seen

    def fails(*a: object, **kw: object) -> bool:
        raise RuntimeError("differs")

    monkeypatch.setattr(fp8_moe, "check", fails)
    with pytest.raises(RuntimeError):
        dynamic.fmt.check_fused_gate_up(dynamic, 2)
    assert fp8_dispatch._FUSED[fp8_dispatch._fused_key(dynamic)] is False


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 matrix multiplies (sm89+)")
def test_rows_of_groups_on_the_gpu_as_on_the_cpu() -> None:
    """The Triton kernel gives the torch path's bits, at Qwen3-30B-A3B's
    and DeepSeek-V3's intermediate widths, in the fused kernel's M-major scale layout."""
    g = torch.Generator().manual_seed(6)
    for m, i in ((1000, 768), (77, 2048), (3, 256)):
        x = torch.randn(m, i, generator=g) * torch.rand(m, i // 128, generator=g).repeat_interleave(128, 1) * 30
        q, s = fp8.quantize_groups(x.bfloat16().cuda())
        want = fp8_moe.rows_of_groups(q.cpu(), s.cpu())
        got = fp8_moe.rows_of_groups(q, s)
        assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].cpu(), want[1])
