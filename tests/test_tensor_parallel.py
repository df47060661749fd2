"""Tensor parallel on the CPU (gloo, worker processes): TP=2 gives TP=1's results within
1e-5 in float32 (flat, per-row and binary candidates, classic prompt_logprobs, greedy next
token, prefix-cache hits, chunked sequences, raw_logits, deterministic mode), on a vocab not
divisible by 2 and with fewer KV heads than ranks, for dense, mixture-of-experts (experts
split along their intermediate dimension, a shared expert, dense layers among the expert ones)
and hybrid Qwen3.5 models (linear-attention heads and their states split; GRPO siblings from
the prompt's state snapshot); TP=8 equals TP=1 for both kinds; the o and down products made in
row parts (``tp_comm_parts``) equal one part; sharded loading; the HTTP service at
``--tensor-parallel-size 2``; a killed worker makes the service unhealthy and the process
exit non-zero."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from apiutil import assert_error, body, decode, npy_b64
from conftest import LiveServer, free_port, wait_healthy
from reference import make_hybrid_checkpoint, make_moe_checkpoint, randomize_weights

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.layers.parallel import TensorParallel
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
GEN = "/inference/v1/generate"


def tiny_checkpoint(path: Path, family: str, vocab: int, heads: int, kv_heads: int, layers: int = 2) -> Path:
    """A tiny float32 checkpoint (qwen2: QKV bias; qwen3: q/k norm and tied embeddings)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, head_dim=16)
    if family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rope_theta=10000.0))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, rope_theta=10000.0, tie_word_embeddings=True))
    torch.manual_seed(0)
    randomize_weights(model)
    model.float().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Vocab 301 (odd: uneven shards at TP2), one KV head (replicated at TP2), QKV bias."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tp") / "odd", "qwen2", 301, 4, 1)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with tied embeddings (the embedding's vocab shard is the LM head's), 2 KV heads."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tied", "qwen3", 256, 4, 2)


def requests(vocab: int, seed: int) -> list[ScoreRequest]:
    """Flat and per-row (padded) candidates, classic prompt_logprobs, greedy next token;
    three responses to one 48-token prompt (prefix-cache hits), long ones (chunked)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 48)
    out = []
    for j, (n, start) in enumerate([(40, 0), (150, 17), (97, 64), (5, 3), (2, 0)]):
        toks = rng.integers(0, vocab, n)
        rows = max(n - 1 - start, 0)
        if j % 2:
            cand = rng.integers(0, vocab, (rows, 6))
            cand[rng.random((rows, 6)) < 0.2] = -1
        else:
            cand = np.array([0, vocab - 1, vocab // 2, vocab // 2 - 1, vocab // 2 + 1, 7])  # both shards' edges
        out.append(ScoreRequest(f"r{j}", toks, start, cand, prompt_logprobs=3 if j < 3 else None, max_tokens=1))
    for j in range(3):
        toks = np.concatenate([prompt, rng.integers(0, vocab, 30)])
        out.append(ScoreRequest(f"g{j}", toks, 47, rng.integers(0, vocab, (30, 4)), max_tokens=1))
    return out


def scored(vocab: int, seed: int = 0) -> list[np.ndarray]:
    """The token sequences ``run`` scores (an MoE compared at 1e-5 keeps its routers clear of
    ties on them: ``make_moe_checkpoint(clear_on=...)``)."""
    return [r.token_ids for r in requests(vocab, seed)]


def run(path: Path, size: int, seed: int = 0, **settings: object) -> tuple[list[ScoreResult], int]:
    """Results of the requests scored in two waves (the second hits the prompt cached by the
    first), and the prefix-cache hit tokens."""
    settings = {"device": "cpu", "max_model_len": 1024, **settings}
    cfg = Config(model=str(path), tensor_parallel_size=size, max_num_batched_tokens=64, block_size=8,
                 num_kv_blocks=256, **settings)
    engine = Engine(cfg)
    try:
        reqs = requests(engine.spec.vocab_size, seed)
        first = engine.run_to_completion(reqs[:6])
        rest = engine.run_to_completion(reqs[6:])
        return first + rest, engine.stats().prefix_hit_tokens
    finally:
        engine.close()


def assert_same(a: list[ScoreResult], b: list[ScoreResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        np.testing.assert_array_equal(np.isfinite(x.token_id_logprobs), np.isfinite(y.token_id_logprobs))
        fin = np.isfinite(x.token_id_logprobs)
        np.testing.assert_allclose(y.token_id_logprobs[fin], x.token_id_logprobs[fin], rtol=0, atol=TOL)
        assert x.next_token == y.next_token
        if x.plp_topk_ids is not None:
            np.testing.assert_array_equal(y.plp_topk_ids, x.plp_topk_ids)
            np.testing.assert_array_equal(y.plp_token_rank, x.plp_token_rank)
            np.testing.assert_allclose(y.plp_topk_logprobs, x.plp_topk_logprobs, rtol=0, atol=TOL)
            np.testing.assert_allclose(y.plp_token_logprob, x.plp_token_logprob, rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def moe_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-MoE: a routed layer with a sigmoid-gated shared expert between dense layers."""
    return make_moe_checkpoint("qwen2moe:301", tmp_path_factory.mktemp("tp") / "moe_shared", clear_on=scored(301))


