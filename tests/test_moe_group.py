"""The expert rows' grouping by counting (``ops.moe_group``) against the stable sort it
replaces, bit for bit: every output (rows' experts, tokens, row ends, each slot's row) at
routings of one slot, part blocks, many blocks, one expert taking every slot, an
expert-parallel rank's extra bucket, and the expert layer's output with the switch on. Without
a GPU the kernels run in Triton's interpreter where triton is installed (a subprocess: the
interpreter is chosen when the kernels are defined); on the GPU, at model routings, and the
warm-up's pick."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from teacher_server.ops import moe_group

_INTERPRETED = """
import json, sys, torch
sys.path.insert(0, "tests")
from teacher_server.ops import moe_group as g
from test_moe import bound_moe
res = {}
for buckets, k in ((1, 1), (8, 2), (64, 6), (257, 8), (512, 10)):
    res[f"check {buckets} top-{k}"] = g.check(buckets, k, torch.device("cpu"))
# an expert-parallel rank's routing: its 3 experts and the others' bucket (3), which sorts last
flat = torch.tensor([3, 0, 3, 2, 2, 1, 3, 0, 3, 3] * 13, dtype=torch.int64)
got, want = g.group_kernels(flat, 4, 2), g.group_torch(flat, 4, 2)
res["expert parallel"] = all(torch.equal(a, b) for a, b in zip(got, want))
# the layer: the same output through the kernels' grouping, bit for bit
moe = bound_moe(shared=40)
h = torch.randn(77, 32)
plain = moe(h)
moe.rt.ops.group_kernel = True
res["layer"] = torch.equal(moe(h), plain)
print(json.dumps(res))
"""


def test_kernels_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res and all(v is True for v in res.values()), res


def test_the_sorts_grouping_is_the_layers_rows() -> None:
    """``group_torch``: rows by expert, each expert's slots in slot order, the row ends, each
    slot's row and token (slot // k)."""
    flat = torch.tensor([2, 0, 2, 1, 0, 2], dtype=torch.int64)  # 3 tokens, top-2
    keys, tokens, ends, pos = moe_group.group_torch(flat, 3, 2)
    assert keys.tolist() == [0, 0, 1, 2, 2, 2]
    assert tokens.tolist() == [0, 2, 1, 0, 1, 2] and ends.tolist() == [2, 3, 6] and ends.dtype == torch.int32
    assert pos.tolist() == [3, 0, 4, 2, 1, 5]
    assert all(int(keys[p]) == int(e) for p, e in zip(pos, flat))


def test_the_layer_groups_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert layer hands its switch to the grouping; the kernels' stand-in (the sort)
    gives the same output."""
    from test_moe import bound_moe

    moe = bound_moe(shared=0)
    h = torch.randn(29, 32)
    plain = moe(h)
    calls = []

    def stand_in(flat: torch.Tensor, buckets: int, k: int) -> moe_group.Grouped:
        calls.append((flat.shape[0], buckets, k))
        return moe_group.group_torch(flat, buckets, k)

    monkeypatch.setattr(moe_group, "group_kernels", stand_in)
    moe(h)
    assert calls == []
    moe.rt.ops.group_kernel = True
    assert torch.equal(moe(h), plain)
    assert calls == [(29 * 4, 16, 4)]


def test_the_warm_up_picks_the_grouping_for_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pick_gate_up`` asks for the grouping at the layer's expert count and top-k; on the CPU
    it stays off."""
    from test_moe import bound_moe

    from teacher_server.models import moe as moe_models
    from teacher_server.ops.fused import FusedOps

    moe = bound_moe(shared=0)
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    seen = []
    monkeypatch.setattr(moe_group, "pick", lambda b, k, dev: seen.append((b, k, dev.type)) or True)
    monkeypatch.setattr(ops, "pick_moe_gate_up", lambda *a: None)
    monkeypatch.setattr(ops, "check_router", lambda *a: None)
    moe_models.pick_gate_up(ops, moe, torch.float32)
    assert not ops.group_kernel and seen == []  # CPU: not asked
    monkeypatch.setattr(FusedOps, "decide", lambda self, switch, name, decide, dev: setattr(self, switch, decide()))
    moe_models.pick_gate_up(ops, moe, torch.float32)
    assert ops.group_kernel and seen == [(16, 4, "cpu")]
    # an expert-parallel rank (8 of the 16 experts): its experts and the others' bucket
    from types import SimpleNamespace

    rank = SimpleNamespace(gate=moe.gate, top_k=4, experts=SimpleNamespace(num_local=8, ep=SimpleNamespace(size=2)))
    moe_models.pick_gate_up(ops, rank, torch.float32)
    assert seen[-1] == (9, 4, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("buckets", "k"), [(64, 6), (256, 8), (257, 8), (512, 10), (128, 8), (32, 4)])
def test_gpu_grouping_matches_the_sort_at_model_routings(buckets: int, k: int) -> None:
    dev = torch.device("cuda")
    assert moe_group.check(buckets, k, dev)
    print(f"{buckets} experts, top-{k}: kernels faster than the sort:", moe_group.pick(buckets, k, dev))
