"""The pipelined engine (step N+1 launched before step N completes) gives the results of
the sequential one, and aborts / failures of a step in flight are answered exactly once.
The launch pacer runs here on the CPU with stand-in CUDA events: its waits, the hand-off
of the previous step at the first wait, and the half-step launch order are the CUDA ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_util import FakeEvents, around_forward, fail_on_token

from teacher_server.config import Config
from teacher_server.engine import pacer as pacer_mod
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind, ScoreRequest


def engine(tmp_path: Path, pipeline: bool, **kw: object) -> Engine:
    return Engine(Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_num_batched_tokens=64,
                         num_kv_blocks=256, max_model_len=2048, pipeline=pipeline, **kw))


def requests(seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 4096, 80)
    out = []
    for i in range(12):  # GRPO-like groups (shared prompts: cache hits across steps) and loners
        toks = np.concatenate([prompt, rng.integers(0, 4096, int(rng.integers(5, 150)))]) if i % 3 else \
            rng.integers(0, 4096, int(rng.integers(1, 200)))
        out.append(ScoreRequest(f"p{i}", toks, 80 if i % 3 else 0, rng.choice(4096, 8, replace=False)))
    return out


def paced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline: bool, ahead: int) -> tuple[Engine, list]:
    """An engine whose forwards are paced as on CUDA, with stand-in events; the log holds
    ("record" | "sync", event) and ("fwd_start" | "fwd_end", None) in order."""
    log: list = []
    monkeypatch.setattr(pacer_mod.torch.cuda, "Event", FakeEvents(log).Event)
    eng = engine(tmp_path, pipeline)
    eng.tuning = replace(eng.tuning, run_ahead=ahead)
    around_forward(eng, before=lambda ctx: log.append(("fwd_start", None)),
                   after=lambda ctx: log.append(("fwd_end", None)))
    return eng, log


def answers(eng: Engine) -> dict:
    """Step until nothing is left: each request's result by id, every request answered once."""
    out = {}
    while eng.has_unfinished():
        for r in eng.step():
            assert r.request_id not in out
            out[r.request_id] = r
    return out


def forwards(log: list) -> list[tuple[int, int, list]]:
    """(start index, end index, layer events recorded inside) of each forward in the log."""
    starts = [i for i, (k, _) in enumerate(log) if k == "fwd_start"]
    ends = [i for i, (k, _) in enumerate(log) if k == "fwd_end"]
    assert len(starts) == len(ends)
    return [(a, b, [e for k, e in log[a:b] if k == "record"]) for a, b in zip(starts, ends)]


def test_pipelined_equals_sequential(tmp_path: Path) -> None:
    seq = engine(tmp_path, False).run_to_completion(requests())
    eng = engine(tmp_path, True)
    pip = eng.run_to_completion(requests())
    assert eng.stats().steps > 5  # several steps, so several were in flight together
    for a, b in zip(seq, pip):
        assert a.error is None and b.error is None
        np.testing.assert_allclose(b.token_id_logprobs, a.token_id_logprobs, atol=1e-5)
        assert a.next_token == b.next_token
    assert sum(r.cached_tokens for r in pip) > 0
    stats = eng.stats()
    assert stats.kv_blocks_used == 0 and stats.active_requests == 0 and not eng.has_unfinished()


def test_abort_while_last_step_in_flight(tmp_path: Path) -> None:
    eng = engine(tmp_path, True)
    reqs = requests(1)
    for r in reqs:
        eng.add_request(r)
    first, second = eng.launch(), eng.launch()  # two steps in flight, as when pipelined
    assert second.done, "the second step finishes some request"
    victim = second.done[0].req
    aborted = eng.abort_request(victim.uid)
    assert aborted is not None and aborted.error_kind == ErrorKind.CANCELLED
    seen = {victim.uid: 1}
    for r in eng.complete(first) + eng.complete(second):
        seen[r.uid] = seen.get(r.uid, 0) + 1
        assert r.error is None
    while eng.has_unfinished():
        for r in eng.step():
            seen[r.uid] = seen.get(r.uid, 0) + 1
            assert r.error is None
    assert seen == {r.uid: 1 for r in reqs}  # every request answered exactly once
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("pipeline", [True, False])
def test_launch_failure_fails_only_that_step(tmp_path: Path, pipeline: bool) -> None:
    eng = engine(tmp_path, pipeline, max_num_seqs=1)
    poison = 4095
    fail_on_token(eng, poison, lambda: RuntimeError("injected step failure"))
    good = [ScoreRequest(f"g{i}", np.arange(1, 40) + i, 3, np.array([5, 6])) for i in range(4)]
    bad = ScoreRequest("bad", np.array([1, 2, poison, 3]), 0, np.array([5]))
    for r in good[:2] + [bad] + good[2:]:
        eng.add_request(r)
    out = answers(eng)
    assert out["bad"].error_kind == ErrorKind.INTERNAL and "inference failed" in out["bad"].error
    alone = engine(tmp_path, False).run_to_completion([ScoreRequest("x", np.arange(1, 40), 3, np.array([5, 6]))])
    assert all(out[g.request_id].error is None for g in good)
    np.testing.assert_allclose(out["g0"].token_id_logprobs, alone[0].token_id_logprobs, atol=1e-5)
    assert eng.stats().kv_blocks_used == 0


