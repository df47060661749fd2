"""The packed attention backends' planning (which tokens and keys each call covers), the
cuDNN backend's bucketed padding and prefix split, and the log-sum-exp merge, checked on
the CPU: the cuDNN backend with its device call replaced by float32 math must equal the
sdpa reference for mixed steps."""

from __future__ import annotations

import pytest
import torch
from attn_util import CpuCudnn, make_step, partial, reference

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.buckets import bucket, bucket_floor
from teacher_server.attention.cudnn import CudnnBackend
from teacher_server.attention.cudnn_check import CudnnPaths, self_check
from teacher_server.ops.merge_attn import merge_attn
from teacher_server.ops.slack import slack_rows

CASES = {
    "mixed": [(40, 200), (300, 900), (8, 8), (64, 64), (64, 64), (100, 100), (3, 50)],
    "prefix_split": [(70, 70 + 600), (100, 100 + 64), (30, 30 + 63), (20, 20 + 1000)],
    "fresh_equal": [(64, 64)] * 4,
    "prefixed_only": [(32, 96), (16, 16 + 5)],
    "short_only": [(5, 5), (7, 20), (1, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("min_len", [16, 10_000])
def test_cudnn_plan_matches_reference(case: str, min_len: int) -> None:
    tensors, ctx, order = make_step(CASES[case], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(min_len)
    got = be(tensors, ctx, 0.25, None)
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
    if min_len > 1000:
        assert set(be.calls) == {"varlen"}
    else:
        fresh = [lq for lq, lk in order if lq == lk and lq >= min_len]
        assert all(f"causal{bucket(n)}x{bucket(n)}" in be.calls for n in fresh)


def test_prefix_split_and_padding() -> None:
    """A prefix of 600 keys: a full call over its first 576 (a bucket) with the 300 queries
    padded to 320, then a causal square over the other 24 keys + the 300 queries, padded to
    384; a prefix under 64: one square over prefix + queries (250, padded to 256)."""
    tensors, ctx, _ = make_step([(300, 900), (200, 250)], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(16)
    got = be(tensors, ctx, 0.25, None)
    assert be.calls == ["full320x576", "causal384x384", "causal256x256"], be.calls
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5


# Step order as the runner packs it: three responses after one 600-token prompt (the
# last too short for cuDNN), a lone prefixed sequence, a fresh one.
GROUP = [(300, 900), (280, 880), (100, 700), (200, 1100), (300, 300)]
GROUP_SHARED = [0, 600, 600, 0]


@pytest.mark.parametrize("grouped", [True, False])
def test_prefix_group_takes_one_call_for_all_its_queries(grouped: bool) -> None:
    """Sequences sharing their first 576 keys (the prompt's bucket floor): one full call of
    their 580 queries (padded to 640) against those keys, a causal square each, merged;
    the short one goes to varlen. Without sharing known, one full call per sequence."""
    tensors, ctx, _ = make_step(GROUP, 4, 2, 16, "cpu", torch.float32, shared=GROUP_SHARED if grouped else None)
    be = CpuCudnn(150)
    got = be(tensors, ctx, 0.25, None)
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
    kinds = [type(it).__name__ for it in ctx.attn_plan.items]
    if grouped:
        assert be.calls[:3] == ["full640x576", "causal384x384", "causal320x320"], be.calls
        assert kinds == ["Group", "Varlen", "Prefixed", "Fresh"], kinds
    else:
        assert "full640x576" not in be.calls and be.calls.count("full320x576") == 2, be.calls
        assert "Group" not in kinds


def test_prefix_group_members_need_the_same_prefix_bucket() -> None:
    """A neighbour sharing fewer keys than the bucket floor, or with another floor, is not
    grouped; every result still equals the reference."""
    lens = [(300, 900), (280, 880), (260, 1400), (270, 1400)]
    tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32, shared=[0, 500, 600, 1100])
    be = CpuCudnn(150)
    got = be(tensors, ctx, 0.25, None)
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
    items = ctx.attn_plan.items
    assert [type(it).__name__ for it in items] == ["Prefixed", "Prefixed", "Group"], items
    assert items[2].s == bucket_floor(1130) and items[2].cs == [260, 270]


def test_prefix_group_waits_for_its_plan_like_any_new_shape() -> None:
    """Under the one-new-plan-per-step limit an unbuilt group shape takes its turn: until
    then its members run one by one (or on varlen). Every step equals the reference."""
    be = CpuCudnn(150, new_plans_per_step=1)
    seen = []
    for _ in range(3):
        tensors, ctx, _ = make_step(GROUP, 4, 2, 16, "cpu", torch.float32, shared=GROUP_SHARED)
        got = be(tensors, ctx, 0.25, None)
        assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
        seen.append([type(it).__name__ for it in ctx.attn_plan.items])
    assert seen[0] == ["Group", "Varlen", "Fresh"], seen  # the group built its plan; the lone one waits
    assert seen[1] == seen[2] == ["Group", "Varlen", "Prefixed", "Fresh"], seen  # settled


def test_short_chunk_after_long_prefix_goes_to_varlen() -> None:
    tensors, ctx, _ = make_step([(20, 20 + 5000), (300, 300)], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(16)
    got = be(tensors, ctx, 0.25, None)
    assert be.calls == ["varlen", "causal320x320"], be.calls  # 20 queries over 5000 keys: cheaper on varlen
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 1024, 1025, 3000, 4097, 40000, 131072])
def test_buckets(n: int) -> None:
    b = bucket(n)
    assert n <= b < n + max(64, n // 16) and bucket(b) == b
    f = bucket_floor(n)
    assert f <= n and (f == 0) == (n < 64)
    assert f == 0 or (bucket_floor(f) == f and f > n - max(64, n // 8))


def test_sliding_window_stays_on_varlen() -> None:
    tensors, ctx, _ = make_step(CASES["mixed"], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(16)
    got = be(tensors, ctx, 0.25, 24)
    assert set(be.calls) == {"varlen"}
    assert (got - reference(tensors, ctx, 0.25, 24)).abs().max().item() < 1e-5


def test_refused_shape_switches_to_varlen() -> None:
    class Refusing(CpuCudnn):
        def _sdpa(self, *a):
            raise RuntimeError("cuDNN: no engine for these shapes")

    tensors, ctx, _ = make_step(CASES["mixed"], 4, 2, 16, "cpu", torch.float32)
    be = Refusing(16)
    got = be(tensors, ctx, 0.25, None)
    assert not be.enabled and set(be.calls) == {"varlen"}
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5


def test_merge_reference_equals_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(30, 4, 8, generator=g), torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g)
    o1, l1 = partial(q, k[:20], v[:20], 0.3, False)
    o2, l2 = partial(q, k[20:], v[20:], 0.3, False)
    full, _ = partial(q, k, v, 0.3, False)
    out = torch.empty_like(q)
    merge_attn(o1, l1, o2, l2, out)
    assert (out - full).abs().max().item() < 1e-5
    # a row whose second part is empty (-inf) takes the first part alone
    l2[:, 0] = float("-inf")
    merge_attn(o1, l1, o2, l2, out)
    assert torch.allclose(out[0], o1[0], atol=1e-6)


def test_padding_is_a_view_into_slack_and_garbage_queries_stay_out() -> None:
    """With slack rows around the step's buffers (as the engine allocates them), bucket
    padding and prefix offsets read neighbouring rows instead of copying: query rows there
    may be anything (NaN here), key/value rows there are finite; results are unchanged."""
    tensors, ctx, _ = make_step([(300, 900), (200, 250), (100, 100), (90, 90)], 4, 2, 16, "cpu", torch.float32)
    ref = reference(tensors, ctx, 0.25, None)
    slacked = []
    for i, t in enumerate((tensors.q, tensors.k, tensors.v, tensors.kp, tensors.vp)):
        sl = slack_rows(t.shape[0])
        buf = torch.full((sl + t.shape[0] + sl, *t.shape[1:]), float("nan") if i == 0 else 0.0)
        buf[sl:sl + t.shape[0]] = t
        slacked.append(buf[sl:sl + t.shape[0]])
    copies = []

    class Counting(CpuCudnn):
        @staticmethod
        def _padded(x, front, n):
            y = CudnnBackend._padded(x, front, n)
            copies.append(y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr())
            return y

    got = Counting(16)(AttentionInputs(*slacked), ctx, 0.25, None)
    assert copies and not any(copies)  # every padded operand was a view
    assert torch.isfinite(got).all() and (got - ref).abs().max().item() < 1e-5


def test_out_of_memory_is_raised_and_leaves_cudnn_on() -> None:
    """Only a refused shape switches cuDNN off; running out of memory fails the step (the
    engine fails that step's requests) and the next step still uses cuDNN."""
    class Oom(CpuCudnn):
        def _sdpa(self, *a):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    tensors, ctx, _ = make_step(CASES["mixed"], 4, 2, 16, "cpu", torch.float32)
    be = Oom(16)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        be(tensors, ctx, 0.25, None)
    assert be.enabled


def test_warm_up_below_the_cudnn_minimum_is_a_no_op() -> None:
    be = CpuCudnn(256)
    assert be.warm_up(192, 4, 2, 16, torch.device("cpu"), torch.float32) == 0.0
    assert be.enabled and not be.shapes


def test_a_step_builds_at_most_one_new_prefix_shape() -> None:
    """Three prefixed chunks whose non-causal cuDNN shapes have no plan yet: the first step
    takes the cuDNN split for one (building its plan) and varlen for the others; each later
    step adds one more, until all run on cuDNN. Every step equals the reference."""
    lens = [(300, 900), (400, 1500), (350, 2400), (512, 512)]
    be = CpuCudnn(16, new_plans_per_step=1)
    n_prefixed = []
    for _ in range(4):
        tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32)
        got = be(tensors, ctx, 0.25, None)
        assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
        kinds = [type(it).__name__ for it in ctx.attn_plan.items]
        n_prefixed.append(kinds.count("Prefixed"))
        assert kinds.count("Fresh") == 1  # fresh squares are built at start-up: never held back
    assert n_prefixed == [1, 2, 3, 3], n_prefixed
    be = CpuCudnn(16, new_plans_per_step=None)  # deterministic mode: build on first use
    tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32)
    be(tensors, ctx, 0.25, None)
    assert [type(it).__name__ for it in ctx.attn_plan.items].count("Prefixed") == 3


def test_a_prefix_shape_is_rented_on_varlen_until_it_has_cost_a_build() -> None:
    """Ski rental: a prefixed chunk whose shape has no plan runs on varlen until what varlen
    cost over cuDNN on its uses adds up to one plan build, then the step builds it and it
    stays on cuDNN. A chunk whose one use saves more than a build takes cuDNN at once. Every
    step equals the reference."""
    lens = [(300, 900), (512, 512)]
    be = CpuCudnn(16, new_plans_per_step=1)
    be.layers, be.flops_per_pair = 3, 4.0 * 4 * 16  # as warm_up sets them (4 heads of 16)
    extra = be._varlen_extra_s([(300, 600)], bucket_floor(600))
    assert 0 < extra < 1e-6  # a small chunk: fractions of a microsecond at these sizes
    be.build_s = 2.5 * extra  # three uses pay for a build
    kinds = []
    for _ in range(5):
        tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32)
        got = be(tensors, ctx, 0.25, None)
        assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5
        kinds.append([type(it).__name__ for it in ctx.attn_plan.items])
    assert [k.count("Prefixed") for k in kinds] == [0, 0, 1, 1, 1], kinds
    assert not be._rent  # built: nothing owed on it any more
    be = CpuCudnn(16, new_plans_per_step=1)
    be.layers, be.flops_per_pair, be.build_s = 3, 4.0 * 4 * 16, 0.5 * extra
    tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32)
    be(tensors, ctx, 0.25, None)
    assert [type(it).__name__ for it in ctx.attn_plan.items].count("Prefixed") == 1


def test_self_check_takes_every_cudnn_path() -> None:
    made: list[CpuCudnn] = []

    def make(**settings) -> CpuCudnn:
        made.append(CpuCudnn(256, **settings))
        return made[-1]

    assert self_check(make, torch.device("cpu"), torch.float32) == CudnnPaths(native_gqa=True, group_prefixes=True)
    (be,) = made  # the first variant passed
    assert be.enabled and be.new_plans_per_step is None  # the check builds every shape it runs
    assert any(c.startswith("full") for c in be.calls) and "varlen" in be.calls


def test_self_check_turns_off_only_the_groups_when_they_fail() -> None:
    class BadGroups(CpuCudnn):
        def _split(self, x, t0, cs, k0s, ps, s, scale, out):
            super()._split(x, t0, cs, k0s, ps, s, scale, out)
            if len(cs) > 1:  # a group: a wrong result, not a refusal
                out.add_(1.0)

    paths = self_check(lambda **kw: BadGroups(256, **kw), torch.device("cpu"), torch.float32)
    assert paths == CudnnPaths(native_gqa=True, group_prefixes=False)


def test_self_check_fails_when_no_variant_agrees() -> None:
    class Wrong(CpuCudnn):
        def _sdpa(self, q, k, v, causal, lse, scale):
            o, lse_ = super()._sdpa(q, k, v, causal, lse, scale)
            return o + 1.0, lse_

    assert self_check(lambda **kw: Wrong(256, **kw), torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("seed", range(12))
def test_random_steps_with_prefix_groups_match_reference(seed: int) -> None:
    """Random steps: groups of prefixed sequences sharing a random number of leading keys,
    lone prefixed ones, fresh ones, random cuDNN minimum and plan limit."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda a, b: int(torch.randint(a, b, (1,), generator=g))  # noqa: E731
    lens, shared = [], []
    for _ in range(ri(1, 4)):
        p = ri(40, 700)
        for m in range(ri(1, 5)):
            c = ri(1, 400)
            extra = max(ri(-3, 3), 0) * 40  # a continuation chunk reads some of its own keys too
            lens.append((c, p + extra + c))
            shared.append(0 if m == 0 else p if ri(0, 3) else ri(p // 2, p + 1))
    shared[0] = 0
    lens += [(ri(1, 500), 0) for _ in range(ri(0, 3))]
    lens = [(q, k if k else q) for q, k in lens]
    tensors, ctx, _ = make_step(lens, 4, 2, 16, "cpu", torch.float32, shared=shared)
    be = CpuCudnn(ri(8, 120), new_plans_per_step=ri(0, 3) or None)
    for _ in range(2):
        ctx.attn_plan = None
        got = be(tensors, ctx, 0.25, None)
        assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5


def test_registry_picks_sdpa_off_cuda_and_names_the_choices() -> None:
    from teacher_server.attention import make_backend

    cpu = torch.device("cpu")
    assert make_backend("auto", cpu).name == "sdpa"
    assert make_backend("sdpa", cpu, torch.float32).warm_up(4096, 4, 2, 16, cpu, torch.float32) == 0.0
    for name in ("varlen", "cudnn", "flash_attn"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            make_backend(name, cpu)
    with pytest.raises(ValueError, match="choose auto, sdpa, varlen, flash_attn, cudnn"):
        make_backend("nope", cpu)


def test_cudnn_fe_ragged_columns() -> None:
    """The frontend backend's per-call columns: fresh sequences' keys at their queries' rows,
    prefixed ones' at the packed keys' own rows; padding sequences empty at the end; each
    column 16-byte aligned; offsets in elements of each tensor's row stride."""
    from teacher_server.attention.buckets import batch_class, size_class
    from teacher_server.attention.cudnn_fe import ragged_columns

    assert [batch_class(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [size_class(n, 4) for n in (1, 256, 257, 1024, 1025, 1280, 1281, 5000)] == [
        256, 256, 512, 1024, 1280, 1280, 1536, 5120]
    # fresh: three sequences from row 100 of a step (q rows of 4096 elements, k/v rows of 1024)
    lens, offs = ragged_columns([5, 3, 2], [5, 3, 2], 100, False, 4, (4096, 1024, 1024, 4096))
    assert lens == [[5, 3, 2, 0, 0, 0, 0, 0], [5, 3, 2, 0, 0, 0, 0, 0]]
    assert offs[0] == [r * 4096 for r in (100, 105, 108, 110, 110, 110, 110, 110)]
    assert offs[1] == offs[2] == [r * 1024 for r in (100, 105, 108, 110, 110, 110, 110, 110)]
    assert offs[3] == offs[0]
    # prefixed: two sequences, 4 and 6 queries after 10 and 20 keys of prefix
    lens, offs = ragged_columns([4, 6], [14, 26], 0, True, 2, (512, 256, 128, 512))
    assert lens == [[4, 6, 0, 0], [14, 26, 0, 0]]
    assert offs == [[0, 2048, 5120, 5120], [0, 3584, 10240, 10240], [0, 1792, 5120, 5120], [0, 2048, 5120, 5120]]


@pytest.fixture
def fe_backend(monkeypatch):
    """The cudnn_fe backend on the CPU: its plan, columns and routing as on the GPU, each
    frontend call replaced by float32 math that reads the call's lengths and offsets the way
    cuDNN does (element offsets over each tensor's rows, bottom-right causal); the split is
    the CPU cuDNN backend. The frontend module itself is not needed for any of it."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    from teacher_server.attention.cudnn_fe import CudnnFrontendBackend
    from teacher_server.attention.sdpa import sdpa_one

    class CpuFe(CudnnFrontendBackend):
        @staticmethod
        def _on_device(x):
            return True

        def _run(self, it, x, scale, out):
            kt, vt = (x.kp, x.vp) if it.prefixed else (x.k, x.v)
            lens, offs = it.lens.tolist(), it.offs.tolist()
            _, bp, sq, sk = it.key
            assert len(lens[0]) >= bp + 1 and len(lens[0]) % 4 == 0  # 16-byte columns
            for i in range(bp):
                lq, lk = lens[0][i], lens[1][i]
                assert lq <= sq and lk <= sk  # within the graph's class
                if not lq:
                    assert i >= 1 and offs[0][i] == offs[0][i - 1] + lens[0][i - 1] * x.q.stride(0)
                    continue
                q0, k0, v0 = offs[0][i] // x.q.stride(0), offs[1][i] // kt.stride(0), offs[2][i] // vt.stride(0)
                o0 = offs[3][i] // (out.shape[1] * out.shape[2])
                assert k0 == v0 and it.t0 <= q0 and q0 + lq <= it.t1
                out[o0:o0 + lq] = sdpa_one(x.q[q0:q0 + lq], kt[k0:k0 + lk], vt[k0:k0 + lk], scale, None)

    return CpuFe


@pytest.mark.parametrize("case", [*CASES, "lone_prefixed"])
@pytest.mark.parametrize("rent", [False, True])
def test_cudnn_fe_plan_matches_reference(case: str, rent: bool, fe_backend) -> None:
    """The frontend backend's calls (fresh part, prefixed part) and a lone prefixed
    sequence's route (the split where its plan is built or worth building, else the
    frontend's call: never varlen) give the sdpa reference's result."""
    from teacher_server.attention.cudnn_fe import FeCall

    lens = [(700, 2100), (300, 300), (512, 512), (40, 40)] if case == "lone_prefixed" else CASES[case]
    split = CpuCudnn(16, new_plans_per_step=1 if rent else None)
    if rent:  # the sizes warm_up gives, and a build that costs more than any one-off saves
        split.layers, split.flops_per_pair, split.build_s = 36, 4.0 * 4 * 32, 1e9
    attn = fe_backend(split=split)
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    got = attn(x, ctx, 32 ** -0.5, None)
    err = (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item()
    assert err < 1e-5, err
    items = ctx.attn_plan.items
    kinds = [type(it).__name__ for it in items]
    assert "Fresh" not in kinds and "Varlen" not in kinds, kinds  # fresh: the frontend's call; never varlen
    npf, b = ctx.n_prefixed, len(ctx.q_lens)
    fe_calls = [it.prefixed for it in items if isinstance(it, FeCall)]
    assert fe_calls.count(False) == (npf < b)
    if npf > 1 or (npf == 1 and rent):  # several prefixed, or a one-off shape: the frontend's call
        assert fe_calls.count(True) == 1 and len(items) == len(fe_calls), kinds
    elif npf == 1:  # plans built at once: the split where it pays (a Prefixed call), else the frontend's
        assert (fe_calls.count(True), kinds.count("Prefixed")) in ((1, 0), (0, 1)), kinds
    if case == "lone_prefixed" and not rent:
        assert "Prefixed" in kinds, kinds


def test_cudnn_fe_falls_back_when_a_shape_is_refused(fe_backend) -> None:
    """The frontend refusing a shape (a head size it does not take, say) turns it off for
    good and the step runs on the cudnn backend; the split refusing a shape hands the lone
    prefixed sequence to the frontend. Either way the result is the reference's."""
    from teacher_server.attention.cudnn_items import PathFailed

    lens = [(700, 2100), (300, 300), (512, 512), (40, 40)]

    class Refusing(fe_backend):
        def _run(self, it, x, scale, out):
            raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")

    attn = Refusing(split=CpuCudnn(16))
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    got = attn(x, ctx, 32 ** -0.5, None)
    assert not attn.enabled and ctx.attn_plan.owner is attn.split
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5

    split = CpuCudnn(16)

    def refuse(*a, **k):
        raise PathFailed("cudnn", RuntimeError("no plan"))

    split._run_special = refuse
    attn = fe_backend(split=split)
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    got = attn(x, ctx, 32 ** -0.5, None)
    assert attn.enabled and attn.split is None and ctx.attn_plan.owner is attn
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads", [(4, 2, 128), (8, 8, 64), (4, 1, 256)])
def test_cudnn_fe_check_at_the_models_heads(heads, fe_backend) -> None:
    """The frontend backend's check (at start-up, and at the model's own heads in warm_up)
    passes where its calls are right and fails where the frontend refuses the shape or
    computes something else."""
    from teacher_server.attention.cudnn_fe_check import frontend_check

    cpu = torch.device("cpu")
    assert frontend_check(fe_backend(split=CpuCudnn(16)), cpu, torch.float32, heads)

    class Refusing(fe_backend):
        def _run(self, it, x, scale, out):
            raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")

    class Wrong(fe_backend):
        def _run(self, it, x, scale, out):
            super()._run(it, x, scale, out)
            out[it.t0:it.t1] *= 1.01

    for bad in (Refusing, Wrong):
        assert not frontend_check(bad(split=CpuCudnn(16)), cpu, torch.float32, heads)


def test_cudnn_fe_warm_up_survives_a_graph_it_cannot_build(fe_backend, monkeypatch) -> None:
    """A graph the frontend does not build at warm-up (past the check at the model's heads)
    turns the backend off, as when a step meets one, instead of failing the start-up."""
    import teacher_server.attention.cudnn_fe_check as cudnn_fe_check

    monkeypatch.setattr(cudnn_fe_check, "frontend_check", lambda *a, **k: True)
    built = []

    class Failing(fe_backend):
        def _handle(self, device):
            return None

        def _build(self, full, handle):
            if len(built) == 3:
                raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")
            built.append(full)
            self._graphs[full] = (None, 0)
            return self._graphs[full]

    attn = Failing(split=None)
    attn.warm_up(4096, 4, 2, 128, torch.device("cuda"), torch.bfloat16)  # (no CUDA call is made)
    assert not attn.enabled and len(built) == 3
    attn.split = CpuCudnn(16)  # (the split's own warm-up needs CUDA): the steps now go to it
    x, ctx, _ = make_step([(300, 300), (40, 40)], 4, 2, 32, "cpu", torch.float32)
    assert (attn(x, ctx, 32 ** -0.5, None) - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5


def narrow_values(x: AttentionInputs, dv: int) -> AttentionInputs:
    """x with values (and the prefixed sequences' values) cut to their first ``dv`` columns:
    latent attention's widths (keys wider than values)."""
    cut = lambda t: None if t is None else t[..., :dv].contiguous()  # noqa: E731
    return AttentionInputs(x.q, x.k, cut(x.v), x.kp, cut(x.vp))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("lens", [CASES["mixed"], [(700, 2100), (300, 300), (512, 512), (40, 40)]])
def test_cudnn_fe_values_narrower_than_keys(lens, native: bool, fe_backend) -> None:
    """Values narrower than keys (q/k 32, v 16 here; latent attention's 192 and 128): the
    frontend's calls take them as they are (a lone prefixed sequence too, where the split
    would take values only as wide as keys), or, where its check at those widths failed
    (``native_v`` off), padded to the key width; the output is values-wide and the
    reference's either way."""
    seen = []

    class Recording(fe_backend):
        def _run(self, it, x, scale, out):
            seen.append((x.v if not it.prefixed else x.vp).shape[2])
            super()._run(it, x, scale, out)

    attn = Recording(split=CpuCudnn(16))
    attn.native_v = native
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    x = narrow_values(x, 16)
    got = attn(x, ctx, 32 ** -0.5, None)
    assert got.shape == (x.q.shape[0], 4, 16)
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5
    assert seen and set(seen) == {16 if native else 32}, seen
    assert all(type(it).__name__ == "FeCall" for it in ctx.attn_plan.items) or not native


def test_cudnn_fe_narrower_values_on_another_route(fe_backend) -> None:
    """A frontend that refuses the call turns off and the step goes to the split, which takes
    values only as wide as keys: they are padded for it, and the result is still the
    reference's, values-wide."""
    widths = []

    class Refusing(fe_backend):
        def _run(self, it, x, scale, out):
            raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")

    class Split(CpuCudnn):
        def __call__(self, x, ctx, scale, window, softcap=None):
            widths.append(x.v.shape[2])
            return super().__call__(x, ctx, scale, window, softcap)

    attn = Refusing(split=Split(16))
    x, ctx, _ = make_step(CASES["mixed"], 4, 2, 32, "cpu", torch.float32)
    x = narrow_values(x, 16)
    got = attn(x, ctx, 32 ** -0.5, None)
    assert not attn.enabled and widths == [32]
    assert got.shape[-1] == 16
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5


def picky_fe(fe_backend, refused):
    """A CPU frontend backend whose calls ``refused(item, inputs)`` raise as cuDNN refusing a
    graph; graph builds are stubs (warm-up builds none for real) and its start-up check runs
    on the CPU, views and all."""
    from teacher_server.attention.cudnn_fe_check import frontend_check

    class Picky(fe_backend):
        def _run(self, it, x, scale, out):
            if refused(it, x):
                raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")
            super()._run(it, x, scale, out)

        def _handle(self, device):
            return None

        def _build(self, full, handle):
            self._graphs[full] = (None, 0)
            return self._graphs[full]

    attn = Picky(split=None)
    attn.check = lambda b, dev, dt, heads, views=None: frontend_check(b, torch.device("cpu"), torch.float32, heads,
                                                                       views)
    return attn


@pytest.mark.parametrize("refuses", ["narrow", "all", "none"])
def test_cudnn_fe_warm_up_checks_the_models_value_width(refuses: str, fe_backend) -> None:
    """warm_up's check at the model's widths (keys 32, values 16): passed, the values go to
    the frontend as they are; failed with narrower values alone, they are padded and the
    frontend stays on; failed at equal widths too, the frontend is off."""

    def refused(it, x) -> bool:
        vt = x.vp if it.prefixed else x.v
        return refuses == "all" or (refuses == "narrow" and vt.shape[2] != x.q.shape[2])

    attn = picky_fe(fe_backend, refused)
    attn.warm_up(1024, 4, 2, 32, torch.device("cuda"), torch.float32, dv=16)
    assert (attn.enabled, attn.native_v) == {"none": (True, True), "narrow": (True, False),
                                             "all": (False, True)}[refuses]
    assert attn.distinct_v_width == (refuses == "none")  # (padded: the model pads them as it makes them)
    if attn.enabled:  # the graphs warm_up built take the widths the steps will bring
        assert {full[7] for full in attn._graphs} == {16 if refuses == "none" else 32}


def as_views(x: AttentionInputs) -> AttentionInputs:
    """x with q and the values (fresh and prefixed) moved into wider rows, as latent attention
    hands them: q inside its projection's output, v inside kv_b_proj's (strided views)."""
    from teacher_server.attention.cudnn_fe_check import as_view

    hq, d = x.q.shape[1:]
    hk, dv = x.v.shape[1:]
    return AttentionInputs(as_view(x.q, (hq * d + 24, d, 1)), x.k, as_view(x.v, (hk * 2 * dv, 2 * dv, 1)), x.kp,
                           as_view(x.vp, (hk * 2 * dv, 2 * dv, 1)))


@pytest.mark.parametrize("refusing", [False, True])
def test_cudnn_fe_takes_q_and_values_as_views(refusing: bool, fe_backend) -> None:
    """q and narrower values as strided views (latent attention's q rotated where its
    projection wrote it, v inside kv_b_proj's output): the frontend's calls read them where
    they are, at their strides; a frontend that refuses the call turns off and the split gets
    contiguous copies with slack rows (it pads by viewing them). The reference's result
    either way."""
    seen, split_seen = [], []

    class Viewing(fe_backend):
        def _run(self, it, x, scale, out):
            if refusing:
                raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")
            seen.append((x.q.is_contiguous(), (x.vp if it.prefixed else x.v).is_contiguous()))
            super()._run(it, x, scale, out)

    class Split(CpuCudnn):
        def __call__(self, x, ctx, scale, window, softcap=None):
            split_seen.append((x.q.is_contiguous(), x.v.is_contiguous(), x.vp is None or x.vp.is_contiguous()))
            return super().__call__(x, ctx, scale, window, softcap)

    attn = Viewing(split=Split(16))
    assert attn.takes_views
    x, ctx, _ = make_step([(700, 2100), (300, 900), (300, 300), (512, 512), (40, 40)], 4, 2, 32, "cpu",
                          torch.float32)
    x = as_views(narrow_values(x, 16))
    assert not x.q.is_contiguous() and not x.v.is_contiguous() and not x.vp.is_contiguous()
    got = attn(x, ctx, 32 ** -0.5, None)
    assert got.shape == (x.q.shape[0], 4, 16)
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5
    if refusing:
        assert not attn.enabled and not attn.takes_views and not seen
        assert split_seen == [(True, True, True)]
    else:
        assert seen == [(False, False)] * 2 and not split_seen  # (the prefixed part and the fresh one)


@pytest.mark.parametrize("refuses_views", [False, True])
def test_cudnn_fe_warm_up_checks_the_layers_views(refuses_views: bool, fe_backend) -> None:
    """warm_up's check with q and v as the layers hand them (``views``): passed, the graphs it
    builds take those strides; failed with the views alone, the backend says it takes none
    (the layers hand contiguous copies) and the graphs take contiguous rows."""

    views = ((4 * 32 + 24, 32, 1), (2 * 32, 32, 1))
    attn = picky_fe(fe_backend, lambda it, x: refuses_views and not x.q.is_contiguous())
    attn.warm_up(1024, 4, 2, 32, torch.device("cuda"), torch.float32, dv=16, views=views)
    assert attn.enabled and attn.distinct_v_width and attn.takes_views == (not refuses_views)
    strides = {(full[10], full[12]) for full in attn._graphs}
    assert strides == ({((4 * 32, 32, 1), (2 * 16, 16, 1))} if refuses_views else {views})


class FakeGraph:
    """A frontend graph as the plan store sees it: built (counted), serialized (a list of
    ints, as the bindings give it), read back; bytes b"bad" do not load, b"wrong" load as a
    plan that computes something else."""

    built = 0

    def __init__(self, **kw) -> None:
        self.data, self.wrong = b"", False

    def build_plans(self) -> None:
        FakeGraph.built += 1
        self.data = b"plan"

    def serialize(self) -> list[int]:
        return list(self.data)

    def deserialize(self, data: list[int]) -> None:
        if bytes(data) == b"bad":
            raise RuntimeError("cudnnBackendFinalize failed: CUDNN_STATUS_BAD_PARAM")
        self.data, self.wrong = bytes(data), bytes(data) == b"wrong"

    def get_workspace_size(self) -> int:
        return 0


@pytest.fixture
def stored_fe(fe_backend, monkeypatch):
    """The CPU cudnn_fe backend whose calls go through graphs it builds or reads from a plan
    store (``FakeGraph``); a graph read back as ``wrong`` spoils its call's rows."""
    import sys

    monkeypatch.setattr(sys.modules["cudnn"], "pygraph", FakeGraph, raising=False)
    monkeypatch.setattr(FakeGraph, "built", 0)

    class StoredFe(fe_backend):
        def _graph(self, full, handle):
            return FakeGraph()

        def _handle(self, device):
            return None

        def _run(self, it, x, scale, out):
            kt, vt = (x.kp, x.vp) if it.prefixed else (x.k, x.v)
            full = (*it.key, x.q.shape[1], kt.shape[1], x.q.shape[2], x.q.dtype, scale, x.q.stride(), kt.stride(),
                    vt.stride())
            g, _ = self._graphs.get(full) or self._build(full, None)
            super()._run(it, x, scale, out)
            if g.wrong:
                out[it.t0:it.t1] *= 1.01

    return StoredFe


def test_cudnn_fe_reads_back_the_graphs_a_start_before_kept(stored_fe, tmp_path) -> None:
    """A restart with the same store builds no graph: each comes back from the file the first
    start wrote, and the step's result is the same; other versions build their own."""
    from teacher_server.attention.plan_store import PlanStore

    versions = {"gpu": "H200", "cudnn": "91600"}
    lens = [(700, 2100), (300, 800), (300, 300), (512, 512), (40, 40)]
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    first = stored_fe(split=None, plans=PlanStore(tmp_path, versions))
    want = first(x, ctx, 32 ** -0.5, None)
    assert (want - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5
    n = FakeGraph.built
    assert n == 2 and first.plans.saved == n and not first.loaded  # the fresh part and the prefixed part
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    again = stored_fe(split=None, plans=PlanStore(tmp_path, versions))
    assert torch.equal(again(x, ctx, 32 ** -0.5, None), want)
    assert FakeGraph.built == n and len(again.loaded) == n and again.plans.loaded == n
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    other = stored_fe(split=None, plans=PlanStore(tmp_path, {**versions, "cudnn": "91700"}))
    other(x, ctx, 32 ** -0.5, None)
    assert FakeGraph.built == 2 * n and not other.loaded

    class Changed(stored_fe):  # the code that makes the graphs changed: the plans made before are not read
        def _graph(self, full, handle):
            return FakeGraph(changed=True)

    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    changed = Changed(split=None, plans=PlanStore(tmp_path, versions))
    changed(x, ctx, 32 ** -0.5, None)
    assert FakeGraph.built == 3 * n and not changed.loaded


def test_cudnn_fe_builds_a_kept_graph_that_does_not_load(stored_fe, tmp_path) -> None:
    from teacher_server.attention.plan_store import PlanStore

    lens = [(300, 300), (512, 512)]
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    stored_fe(split=None, plans=PlanStore(tmp_path, {}))(x, ctx, 32 ** -0.5, None)
    (f,) = tmp_path.glob("*.plan")
    f.write_bytes(b"bad")
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    attn = stored_fe(split=None, plans=PlanStore(tmp_path, {}))
    got = attn(x, ctx, 32 ** -0.5, None)
    assert attn.enabled and not attn.loaded and FakeGraph.built == 2 and f.read_bytes() == b"plan"
    assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5


def test_kept_graphs_that_fail_the_check_are_built_again(stored_fe, tmp_path) -> None:
    """The start-up check runs on the graphs read from the store: where they compute something
    else it fails on them, and ``checked`` leaves the store and passes on graphs built anew."""
    from teacher_server.attention.cudnn_fe_check import checked, frontend_check
    from teacher_server.attention.plan_store import PlanStore

    cpu = torch.device("cpu")
    assert checked(stored_fe(split=CpuCudnn(16), plans=PlanStore(tmp_path, {})), cpu, torch.float32)
    files = list(tmp_path.glob("*.plan"))
    assert files
    for f in files:
        f.write_bytes(b"wrong")
    assert not frontend_check(stored_fe(split=CpuCudnn(16), plans=PlanStore(tmp_path, {})), cpu, torch.float32)
    attn = stored_fe(split=CpuCudnn(16), plans=PlanStore(tmp_path, {}))
    assert checked(attn, cpu, torch.float32)
    assert attn.enabled and attn.plans is None and not attn.loaded


def test_without_plain_squares_a_short_prefix_takes_the_frontends_call(fe_backend, monkeypatch) -> None:
    """Where cudnn_fe takes the fresh sequences, its split's warm-up builds only the squares
    with log-sum-exp; a lone prefixed sequence whose prefix is under 64 keys (a square without
    it, no prefix call) then takes the frontend's call instead of an unbuilt plan, until that
    square exists. The result is the reference's either way."""
    from teacher_server.attention.cudnn_fe import FeCall
    from teacher_server.attention.cudnn_items import Prefixed

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    split = CpuCudnn(256)
    split.plain_squares = False
    split.warm_up(2048, 4, 2, 16, torch.device("cpu"), torch.float32)
    assert split.enabled and split.shapes and all(lse for *_, lse in split.shapes)
    assert (1024, 1024, True, True) in split.shapes and (1024, 1024, True, False) not in split.shapes
    lens = [(300, 340), (512, 512)]  # a 40-key prefix: bucket_floor 0
    for plain, want in ((False, FeCall), (True, Prefixed)):
        split.plain_squares = plain
        attn = fe_backend(split=split)
        x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
        got = attn(x, ctx, 32 ** -0.5, None)
        assert (got - reference(x, ctx, 32 ** -0.5, None)).abs().max().item() < 1e-5
        first = ctx.attn_plan.items[0]
        assert isinstance(first, want) and (want is Prefixed or first.prefixed), ctx.attn_plan.items
    split.plain_squares = False  # its square built now (the run above): the split again
    attn = fe_backend(split=split)
    x, ctx, _ = make_step(lens, 4, 2, 32, "cpu", torch.float32)
    attn(x, ctx, 32 ** -0.5, None)
    assert isinstance(ctx.attn_plan.items[0], Prefixed)