@pytest.fixture(scope="module")
def moe_stacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE saved with stacked [E, ...] expert tensors (sliced per rank on load)."""
    return make_moe_checkpoint("qwen3moe_stacked", tmp_path_factory.mktemp("tp") / "moe_stacked", clear_on=scored(512))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5: Gated DeltaNet layers (key and value heads split across ranks, their states in
    each rank's pool) between gated full-attention layers."""
    return make_hybrid_checkpoint("qwen3_5", tmp_path_factory.mktemp("tp") / "hybrid")


@pytest.fixture(scope="module")
def hybrid_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("tp") / "hybrid_moe")


@pytest.mark.parametrize(("model", "settings"), [
    ("odd_vocab", {}),
    ("odd_vocab", {"logprobs_mode": "raw_logits"}),
    ("tied", {"deterministic": True}),
    ("moe_shared", {}),
    ("moe_stacked", {}),
    ("hybrid", {}),
    ("hybrid_moe", {}),
])
def test_tp2_equals_tp1(model: str, settings: dict, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    one, hits1 = run(path, 1, **settings)
    two, hits2 = run(path, 2, **settings)
    assert_same(one, two)
    assert hits2 == hits1
    if not settings.get("deterministic"):
        assert hits2 > 0  # the second wave read the cached prompt


def test_sharded_load_holds_each_ranks_slices(odd_vocab: Path) -> None:
    """Each rank's parameters are its slices of the full model (uneven vocab shards, the one
    KV head replicated, the o projection split by input columns)."""
    spec = ModelSpec.from_dir(odd_vocab)
    full = dict(load_model(odd_vocab, spec, torch.float32, torch.device("cpu")).named_parameters())
    shards = [dict(load_model(odd_vocab, spec, torch.float32, torch.device("cpu"), tp=TensorParallel(2, r))
                   .named_parameters()) for r in range(2)]
    head = "head.weight"
    assert [s[head].shape[0] for s in shards] == [151, 150]
    torch.testing.assert_close(torch.cat([s[head] for s in shards]), full[head], rtol=0, atol=0)
    o = "layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(torch.cat([s[o] for s in shards], dim=1), full[o], rtol=0, atol=0)
    qkv = "layers.1.self_attn.qkv_proj.weight"
    q, d = spec.q_size, spec.head_dim
    for r, s in enumerate(shards):
        torch.testing.assert_close(s[qkv][:q // 2], full[qkv][r * q // 2:(r + 1) * q // 2], rtol=0, atol=0)
        torch.testing.assert_close(s[qkv][q // 2:], full[qkv][q:], rtol=0, atol=0)  # the KV head, on both
        assert s[qkv].shape[0] == q // 2 + 2 * d



@pytest.mark.parametrize("model", ["moe_shared", "moe_stacked"])
def test_each_rank_reads_its_slice_of_the_experts(model: str, request: pytest.FixtureRequest, monkeypatch) -> None:
    """Expert tensors are read sliced (a rank reads half of each at tp 2: per-expert gate, up
    and down, a stacked down), except a stacked gate_up (two slices; read whole), and the
    ranks' experts are their halves of the full model's."""
    import teacher_server.models.loader as loader

    path = request.getfixturevalue(model)
    spec = ModelSpec.from_dir(path)
    read: dict[str, tuple[int, ...]] = {}
    real = loader.read_slice

    def spy(sf, name, sl):
        t = real(sf, name, sl)
        read[name] = tuple(t.shape)
        return t

    full = dict(load_model(path, spec, torch.float32, torch.device("cpu")).named_parameters())
    monkeypatch.setattr(loader, "read_slice", spy)
    i = spec.moe_intermediate_size
    for r in range(2):
        read.clear()
        shard = dict(load_model(path, spec, torch.float32, torch.device("cpu"), tp=TensorParallel(2, r))
                     .named_parameters())
        experts = {n: s for n, s in read.items() if ".experts." in n}
        assert experts
        for name, shape in experts.items():
            if name.endswith("gate_up_proj"):  # stacked [E, 2I, H]
                assert shape[1] == 2 * i, name
            else:
                assert i // 2 in shape and i not in shape, (name, shape)
        for n in (n for n in full if n.endswith("experts.gate_up")):
            g, u = full[n].chunk(2, dim=1)
            h = i // 2
            torch.testing.assert_close(shard[n], torch.cat([g[:, r * h:(r + 1) * h], u[:, r * h:(r + 1) * h]], 1),
                                       rtol=0, atol=0)
            d = n.replace("gate_up", "down")
            torch.testing.assert_close(shard[d], full[d][:, :, r * h:(r + 1) * h], rtol=0, atol=0)


def test_comm_part_spans() -> None:
    """Row parts of a row-parallel product: ``comm_parts`` of them, none under the minimum
    rows, each starting on the alignment, covering the rows once; one at size 1 or 1 part."""
    from teacher_server.layers.parallel import COMM_PART_ALIGN, COMM_PART_MIN_ROWS

    assert TensorParallel(1, 0, 4).spans(100_000) == [(0, 100_000)]
    assert TensorParallel(2, 1, 1).spans(100_000) == [(0, 100_000)]
    assert TensorParallel(2, 0, 4).spans(COMM_PART_MIN_ROWS * 2 - 1) == [(0, COMM_PART_MIN_ROWS * 2 - 1)]
    for rows in (2048, 3000, 16384, 16385, 32768, 40000):
        for parts in (2, 3, 4, 8):
            spans = TensorParallel(2, 0, parts).spans(rows)
            assert len(spans) == min(parts, rows // COMM_PART_MIN_ROWS), (rows, parts, spans)
            assert spans[0][0] == 0 and spans[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert all(lo % COMM_PART_ALIGN == 0 and hi > lo for lo, hi in spans)


def _row_parallel_rank(rank: int, port: int, parts: int, queue) -> None:
    """One gloo rank: its half of a row-parallel product of 300 rows, made in ``parts`` parts
    (parts of 64 rows at least, started every 32) and in one, through ``forward`` and
    ``add_into``; rank 0 reports the results and the full product."""
    import torch.distributed as dist

    from teacher_server.layers import parallel
    from teacher_server.layers.linear import RowLinear

    parallel.COMM_PART_MIN_ROWS, parallel.COMM_PART_ALIGN = 64, 32
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0), rank=rank,
                            world_size=2)
    g = torch.Generator().manual_seed(0)
    a, w, x = torch.randn(300, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(300, 24, generator=g)
    out = {}
    for n in (1, parts):
        tp = parallel.TensorParallel(2, rank, n)
        lin = RowLinear(40, 24, torch.float32, torch.device("cpu"), tp)
        lin.weight.data.copy_(w[:, rank * 20:(rank + 1) * 20])
        mine = a[:, rank * 20:(rank + 1) * 20]
        out[n] = (len(tp.spans(300)), lin(mine), lin.add_into(x.clone(), mine))
    if rank == 0:
        queue.put({"full": (a @ w.t()).numpy(), "x": x.numpy(),
                   **{str(n): (k, f.numpy(), s.numpy()) for n, (k, f, s) in out.items()}})
    dist.destroy_process_group()


def test_row_parallel_product_in_parts_equals_one_part() -> None:
    """Two gloo ranks: the o/down product made in parts, each part's all-reduce started before
    the next part's GEMM, gives the one-part result (and the full product) in both forms."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_row_parallel_rank, args=(r, port, 3, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = queue.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    spans_one, fwd_one, add_one = got["1"]
    spans, fwd, add = got["3"]
    assert (spans_one, spans) == (1, 3)
    np.testing.assert_allclose(fwd, fwd_one, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(add, add_one, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(fwd, got["full"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(add, got["x"] + got["full"], rtol=1e-5, atol=1e-4)


def comm_parts_runs(path: Path, monkeypatch, **settings: object) -> tuple[dict, list[int]]:
    """Four long sequences (3000 tokens in one step: parts of 1536) scored at TP2 in 3 parts (2
    taken), at TP2 in one, and at TP1; and the row counts of rank 0's products made in parts
    while the first engine scored them (its start-up warm-up's not counted). Each sequence stays
    within the tiny model's 1024 positions: with one of 1100, its positions past 1024 (rotary
    extrapolation) scored up to 2.2e-4 apart in about one of 25 CPU engine starts, either way
    of splitting the products, which is not what these tests compare."""
    rng = np.random.default_rng(3)
    reqs = [ScoreRequest(f"long{j}", rng.integers(0, 256, n), n // 3, rng.integers(0, 256, (n - 1 - n // 3, 5)))
            for j, n in enumerate((800, 750, 750, 700))]
    made = []
    in_parts = TensorParallel.all_reduce_parts
    monkeypatch.setattr(TensorParallel, "all_reduce_parts",
                        lambda self, out, make, spans: made.append(out.shape[0]) or in_parts(self, out, make, spans))
    out, seen = {}, {}
    for size, parts in ((2, 3), (2, 1), (1, 3)):
        engine = Engine(Config(model=str(path), tensor_parallel_size=size, tp_comm_parts=parts,
                               max_num_batched_tokens=4096, max_model_len=2048, num_kv_blocks=512, block_size=8,
                               **{"device": "cpu", **settings}))
        try:
            assert len(engine.runner.tp.spans(3000)) == (2 if size == 2 and parts == 3 else 1)
            made.clear()
            out[size, parts] = engine.run_to_completion([ScoreRequest(r.request_id, r.token_ids, r.start,
                                                                      r.candidates) for r in reqs])
            seen[size, parts] = list(made)
        finally:
            engine.close()
    assert seen[2, 1] == seen[1, 3] == []
    return out, seen[2, 3]


def test_tp2_with_comm_parts_equals_one_part_and_tp1(tied: Path, monkeypatch) -> None:
    """The engine at TP2 with its o and down products in parts gives TP2's one-part results
    within 1e-5, and TP1's within 3e-5 (these long sequences' log-probs, about -25, differ from
    TP1's by up to 1.3e-5 with one part too)."""
    out, made = comm_parts_runs(tied, monkeypatch)
    # the first layer's o and down over the step's 2996 rows (the last layer's run over the
    # scored rows only: under 2048, one part)
    assert made == [2996, 2996]
    assert_same(out[2, 1], out[2, 3])
    assert_same_within(out[1, 3], out[2, 3], 3e-5)


def test_heads_must_split(odd_vocab: Path) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        Engine(Config(model=str(odd_vocab), device="cpu", tensor_parallel_size=3))


def test_every_split_the_model_needs_is_checked_at_start_up() -> None:
    """The MLP's width and the KV heads are checked as the attention heads are (a ValueError
    before any worker starts), not by an assert deep in the load that ``python -O`` drops."""
    from dataclasses import replace

    from teacher_server.engine.rank_setup import check_split
    from teacher_server.layers.parallel import TensorParallel
    from teacher_server.models.spec import ModelSpec

    spec = ModelSpec(family="qwen2", architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=96, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6,
                     rope_theta=1e4)
    check_split(spec, 2)
    check_split(spec, 8)  # 4 KV heads replicated over 8 ranks
    with pytest.raises(ValueError, match="intermediate size 90"):
        check_split(replace(spec, intermediate_size=90), 4)
    with pytest.raises(ValueError, match="6 KV heads"):
        check_split(replace(spec, num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(ValueError, match="does not split over 4 ranks"):
        TensorParallel(4, 0).split(90, "gate rows")


def test_a_start_up_check_failing_after_the_workers_started_stops_them(odd_vocab: Path) -> None:
    """A KV pool too small for max_model_len is found after the workers joined: they stop and
    the process group is left, so a corrected engine starts in the same process."""
    cfg = dict(model=str(odd_vocab), device="cpu", tensor_parallel_size=2, block_size=8, max_model_len=512)
    before = {p.pid for p in mp.active_children()}
    with pytest.raises(RuntimeError, match="cannot hold one sequence"):
        Engine(Config(**cfg, num_kv_blocks=4))
    assert not [p for p in mp.active_children() if p.pid not in before]  # no worker left running
    eng = Engine(Config(**cfg, num_kv_blocks=256))
    try:
        res = eng.run_to_completion([ScoreRequest("r", np.arange(40) % 300, 30, np.zeros((9, 2), np.int64))])
        assert res[0].error is None
    finally:
        eng.close()


def test_a_worker_dying_while_the_group_forms_ends_start_up_at_once(odd_vocab: Path, monkeypatch) -> None:
    """Rank 0 waiting in the rendezvous for a worker that has died (as one whose GPU fails
    NCCL's start) gives up within seconds, not after the 10-minute rendezvous timeout."""
    import teacher_server.engine.engine as engine_module
    from teacher_server.engine.tp_workers import TensorParallelError

    waiting = threading.Event()

    def rendezvous_never_completes(device, rank, size, store) -> None:
        waiting.set()
        time.sleep(3600)

    def kill_the_worker() -> None:
        assert waiting.wait(120)
        for p in mp.active_children():
            if p.name.startswith("teacher-tp"):
                os.kill(p.pid, signal.SIGKILL)

    monkeypatch.setattr(engine_module, "init_group", rendezvous_never_completes)
    threading.Thread(target=kill_the_worker, daemon=True).start()
    raised: list[BaseException] = []

    def start() -> None:
        try:
            Engine(Config(model=str(odd_vocab), device="cpu", tensor_parallel_size=2))
        except BaseException as e:
            raised.append(e)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(120)
    assert not starting.is_alive(), "start-up still waits for a worker that has died"
    assert waiting.is_set() and isinstance(raised[0], TensorParallelError), raised
    assert "while the process group formed" in str(raised[0])


@pytest.mark.slow
def test_tp8(tmp_path: Path) -> None:
    """Eight gloo ranks, eight heads, one KV head (replicated on all): TP=8 equals TP=1."""
    path = tiny_checkpoint(tmp_path / "m", "qwen2", 301, 8, 1)
    one, _ = run(path, 1)
    eight, _ = run(path, 8)
    assert_same(one, eight)


@pytest.mark.slow
def test_tp8_moe(tmp_path: Path) -> None:
    """Eight gloo ranks over a Qwen3-MoE (eight heads, one KV head, 8 experts of intermediate
    32: 4 columns per rank): TP=8 equals TP=1."""
    path = make_moe_checkpoint("qwen3moe:301", tmp_path / "m", heads=8, kv_heads=1)
    one, _ = run(path, 1)
    eight, _ = run(path, 8)
    assert_same(one, eight)



# --- the HTTP service ---------------------------------------------------------------------------

class Serve:
    """`python -m teacher_server serve --tensor-parallel-size 2 --device cpu` on a free port."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "teacher_server", "serve", "--device", "cpu", "--tensor-parallel-size", "2",
             "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), "--max-num-batched-tokens",
             "64", "--num-kv-blocks", "256", "--block-size", "8", *extra],
            env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 180) -> None:
        wait_healthy(self.url, self.proc, timeout)

    def workers(self) -> list[int]:
        """Pids of the worker processes (spawned children of the server)."""
        pids = []
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if d.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and b"spawn_main" in cmd:
                pids.append(int(d.name))
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_http_service_at_tp2(odd_vocab: Path) -> None:
    """The contract through the HTTP service with two ranks: candidate forms (flat, per-row
    lists, binary) agree with each other and with TP=1; prompt_logprobs layout; greedy next
    token; validation; then SIGTERM stops every worker and the server exits 0."""
    engine = Engine(Config(model=str(odd_vocab), device="cpu"))
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 301, 60)
    cand = rng.integers(0, 301, (59 - 10, 5))
    ref = engine.run_to_completion([ScoreRequest("x", toks, 10, cand, prompt_logprobs=2, max_tokens=1)])[0]
    s = Serve(odd_vocab)
    try:
        s.wait_ready()
        workers = s.workers()
        assert len(workers) == 1  # one worker process: rank 1
        with httpx.Client(base_url=s.url, timeout=120) as c:
            as_list = c.post(GEN, json=body(toks, cand, 10, max_tokens=1, prompt_logprobs=2)).json()
            as_npy = c.post(GEN, json=body(toks, None, 10, prompt_logprob_token_ids=npy_b64(cand.astype(np.int32))))
            flat = c.post(GEN, json=body(toks, [0, 150, 151, 300], 10)).json()
            got = decode(as_list["prompt_token_id_logprobs"])
            np.testing.assert_allclose(got, ref.token_id_logprobs, rtol=0, atol=TOL)
            np.testing.assert_allclose(decode(as_npy.json()["prompt_token_id_logprobs"]), got, rtol=0, atol=TOL)  # the second hits the cache
            assert decode(flat["prompt_token_id_logprobs"]).shape == (49, 4)
            assert as_list["choices"][0]["token_ids"] == [ref.next_token]
            plp = as_list["prompt_logprobs"]
            assert len(plp) == 60 and plp[0] is None
            first = plp[5]
            assert int(next(iter(first))) == int(toks[5])  # the actual token first
            assert_error(c.post(GEN, json=body(toks, [301], 10)), 400)
            assert c.get("/v1/models").status_code == 200
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        assert wait_gone(workers, 20), "a worker outlived the server"
    finally:
        s.stop()


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has an empty cmdline)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.time() + timeout
    while any(running(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(running(p) for p in pids)


def test_workers_exit_when_the_server_is_killed(odd_vocab: Path) -> None:
    """No orphans: SIGKILL to the server (no shutdown code runs) and its worker still exits."""
    s = Serve(odd_vocab)
    try:
        s.wait_ready()
        workers = s.workers()
        assert workers
        s.proc.kill()
        s.proc.wait()
        assert wait_gone(workers, 20), "a worker outlived the killed server"
    finally:
        s.stop()


def test_killed_worker_makes_the_process_exit_non_zero(odd_vocab: Path) -> None:
    s = Serve(odd_vocab)
    try:
        s.wait_ready()
        (worker,) = s.workers()
        os.kill(worker, signal.SIGKILL)
        assert s.proc.wait(60) == 3  # the engine-failure exit code, within a bounded time
    finally:
        s.stop()


def test_a_hung_worker_does_not_keep_the_server_from_exiting(odd_vocab: Path) -> None:
    """A worker stopped mid-request (SIGSTOP: a hang, no exit) holds the engine's thread in a
    collective. The request still gets its answer by its deadline (504), SIGTERM still ends the
    server in bounded time (the stuck engine's workers are killed), and no worker outlives it."""
    s = Serve(odd_vocab, "--request-timeout-s", "3", "--shutdown-timeout-s", "2")
    try:
        s.wait_ready()
        (worker,) = s.workers()
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(s.url + GEN, json=body(range(1, 200), [1, 2]), timeout=60)
        assert r.status_code == 504 and time.monotonic() - t0 < 15, (r.status_code, r.text[:200])
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(60)
        assert time.monotonic() - t0 < 45
        assert wait_gone([worker], 20), "the stopped worker outlived the server"
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
        s.stop()


def test_a_stuck_worker_turns_health_503_within_the_bound_and_the_server_exits(odd_vocab: Path) -> None:
    """A worker stopped mid-request (SIGSTOP) holds rank 0 in a collective: no step completes.
    Past ``stall_timeout_s`` the engine is failed: ``/health`` 503 (it was 200 for the whole
    collective timeout before), the request answered 503 with Retry-After, and the process
    exits with code 3 on its own (no signal), its workers gone."""
    bound = 3.0
    s = Serve(odd_vocab, "--stall-timeout-s", str(bound), "--shutdown-timeout-s", "2")
    worker = None
    try:
        s.wait_ready()
        (worker,) = s.workers()
        os.kill(worker, signal.SIGSTOP)
        out: list[httpx.Response] = []
        t0 = time.monotonic()
        poster = threading.Thread(target=lambda: out.append(httpx.post(s.url + GEN, json=body(range(1, 200), [1, 2]),
                                                                        timeout=60)))
        poster.start()
        health = []
        while time.monotonic() - t0 < bound + 10:
            try:
                code = httpx.get(s.url + "/health", timeout=2).status_code
            except httpx.HTTPError:  # (the server has begun to exit)
                break
            health.append((round(time.monotonic() - t0, 2), code))
            if code == 503:
                break
            time.sleep(0.1)
        assert health and health[-1][1] == 503 and health[-1][0] < bound + 2.5, health
        print(f"stuck worker: /health 503 {health[-1][0]:.1f}s after the request (stall_timeout_s={bound:g})")
        poster.join(30)
        assert out and out[0].status_code == 503 and "Retry-After" in out[0].headers, out
        assert "no step completed" in out[0].json()["error"]["message"]
        assert s.proc.wait(60) == 3
        assert time.monotonic() - t0 < 60
        print(f"stuck worker: the server exited 3, {time.monotonic() - t0:.1f}s after the request")
        assert wait_gone([worker], 20), "the stopped worker outlived the server"
    finally:
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        s.stop()


def test_killed_worker_makes_health_503(odd_vocab: Path, caplog) -> None:
    """In process, with the fatal hook recorded instead of exiting: /health stays 503 and
    requests get 503, mid-request too."""
    fired = threading.Event()
    cfg = Config(model=str(odd_vocab), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16)
    with LiveServer(cfg, on_fatal=fired.set) as srv, srv.client() as c:
        pids = srv.app.state.engine.worker_pids
        os.kill(pids[0], signal.SIGKILL)
        assert fired.wait(30)
        assert_error(c.get("/health"), 503)
        # the log names the worker's exit code (reaped before it is read)
        assert any(f"exited (code {-signal.SIGKILL})" in r.getMessage() for r in caplog.records)
        assert_error(c.post(GEN, json=body(range(20), [1, 2])), 503)


# --- GPU (two GPUs: NCCL, the CUDA kernels, cuDNN attention) -----------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize(("family", "dtype", "tol"), [("qwen3hd128", "float32", 1e-4), ("qwen3hd128", "bfloat16", None),
                                                 ("qwen3moe", "float32", 1e-4)])
def test_gpu_tp2_equals_tp1(family: str, dtype: str, tol: float | None, checkpoints) -> None:
    """TP=2 on two GPUs against TP=1 on one, same requests: float32 (sdpa, no fused kernels)
    within 1e-4; bfloat16 (the served path) within bf16 rounding of the partial sums."""
    one, _ = run(checkpoints[family], 1, device="cuda", dtype=dtype, max_model_len=1024)
    two, _ = run(checkpoints[family], 2, device="cuda", dtype=dtype, max_model_len=1024)
    if tol is not None:
        assert_same_within(one, two, tol)
        return
    diffs = [np.abs(x.token_id_logprobs - y.token_id_logprobs)[np.isfinite(x.token_id_logprobs)]
             for x, y in zip(one, two, strict=True)]
    d = np.concatenate(diffs)
    print(f"bf16 TP2 vs TP1: mean abs {d.mean():.2e}, max {d.max():.2e}")
    assert d.mean() < 2e-2 and d.max() < 0.25, (d.mean(), d.max())


def assert_same_within(a: list[ScoreResult], b: list[ScoreResult], tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        fin = np.isfinite(x.token_id_logprobs)
        np.testing.assert_array_equal(fin, np.isfinite(y.token_id_logprobs))
        np.testing.assert_allclose(y.token_id_logprobs[fin], x.token_id_logprobs[fin], rtol=0, atol=tol)
        if x.plp_topk_logprobs is not None:
            np.testing.assert_allclose(y.plp_topk_logprobs, x.plp_topk_logprobs, rtol=0, atol=tol)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tp2_comm_parts(dtype: str, checkpoints, monkeypatch) -> None:
    """NCCL on two GPUs (the GPU-sized head dim): the o and down products in parts, each part's
    all-reduce on the communicator's stream under the next part's GEMM, against one part and
    TP1: float32 within 1e-4; bfloat16 within bf16 rounding of the partial sums."""
    out, made = comm_parts_runs(checkpoints["qwen3hd128"], monkeypatch, device="cuda", dtype=dtype)
    assert made == [2996, 2996]
    if dtype == "float32":
        assert_same_within(out[2, 1], out[2, 3], 1e-4)
        assert_same_within(out[1, 3], out[2, 3], 1e-4)
        return
    for ref in (out[2, 1], out[1, 3]):
        d = np.concatenate([np.abs(x.token_id_logprobs - y.token_id_logprobs)[np.isfinite(x.token_id_logprobs)]
                            for x, y in zip(ref, out[2, 3], strict=True)])
        assert d.mean() < 2e-2 and d.max() < 0.25, (d.mean(), d.max())


def test_a_process_that_never_closes_its_parallel_llm_still_exits(odd_vocab: Path) -> None:
    """An in-process ``LLM`` at TP2 whose script ends without closing it: its worker ignores
    multiprocessing's SIGTERM at exit and waited on its pipe, so the process hung for ever; the
    workers are now closed at exit. ``with LLM(...)`` closes them at the block's end."""
    import subprocess
    import sys

    child = (
        "import sys, multiprocessing as mp\n"
        "from teacher_server import LLM, SamplingParams, TokensPrompt\n"
        "if __name__ == '__main__':\n"
        "    kw = dict(device='cpu', tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64, block_size=8)\n"
        "    sp = SamplingParams(max_tokens=1, prompt_logprob_token_ids=[7, 8], prompt_logprob_start=2)\n"
        "    with LLM(sys.argv[1], **kw) as llm:\n"
        "        llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5, 6]), sp)\n"
        "    assert not mp.active_children()\n"
        "    llm = LLM(sys.argv[1], **kw)\n"
        "    out = llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5, 6]), sp)\n"
        "    print('scored', out[0].prompt_token_id_logprobs.shape, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", child, str(odd_vocab)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "scored (3, 2)" in done.stdout, done.stderr[-2000:]