def test_a_failure_completing_a_step_inside_the_next_launch_fails_only_its_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paced as on CUDA, step N is completed inside step N+1's launch, after N+1 was scheduled.
    A non-fatal error there fails N's requests, among them a long one that N+1 continues: N+1's
    bookkeeping must leave that aborted sequence alone (it once raised IndexError on its freed
    block table and took the engine down), the others are scored, and nothing leaks."""
    eng, _ = paced(tmp_path, monkeypatch, True, 1)
    eng.tuning = replace(eng.tuning, token_budget=16)
    calls = {"n": 0}
    scatter = eng.runner.scatter_results

    def failing_once(layout, out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("injected failure completing a step")
        return scatter(layout, out)

    eng.runner.scatter_results = failing_once
    rng = np.random.default_rng(0)
    long = ScoreRequest("long", rng.integers(0, 4096, 64), 50, rng.choice(4096, 3, replace=False))
    eng.add_request(long)
    out = answers(eng)
    assert calls["n"] >= 2 and out["long"].error_kind == ErrorKind.INTERNAL
    assert eng.stats().kv_blocks_used == 0 and eng.stats().active_requests == 0
    after = ScoreRequest("after", rng.integers(0, 4096, 40), 5, rng.choice(4096, 3, replace=False))
    got = eng.run_to_completion([after])[0]
    want = engine(tmp_path, False).run_to_completion([after])[0]
    assert got.error is None
    np.testing.assert_allclose(got.token_id_logprobs, want.token_id_logprobs, atol=1e-5)
    assert eng.stats().kv_blocks_used == 0


def test_forward_keeps_the_host_a_bounded_number_of_layers_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a forward the host waits for layer i - ahead before launching layer i, so at
    most ``ahead`` layers are ever queued past the last one known finished; results equal
    the unpaced engine's."""
    ahead = 2
    eng, log = paced(tmp_path, monkeypatch, False, ahead)
    n_layers = eng.spec.num_layers
    assert n_layers > ahead
    got = eng.run_to_completion(requests(3))
    want = engine(tmp_path, False).run_to_completion(requests(3))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.token_id_logprobs, b.token_id_logprobs, rtol=0, atol=1e-6)
    fw = forwards(log)
    assert len(fw) == eng.stats().steps > 2
    for a, b, layers in fw:
        assert len(layers) == n_layers  # one event per layer (the GPU is never idle here: no marks)
        own = [(pos, e) for pos, (k, e) in enumerate(log[a:b], a) if k == "sync" and e in layers]
        assert [layers.index(e) for _, e in own] == list(range(n_layers - ahead))
        for pos, e in own:  # layer i + ahead is launched only after layer i's wait
            i = layers.index(e)
            assert ("record", layers[i + ahead - 1]) in log[a:pos]
            assert ("record", layers[i + ahead]) not in log[a:pos]


def test_next_step_launches_after_the_current_one_is_half_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch of step N+1 waits for step N's mid-forward event (on CUDA, a wait without
    the GIL), so the GPU launch queue never holds more than half a step ahead."""
    eng, log = paced(tmp_path, monkeypatch, True, ahead=2)
    res = eng.run_to_completion(requests(2))
    assert all(r.error is None for r in res)
    fw = forwards(log)
    assert len(fw) > 3
    for (a0, b0, layers), (a1, _, _) in zip(fw, fw[1:]):
        mid = layers[len(layers) // 2]
        assert ("sync", mid) not in log[a0:b0]  # its own pacer does not wait for it
        assert ("sync", mid) in log[b0:a1]  # the engine does, before launching the next step


def test_previous_step_completes_inside_the_next_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined: step N is completed (and, with ``deliver``, its results handed over) when
    the launch of N+1 first waits for the GPU, not after that launch returns. An error in
    ``deliver`` comes out of ``step`` and does not fail the step being launched."""
    eng, log = paced(tmp_path, monkeypatch, True, ahead=2)
    reqs = requests(4)
    for r in reqs:
        eng.add_request(r)
    delivered: list[int] = []

    def deliver(rs: list) -> None:
        log.append(("deliver", None))
        delivered.extend(r.uid for r in rs)

    returned: list[int] = []
    while eng.has_unfinished():
        returned += [r.uid for r in eng.step(deliver=deliver)]
    assert sorted(delivered + returned) == sorted(r.uid for r in reqs) and delivered
    fw = forwards(log)
    assert len(fw) > 3
    for a, b, layers in fw[1:]:  # every launch after the first hands off the step before it
        first_wait = next(pos for pos, (k, e) in enumerate(log[a:b], a) if k == "sync" and e in layers)
        assert [k for k, _ in log[a:first_wait]].count("deliver") == 1

    eng2, _ = paced(tmp_path, monkeypatch, True, ahead=2)
    reqs2 = requests(5)
    for r in reqs2:
        eng2.add_request(r)
    lost: list[int] = []

    def bad(rs: list) -> None:
        lost.extend(r.uid for r in rs)
        raise RuntimeError("deliver failed")

    done: list = []
    with pytest.raises(RuntimeError, match="deliver failed"):
        while eng2.has_unfinished():
            done += eng2.step(deliver=bad)
    assert eng2.has_unfinished()  # the step launched meanwhile is in flight, not failed
    while eng2.has_unfinished():
        done += eng2.step()
    assert all(r.error is None for r in done)
    assert sorted([r.uid for r in done] + lost) == sorted(r.uid for r in reqs2)


