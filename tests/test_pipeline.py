"""The pipelined engine (step N+1 launched before step N completes) gives the results of
the sequential one, and aborts / failures of a step in flight are answered exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest


def engine(tmp_path, pipeline: bool, **kw) -> Engine:  # noqa: ANN001
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


def test_pipelined_equals_sequential(tmp_path) -> None:  # noqa: ANN001
    seq = engine(tmp_path, False).run_to_completion(requests())
    eng = engine(tmp_path, True)
    pip = eng.run_to_completion(requests())
    assert eng.timing["steps"] > 5  # several steps, so several were in flight together
    for a, b in zip(seq, pip):
        assert a.error is None and b.error is None
        np.testing.assert_allclose(b.token_id_logprobs, a.token_id_logprobs, atol=1e-5)
        assert a.next_token == b.next_token
    assert sum(r.cached_tokens for r in pip) > 0
    assert eng.blocks.num_used == 0 and not eng.seqs and not eng.has_unfinished()


def test_abort_while_last_step_in_flight(tmp_path) -> None:  # noqa: ANN001
    eng = engine(tmp_path, True)
    reqs = requests(1)
    for r in reqs:
        eng.add_request(r)
    seen: dict[str, int] = {}
    first = eng.step()  # completes step 1, step 2 is in flight
    for r in first:
        seen[r.request_id] = seen.get(r.request_id, 0) + 1
    inflight = [c.seq.request_id for c in eng._inflight.chunks]
    victim = inflight[0]
    aborted = eng.abort_request(victim)
    assert aborted is not None and aborted.error_kind == "cancelled"
    seen[victim] = seen.get(victim, 0) + 1
    while eng.has_unfinished():
        for r in eng.step():
            seen[r.request_id] = seen.get(r.request_id, 0) + 1
            assert r.error is None
    assert seen == {r.request_id: 1 for r in reqs}  # every request answered exactly once
    assert eng.blocks.num_used == 0


@pytest.mark.parametrize("pipeline", [True, False])
def test_launch_failure_fails_only_that_step(tmp_path, pipeline: bool) -> None:  # noqa: ANN001
    eng = engine(tmp_path, pipeline, max_num_seqs=1)
    orig = eng.runner.execute
    poison = 4095

    def execute(hs, *rest):  # noqa: ANN001, ANN002, ANN202
        if poison in hs.ints["input_ids"].tolist():
            raise RuntimeError("injected step failure")
        return orig(hs, *rest)

    eng.runner.execute = execute
    good = [ScoreRequest(f"g{i}", np.arange(1, 40) + i, 3, np.array([5, 6])) for i in range(4)]
    bad = ScoreRequest("bad", np.array([1, 2, poison, 3]), 0, np.array([5]))
    for r in good[:2] + [bad] + good[2:]:
        eng.add_request(r)
    out = {}
    while eng.has_unfinished():
        for r in eng.step():
            assert r.request_id not in out
            out[r.request_id] = r
    assert out["bad"].error_kind == "internal" and "inference failed" in out["bad"].error
    alone = engine(tmp_path, False).run_to_completion([ScoreRequest("x", np.arange(1, 40), 3, np.array([5, 6]))])
    assert all(out[g.request_id].error is None for g in good)
    np.testing.assert_allclose(out["g0"].token_id_logprobs, alone[0].token_id_logprobs, atol=1e-5)
    assert eng.blocks.num_used == 0


def test_next_step_launches_after_the_current_one_is_half_done(tmp_path) -> None:  # noqa: ANN001
    """The launch of step N+1 waits for step N's mid-forward event (on CUDA, a wait without
    the GIL), so the GPU launch queue never holds more than half a step ahead."""
    eng = engine(tmp_path, True)
    events: list[str] = []
    orig = eng.runner.launch

    class Mid:
        def __init__(self, n: int) -> None:
            self.n = n

        def synchronize(self) -> None:
            events.append(f"half{self.n}")

    def launch(hs, on_first_wait=None):  # noqa: ANN001, ANN202
        n = sum(1 for e in events if e.startswith("launch"))
        events.append(f"launch{n}")
        p = orig(hs, on_first_wait)
        p.mid = Mid(n)
        return p

    eng.runner.launch = launch
    res = eng.run_to_completion(requests(2))
    assert all(r.error is None for r in res)
    launches = [e for e in events if e.startswith("launch")]
    assert len(launches) > 3
    for i in range(1, len(launches)):  # launch i comes after step i-1 reached its half
        assert events.index(f"half{i - 1}") < events.index(f"launch{i}")


def test_forward_keeps_the_host_a_bounded_number_of_layers_ahead(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Within a forward the host waits for layer i - ahead before launching layer i, so at
    most ``ahead`` layers are ever queued past the last one known finished; results equal
    the unpaced forward. (Events are stand-ins: the pacing logic is the same on CUDA.)"""
    import torch

    from teacher_server.model import context

    log: list[tuple[str, int]] = []

    class FakeEvent:
        made = 0

        def __init__(self, enable_timing: bool = False) -> None:
            self.i = FakeEvent.made
            FakeEvent.made += 1

        def record(self) -> None:
            log.append(("record", self.i))

        def synchronize(self) -> None:
            log.append(("sync", self.i))

        def query(self) -> bool:  # the GPU is always behind here: no idle gaps
            return False

    monkeypatch.setattr(context.torch.cuda, "Event", FakeEvent)
    eng = engine(tmp_path, False)
    runner = eng.runner
    n_layers = runner.spec.num_layers
    assert n_layers >= 3
    ahead = 2
    reqs = requests(3)[:3]
    for r in reqs:
        eng.add_request(r)
    hs = runner.prepare(eng.scheduler.schedule())
    pacer = context.LaunchPacer(ahead, on_first_wait=lambda: log.append(("hook", -1)))
    paced = runner.execute(hs, pacer)
    plain = runner.execute(hs)
    torch.testing.assert_close(paced.scores, plain.scores, rtol=0, atol=0)
    assert [e for e in log if e[0] == "record"] == [("record", i) for i in range(n_layers)]
    assert [e for e in log if e[0] == "sync"] == [("sync", i) for i in range(n_layers - ahead)]
    hook = log.index(("hook", -1))  # once, right before the first wait, after `ahead` layers were queued
    assert log.count(("hook", -1)) == 1 and log[hook + 1] == ("sync", 0) and ("record", ahead - 1) in log[:hook]
    assert pacer.idle_gaps == []
    for pos, (kind, i) in enumerate(log):  # layer i + ahead is launched only after layer i's wait
        if kind == "sync":
            assert ("record", i + ahead) not in log[:pos]
            assert ("record", i + ahead - 1) in log[:pos]
    assert pacer.mid is pacer.events[n_layers // 2]


def test_pacer_notes_when_the_gpu_ran_dry(monkeypatch) -> None:  # noqa: ANN001
    """Before a layer, an already finished last event means nothing is queued: the pacer
    records a mark there, and the (last event, mark) pair is the GPU's idle gap."""
    from teacher_server.model import context

    class Ev:
        def __init__(self, enable_timing: bool = False) -> None:
            self.done = False

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            self.done = True

        def query(self) -> bool:
            return self.done

    monkeypatch.setattr(context.torch.cuda, "Event", Ev)
    pacer = context.LaunchPacer(ahead=2)
    for i in range(5):
        pacer.before_layer(i)
        pacer.after_layer()
        if i == 1:
            pacer.events[-1].done = True  # the GPU caught up with the host after layer 1
    # before layer 2: layer 1 already done (a gap); before layers 3, 4: waits make earlier layers
    # done, but the last recorded one (2, 3) is still running: no gap
    assert len(pacer.idle_gaps) == 1 and pacer.idle_gaps[0][0] is pacer.events[1]


def test_previous_step_completes_inside_the_next_launch(tmp_path) -> None:  # noqa: ANN001
    """Pipelined: step N is completed (and, with ``deliver``, its results handed over) when
    the launch of N+1 first waits for the GPU, not after that launch returns. An error in
    ``deliver`` comes out of ``step`` and does not fail the step being launched."""
    order: list[str] = []

    def paced(eng: Engine) -> Engine:
        orig_launch, orig_complete = eng.runner.launch, eng._complete

        def launch(hs, on_first_wait=None):  # noqa: ANN001, ANN202
            order.append("launch-start")
            if on_first_wait is not None:
                on_first_wait()  # what LaunchPacer does before its first wait on CUDA
            p = orig_launch(hs)
            order.append("launch-end")
            return p

        def complete(cur):  # noqa: ANN001, ANN202
            order.append("complete")
            return orig_complete(cur)

        eng.runner.launch, eng._complete = launch, complete
        return eng

    eng = paced(engine(tmp_path, True))
    delivered: list[str] = []
    reqs = requests(4)
    for r in reqs:
        eng.add_request(r)
    returned: list[str] = []
    while eng.has_unfinished():
        returned += [r.request_id for r in eng.step(deliver=lambda rs: delivered.extend(x.request_id for x in rs))]
    assert sorted(delivered + returned) == sorted(r.request_id for r in reqs) and delivered
    # after the first launch, every launch-start is followed by the completion of the step before
    for i, e in enumerate(order[:-1]):
        if e == "launch-start" and i > 0:
            assert order[i + 1] == "complete", order

    eng2 = paced(engine(tmp_path, True))
    for r in requests(5):
        eng2.add_request(r)

    def bad(rs):  # noqa: ANN001, ANN202
        raise RuntimeError("deliver failed")

    with pytest.raises(RuntimeError, match="deliver failed"):
        while eng2.has_unfinished():
            eng2.step(deliver=bad)
    assert eng2._inflight is not None and not eng2._failed  # the step launched meanwhile is fine