def test_pacer_notes_when_the_gpu_ran_dry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a layer, an already finished last event means nothing is queued: the pacer
    records a mark there, and the (last event, mark) pair is the GPU's idle gap."""

    class Ev:
        def __init__(self, enable_timing: bool = False) -> None:
            self.done = False

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            self.done = True

        def query(self) -> bool:
            return self.done

    monkeypatch.setattr(pacer_mod.torch.cuda, "Event", Ev)
    pacer = pacer_mod.LaunchPacer(ahead=2)
    for i in range(5):
        pacer.before_layer(i)
        pacer.after_layer()
        if i == 1:
            pacer.events[-1].done = True  # the GPU caught up with the host after layer 1
    # before layer 2: layer 1 already done (a gap); before layers 3, 4: waits make earlier layers
    # done, but the last recorded one (2, 3) is still running: no gap
    assert len(pacer.idle_gaps) == 1 and pacer.idle_gaps[0][0] is pacer.events[1]


def test_gpu_timeline_of_a_paced_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pacer's events feed the engine's GPU time: each step's span (1 ms per stand-in
    event pair) counts as busy, the gap to the step launched behind it as idle."""
    eng, _ = paced(tmp_path, monkeypatch, True, ahead=2)
    eng.run_to_completion(requests(6))
    s = eng.stats()
    assert s.steps > 2
    assert s.timing.gpu_s == pytest.approx(s.steps * 1e-3)
    # steps launched behind another (all but the first, when pipelined) wait 1 ms for it
    assert 1e-3 - 1e-9 <= s.timing.gpu_idle_s <= (s.steps - 1) * 1e-3 + 1e-9


def test_step_trace_has_a_line_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_trace``: one JSON line per step (the warm-up's not traced), whose tokens and
    scored rows add up to the work done, with the pacer's GPU time."""
    import json

    log: list = []
    monkeypatch.setattr(pacer_mod.torch.cuda, "Event", FakeEvents(log).Event)
    path = tmp_path / "steps.jsonl"
    eng = engine(tmp_path, True, step_trace=str(path), warm_up=True)
    eng.tuning = replace(eng.tuning, run_ahead=2)
    assert eng.warm_up_s > 0 and eng.stats().steps == 0  # it ran; the counters start after it
    reqs = requests(4)
    eng.run_to_completion(reqs)
    eng.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    s = eng.stats()
    assert [x["step"] for x in lines] == list(range(1, s.steps + 1)) and s.steps > 3
    assert sum(x["tokens"] for x in lines) == s.computed_tokens
    assert sum(x["scored_rows"] for x in lines) == sum(r.rows for r in reqs)
    assert any(x["continuing"] for x in lines) and any(x["unfinished"] for x in lines)  # chunked at 64 tokens
    assert all(x["gpu_ms"] == 1.0 for x in lines)  # the stand-in events' span
    assert [x["at"] for x in lines] == sorted(x["at"] for x in lines)
    first = min(r.arrival for r in reqs)
    assert all(x["arrived"][0] <= x["arrived"][1] <= x["clock"][0] for x in lines)  # arrived before its step began
    assert lines[0]["arrived"][0] == round(first, 4)  # the first step holds the first request


def test_a_step_trace_that_cannot_be_written_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step_trace: cannot append to .*missing"):
        engine(tmp_path, True, step_trace=str(tmp_path / "missing" / "steps.jsonl"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_step_trace_that_fails_to_write_stops_tracing_not_the_engine(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A trace write that fails (a full disk: /dev/full) turns the trace off with a warning;
    the steps and their results go on."""
    eng = engine(tmp_path, True, step_trace="/dev/full")
    results = eng.run_to_completion(requests(5))
    assert all(r.error is None for r in results) and eng.stats().steps > 3
    assert sum("no more steps are traced" in r.getMessage() for r in caplog.records) == 1
