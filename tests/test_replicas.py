"""Replicas: ``--data-parallel-size 2`` behind one port (processes on the CPU), and the client
over several single-replica servers. Results must equal one replica's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import types

import httpx
import numpy as np
import pytest
from conftest import LiveServer, wait_until

from teacher_server.client import AsyncTeacherClient, TeacherClient, TeacherRequest
from teacher_server.config import Config
from teacher_server.replicas.preload import process_state

BLOCK = 8
TOL = 2e-5


def _cfg(ckpt, **kw) -> Config:
    # no queue-wait refusals (429): the rate they estimate counts a stalled or restarting replica's time, and
    # on a loaded 2-core machine it once refused a request these tests send with no retries
    kw.setdefault("max_queue_wait_s", None)
    return Config(model=str(ckpt), device="cpu", max_num_batched_tokens=1024, block_size=BLOCK, num_kv_blocks=1024,
                  max_model_len=1024, max_logprobs=16, **kw)


def _groups(seed: int, n_groups: int, n: int, prompt: tuple[int, int] = (40, 72),
            response: tuple[int, int] = (4, 40)) -> list[list[TeacherRequest]]:
    """GRPO-shaped requests: n responses of varied length per prompt, scored after the prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_groups):
        p = rng.integers(0, 512, int(rng.integers(*prompt)))
        group = []
        for _ in range(n):
            toks = np.concatenate([p, rng.integers(0, 512, int(rng.integers(*response)))])
            group.append(TeacherRequest(toks, rng.integers(0, 512, (len(toks) - len(p), 4)), len(p) - 1))
        out.append(group)
    return out


def _metric(url: str, name: str) -> dict[str, float]:
    """replica label (or "") -> value of a counter series."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            rep = [p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("replica=")]
            out[rep[0] if rep else ""] = float(value)
    return out


def _score_groups_in_order(client: TeacherClient, groups: list[list[TeacherRequest]]) -> list[list]:
    """Each group's members one after another, so every member after the first finds the
    prompt cached when it reached the replica that holds it."""
    return [[client.score_full(r.token_ids, r.candidates, r.start) for r in g] for g in groups]


def _check_cached_and_equal(outs: list[list], groups: list[list[TeacherRequest]], ref: list[np.ndarray]) -> None:
    flat = [o for g in outs for o in g]
    for o, want in zip(flat, ref):
        np.testing.assert_allclose(o.scores, want, atol=TOL, rtol=0)
    for g, reqs in zip(outs, groups):
        full = (reqs[0].start // BLOCK) * BLOCK
        assert all(o.cached_tokens >= full for o in g[1:]), [o.cached_tokens for o in g]


@pytest.fixture(scope="module")
def single(checkpoints):
    with LiveServer(_cfg(checkpoints["qwen3"])) as s:
        yield s


@pytest.fixture(scope="module")
def reference(single):
    """One replica's results, by request (the groups of the tests below)."""
    def score(reqs: list[TeacherRequest]) -> list[np.ndarray]:
        with TeacherClient(single.url) as c:
            return c.score_batch(reqs)
    return score


def test_two_replicas_keep_groups_together_and_match_one(checkpoints, reference, tmp_path) -> None:
    groups = _groups(0, 8, 4)
    ref = reference([r for g in groups for r in g])
    trace = tmp_path / "steps.jsonl"
    with LiveServer(_cfg(checkpoints["qwen3"], data_parallel_size=2, step_trace=str(trace))) as s, \
            TeacherClient(s.url) as c:
        assert httpx.get(s.url + "/health").json() == {"status": "ready"}
        _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)
        # the groups were spread: both replicas looked prompts up (metrics per replica)
        wait_until(lambda: all(v > 0 for v in _metric(s.url, "teacher_server_prefix_cache_queries_total").values()))
        assert set(_metric(s.url, "teacher_server_prefix_cache_hits_total")) == {"0", "1"}
    # both replicas traced their steps into the one file, whole lines each
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len({x["pid"] for x in lines}) == 2
    # each step's requests' way in, on the server's clock across the processes: handled, body whole, parsed,
    # queued in the replica for its engine thread
    for x in lines:
        for end in (0, 1):
            assert x["received"][end] <= x["read"][end] <= x["arrived"][end] <= x["handed"][end] <= x["clock"][0], x
    assert sum(x["scored_rows"] for x in lines) == sum(len(r.token_ids) - 1 - r.start for g in groups for r in g)


def test_round_robin_splits_groups(checkpoints) -> None:
    groups = _groups(1, 4, 2)
    with LiveServer(_cfg(checkpoints["qwen3"], data_parallel_size=2, routing="round_robin")) as s, \
            TeacherClient(s.url) as c:
        outs = _score_groups_in_order(c, groups)
    # the second member of each group went to the other replica, where the prompt was not cached
    assert all(g[1].cached_tokens == 0 for g in outs), [[o.cached_tokens for o in g] for g in outs]


def _one_of_two_replicas_fails(checkpoints, reference, reqs, victim_index: int, fail, **settings) -> tuple:
    """Score ``reqs`` over two replicas while ``fail(victim)`` (a ``Replica``) runs on a thread
    beside the batch, ``/health`` polled all along: every request is answered 200 by the server
    (no retry by the client: its retries are off) with the reference's matrix, ``/health`` is
    never 503 (degraded while the victim is down), the victim is restarted (a new process) and
    serves again, and the fatal hook never runs. Returns (the pool, the victim, seconds from the
    victim's end to its successor's ready)."""
    ref = reference(reqs)
    fatal: list[int] = []
    cfg = _cfg(checkpoints["qwen3"], data_parallel_size=2, replica_restart_backoff_s=0.5, **settings)
    health: list[tuple[int, str]] = []
    with LiveServer(cfg, on_fatal=lambda: fatal.append(1)) as s, \
            TeacherClient(s.url, max_concurrency=32, max_retries=0) as c:
        pool = s.app.state.aengine
        victim = pool.replicas[victim_index]
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=s.url, timeout=30) as h:
                while not stop.is_set():
                    r = h.get("/health")
                    health.append((r.status_code, r.json().get("status")))
                    time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        failing = threading.Thread(target=fail, args=(victim,))
        failing.start()
        try:
            outs = c.score_batch(reqs)
            failing.join()
            for got, want in zip(outs, ref, strict=True):
                np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
            wait_until(lambda: victim.state == "down", 60, "the victim's end")
            wait_until(lambda: pool.replicas[victim_index].state == "ready", 120, "the victim's restart")
            back_s = pool.replicas[victim_index].ready_at - victim.down_at
            wait_until(lambda: health and health[-1] == (200, "ready"), 10, "/health ready again")
        finally:
            stop.set()
            poller.join()
        successor = pool.replicas[victim_index]
        assert successor is not victim and successor.pid != victim.pid and pool.restarts[victim_index] == 1
        assert all(code == 200 for code, _ in health) and (200, "degraded") in health, sorted(set(health))
        assert not fatal
        statuses = {k: v for k, v in _requests_by_status(s.url).items() if v}
        assert statuses == {"200": len(reqs)}, statuses
        assert _metric(s.url, "teacher_server_healthy") == {"0": 1.0, "1": 1.0}
        assert _metric(s.url, "teacher_server_engine_restarts_total") == {str(victim_index): 1.0,
                                                                          str(1 - victim_index): 0.0}
        # the restarted replica serves: a batch spread over both is right again
        later = [r for g in _groups(9, 8, 2) for r in g]
        for got, want in zip(c.score_batch(later), reference(later), strict=True):
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        wait_until(lambda: successor.requests == 0)
        return pool, victim, back_s


def _requests_by_status(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("teacher_server_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            out[status] = out.get(status, 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_replica_killed_mid_run_loses_no_request(checkpoints, reference) -> None:
    """DP2, one replica killed under a load of 500 requests: all 500 are answered 200 with the
    right matrix (what the killed one held is sent to the other), the server stays healthy
    (degraded, never 503) and the replica is back after its restart."""
    reqs = [r for g in _groups(2, 125, 4, prompt=(10, 40), response=(2, 24)) for r in g]  # 500 small requests

    def kill(victim) -> None:
        # Kill it while it holds requests it has not answered: stop it, let the reader drain
        # any answer already in its pipe, and kill it only if some request is still unanswered
        # (else let it run on and try again), so that the retry below is certain to happen.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            wait_until(lambda: victim.requests > 0)
            os.kill(victim.pid, signal.SIGSTOP)
            held = -1
            while held != victim.requests:  # until no answer has arrived for 0.3 s
                held = victim.requests
                time.sleep(0.3)
            if held > 0:
                os.kill(victim.pid, signal.SIGKILL)
                return
            os.kill(victim.pid, signal.SIGCONT)
        os.kill(victim.pid, signal.SIGKILL)

    pool, _, back_s = _one_of_two_replicas_fails(checkpoints, reference, reqs, 1, kill)
    print(f"DP2, replica 1 killed under 500 requests: serving again {back_s:.1f}s after its end "
          f"(restart backoff 0.5 s); {pool.retried} request(s) sent to the other replica")
    assert back_s < 0.5 + 60  # its backoff, then a process start and the model's load
    assert pool.retried > 0  # what the killed replica held was sent to the other one


def test_a_stopped_replica_is_killed_and_its_requests_fail_over(checkpoints, reference) -> None:
    """A replica that stops answering without exiting (SIGSTOP: a hang, not a death) sends no
    heartbeat: after ``heartbeat_timeout_s`` it is killed, what it held is scored by the other
    replica, and it is restarted while the other serves, instead of being waited on for good."""
    reqs = [r for g in _groups(3, 40, 4, prompt=(10, 40), response=(2, 24)) for r in g]
    detected: list[float] = []

    def stop(victim) -> None:
        wait_until(lambda: victim.requests > 0)
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_until(lambda: victim.state == "down", 30, "the stopped replica's end")
        detected.append(time.monotonic() - t0)

    _, victim, _ = _one_of_two_replicas_fails(checkpoints, reference, reqs, 0, stop, heartbeat_timeout_s=2.0)
    assert "no heartbeat" in (victim.error or "")
    print(f"a SIGSTOPped replica was killed {detected[0]:.1f}s after its stop (heartbeat_timeout_s=2)")
    assert detected[0] < 2.0 + 2.0, detected  # the bound, a watch tick, and the kill's 0.5 s


HANG_MARKER = "TEACHER_TEST_HANG_MARKER"  # (spawned replicas inherit the environment)


def _engine_that_hangs_once(cfg: Config) -> object:
    """An engine factory (module level: replica processes import it) whose forward of a step
    holding token 511 never ends, in the first process to see one (a marker file records it):
    a hung GPU, once."""
    from engine_util import around_forward

    from teacher_server.engine.engine import Engine

    eng = Engine(cfg)
    marker = os.environ[HANG_MARKER]

    def hang(ctx) -> None:
        if 511 in ctx.input_ids.tolist() and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(3600)

    around_forward(eng, before=hang)
    return eng


def test_a_stalled_replica_is_restarted_and_its_requests_scored_elsewhere(checkpoints, reference, tmp_path,
                                                                          monkeypatch) -> None:
    """A replica whose engine completes no step for ``stall_timeout_s`` while it holds work (its
    heartbeats go on: only the engine is stuck) exits; what it held, the request it hung on
    too, is scored by the other replica, the server stays up (degraded, never 503) and the
    replica is restarted."""
    monkeypatch.setenv(HANG_MARKER, str(tmp_path / "hung"))
    reqs = [r for g in _groups(11, 10, 4, prompt=(10, 40), response=(2, 24)) for r in g]
    poison = TeacherRequest(np.array([5, 6, 7, 511, 8, 9]), np.array([[1, 2]] * 3), 2)
    reqs.insert(7, poison)
    ref = reference(reqs)
    # (a stall timeout the healthy replica cannot reach on a loaded 2-core machine while the other
    # restarts beside it: at 2 s it did once, and both went down)
    cfg = _cfg(checkpoints["qwen3"], data_parallel_size=2, stall_timeout_s=8.0, replica_restart_backoff_s=0.5)
    with LiveServer(cfg, engine_factory=_engine_that_hangs_once) as s, \
            TeacherClient(s.url, max_concurrency=16, max_retries=0) as c:
        pool = s.app.state.aengine
        first = list(pool.replicas)
        health: list[int] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                health.append(httpx.get(s.url + "/health", timeout=30).status_code)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            outs = c.score_batch(reqs)
            for got, want in zip(outs, ref, strict=True):
                np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
            (victim,) = [r for r in first if r.state == "down"]
            assert "code 3" in victim.error
            wait_until(lambda: pool.replicas[victim.index].state == "ready", 120, "the stalled replica's restart")
        finally:
            stop.set()
            poller.join()
        assert set(health) == {200} and pool.retried > 0 and pool.restarts[victim.index] == 1


def test_client_over_two_servers_survives_a_restart(checkpoints, single, reference) -> None:
    cfg = _cfg(checkpoints["qwen3"])
    # 16 groups: the rendezvous hash over the two URLs (b's port is new each run) gives b none of
    # them with probability 2^-16
    groups = _groups(3, 16, 3)
    ref = reference([r for g in groups for r in g])
    b = LiveServer(cfg).__enter__()
    try:
        with TeacherClient([single.url, b.url], backoff=0.05, health_interval=0.2) as c:
            _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)
            assert _metric(b.url, "teacher_server_prompt_tokens_total")[""] > 0  # b got groups of its own
            b.__exit__()
            wait_until(lambda: c.endpoints.up == [single.url])
            later = _groups(4, 4, 3)
            _check_cached_and_equal(_score_groups_in_order(c, later), later, reference([r for g in later for r in g]))
            b = LiveServer(cfg, port=b.port).__enter__()  # restarted where the client expects it
            wait_until(lambda: len(c.endpoints.up) == 2)
            _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)
            assert _metric(b.url, "teacher_server_prompt_tokens_total")[""] > 0  # back in the rotation
    finally:
        b.__exit__()


def test_async_client_over_two_servers(checkpoints, single, reference) -> None:
    reqs = [r for g in _groups(5, 6, 3) for r in g]
    ref = reference(reqs)
    with LiveServer(_cfg(checkpoints["qwen3"])) as b:
        client = AsyncTeacherClient([single.url, b.url], health_interval=0.2)
        outs = asyncio.run(client.score_batch(reqs))
        client.close()
    for got, want in zip(outs, ref, strict=True):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_replicas_of_tensor_parallel_groups(checkpoints, reference) -> None:
    """Each replica an engine of its own, here a TP group of two ranks (gloo on the CPU):
    2 x 2 processes, results equal to one single-process engine's."""
    groups = _groups(6, 4, 2)
    ref = reference([r for g in groups for r in g])
    with LiveServer(_cfg(checkpoints["qwen3"], data_parallel_size=2, tensor_parallel_size=2)) as s, \
            TeacherClient(s.url) as c:
        _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)


def _spawned_children(pid: int) -> list[int]:
    """Pids of the processes ``pid`` spawned (multiprocessing's spawn: tensor-parallel workers)."""
    from pathlib import Path

    out = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if d.name.isdigit() and ppid == pid and b"spawn_main" in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_tensor_parallel_group_fails_and_restarts_as_one_replica(checkpoints, reference) -> None:
    """DP2 x TP2: a worker of one replica's group stopped mid-run (SIGSTOP) holds that engine in a
    collective; past ``stall_timeout_s`` the replica fails as a unit (its workers killed, its
    process exits), its requests are scored by the other group, and the whole group is started
    again while the other serves."""
    reqs = [r for g in _groups(12, 15, 4, prompt=(10, 40), response=(2, 24)) for r in g]
    stopped: list[int] = []

    def stop_a_worker(victim) -> None:
        wait_until(lambda: victim.requests > 0)
        (worker,) = _spawned_children(victim.pid)
        os.kill(worker, signal.SIGSTOP)
        stopped.append(worker)

    try:
        _, victim, _ = _one_of_two_replicas_fails(checkpoints, reference, reqs, 1, stop_a_worker,
                                                  tensor_parallel_size=2, stall_timeout_s=6.0)
        assert "code 3" in victim.error  # (the new group served the batch after it: checked there)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_engine_in_a_process_of_its_own(checkpoints, reference) -> None:
    """``engine_process``: one engine, in a process of its own behind the front. Same results
    as the engine on the server's thread, prefix reuse within a group, the engine's metrics
    without a replica label; its death makes the server unhealthy (nothing else serves) until
    it is restarted, and the process goes on (the fatal hook does not run)."""
    groups = _groups(7, 4, 3)
    ref = reference([r for g in groups for r in g])
    fatal: list[int] = []
    with LiveServer(_cfg(checkpoints["qwen3"], engine_process=True), on_fatal=lambda: fatal.append(1)) as s, \
            TeacherClient(s.url) as c:
        pool = s.app.state.aengine
        assert len(pool.replicas) == 1 and pool.pids[0] not in (None, os.getpid())
        _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)
        wait_until(lambda: _metric(s.url, "teacher_server_engine_steps_total").get("", 0) > 0)
        assert set(_metric(s.url, "teacher_server_prefix_cache_hits_total")) == {""}  # one engine: no label
        assert not fatal
        first = pool.pids[0]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: httpx.get(s.url + "/health").status_code == 503)
        assert "replica 0 down" in httpx.get(s.url + "/health").json()["error"]["message"]
        wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, 120, "the engine's restart")
        assert pool.pids[0] != first and not fatal
        _check_cached_and_equal(_score_groups_in_order(c, groups), groups, ref)
        assert _metric(s.url, "teacher_server_engine_restarts_total") == {"": 1.0}


@pytest.mark.parametrize("device,tp,setting,elsewhere", [
    ("cpu", 1, None, False),    # the CPU: on the server's thread unless asked
    ("cuda", 1, None, True),    # one GPU: a process of its own by default
    ("cuda", 2, None, False),   # a tensor-parallel group: on the thread unless asked
    ("cuda", 1, False, False),
    ("cpu", 1, True, True),
    ("cuda", 2, True, True),
])
def test_engine_process_default(device: str, tp: int, setting: bool | None, elsewhere: bool) -> None:
    """``engine_process`` None resolves by where the engine runs (no GPU needed to decide: the
    device is named); an explicit setting wins; several replicas are always processes."""
    from teacher_server.replicas.pool import engine_elsewhere

    cfg = Config(device=device, tensor_parallel_size=tp, engine_process=setting)
    assert engine_elsewhere(cfg) is elsewhere
    assert engine_elsewhere(cfg.model_copy(update={"data_parallel_size": 2}))


SCORED = types.SimpleNamespace(error_kind=None)  # a replica's answer, as far as the pool looks at it


class FakeReplica:
    """A replica of the pool's view: it takes requests (a future each) and can go down."""

    def __init__(self, i: int) -> None:
        self.index, self.name, self.state, self.requests, self.tokens, self.futs = i, str(i), "ready", 0, 0, []
        self.error: str | None = None  # set by kill, before the exit is seen

    def submit(self, req: object) -> asyncio.Future:
        self.requests += 1
        self.futs.append(asyncio.get_running_loop().create_future())
        return self.futs[-1]

    def went_down(self) -> None:  # as Replica.went_down: its requests are no longer its own
        from teacher_server.replicas.replica import ReplicaLost

        self.state, self.requests = "down", 0
        for f in self.futs:
            f.set_exception(ReplicaLost("process exited"))


def test_a_request_failing_over_stays_in_flight() -> None:
    """Between its replica going down and reaching another, a request is held by no replica:
    it still counts as in flight, so a drain does not end (and cut it off) at that moment."""
    from teacher_server.engine.request import ScoreRequest
    from teacher_server.replicas.pool import ReplicaPool

    async def run() -> None:
        pool = ReplicaPool(Config(device="cpu", data_parallel_size=2), factory=lambda cfg: None)
        pool.replicas = [FakeReplica(0), FakeReplica(1)]
        req = ScoreRequest("r", np.arange(40), 30, np.zeros((9, 2), np.int64))
        task = asyncio.create_task(pool.score(req))
        await asyncio.sleep(0)
        first = next(r for r in pool.replicas if r.requests)
        assert pool.in_flight == 1
        first.went_down()
        assert pool.in_flight == 1  # its waiter has not sent it on yet
        await asyncio.sleep(0)
        (other,) = [r for r in pool.replicas if r is not first]
        assert other.requests == 1 and pool.in_flight == 1 and pool.retried == 1
        other.requests = 0  # it answers (as Replica.answer)
        other.futs[0].set_result(SCORED)
        assert await task is SCORED and pool.in_flight == 0

    asyncio.run(run())


def test_a_request_is_sent_on_once_not_to_every_replica() -> None:
    """When the replica it was sent on to goes down as well, the request fails (500) instead of
    being handed to a third: a request that crashes the GPU would take them all down in turn."""
    from teacher_server.engine.request import ErrorKind, ScoreRequest
    from teacher_server.replicas.pool import ReplicaPool

    async def run() -> None:
        pool = ReplicaPool(Config(device="cpu", data_parallel_size=3), factory=lambda cfg: None)
        pool.replicas = [FakeReplica(0), FakeReplica(1), FakeReplica(2)]
        task = asyncio.create_task(pool.score(ScoreRequest("r", np.arange(40), 30, np.zeros((9, 2), np.int64))))
        for _ in range(2):
            await asyncio.sleep(0)
            next(r for r in pool.replicas if r.requests).went_down()
        res = await asyncio.wait_for(task, 10)  # (sent to the third, it would wait for its answer)
        assert res.error_kind == ErrorKind.INTERNAL and "2 replicas went down" in res.error
        assert pool.retried == 1 and sum(len(r.futs) for r in pool.replicas) == 2  # the third never got it

    asyncio.run(run())


def test_a_replica_refusing_with_a_full_queue_passes_the_request_on_or_gives_a_429() -> None:
    """A replica's own queue can be full while the front's count of it is not (a request the
    front cancelled is still there until its abort arrives): its OVERLOADED answer sends the
    request to a replica with room, and with none left the front answers as for its own full
    queues (EngineOverloaded: a 429 with Retry-After), not with the replica's bare result."""
    from teacher_server.engine.async_engine import EngineOverloaded
    from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult
    from teacher_server.replicas.pool import ReplicaPool

    def req(name: str) -> ScoreRequest:
        return ScoreRequest(name, np.arange(40), 30, np.zeros((9, 2), np.int64))

    def refuse(rep: FakeReplica, r: ScoreRequest) -> None:
        rep.requests = 0
        rep.futs[-1].set_result(ScoreResult.failed(r, ErrorKind.OVERLOADED, "queue full (1 requests, 40 tokens)"))

    async def run() -> None:
        pool = ReplicaPool(Config(device="cpu", data_parallel_size=2), factory=lambda cfg: None)
        pool.replicas = [FakeReplica(0), FakeReplica(1)]
        a = req("a")
        task = asyncio.create_task(pool.score(a))
        await asyncio.sleep(0)
        first = next(r for r in pool.replicas if r.requests)
        refuse(first, a)
        await asyncio.sleep(0)
        (other,) = [r for r in pool.replicas if r is not first]
        assert other.requests == 1 and len(first.futs) == 1  # sent on, not back to the full one
        other.requests = 0
        other.futs[-1].set_result(SCORED)
        assert await task is SCORED
        b = req("b")
        task = asyncio.create_task(pool.score(b))
        for _ in range(2):
            await asyncio.sleep(0)
            refuse(next(r for r in pool.replicas if r.requests), b)
        with pytest.raises(EngineOverloaded):
            await asyncio.wait_for(task, 10)
        assert [len(r.futs) for r in pool.replicas] == [2, 2]  # each tried once

    asyncio.run(run())


def test_a_replica_whose_engine_died_hands_its_failures_back() -> None:
    """A request failed by a dead engine (mid-step: INTERNAL; or refused on arrival:
    UNAVAILABLE) goes back to the front to be scored elsewhere; a live engine's refusals
    (draining, a full queue) and a request's own failure are answered as they are."""
    from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult
    from teacher_server.replicas.messages import LostMsg, ResultMsg
    from teacher_server.replicas.worker import answer

    req = ScoreRequest("r", np.arange(40), 30, np.zeros((9, 2), np.int64))
    for kind, alive, lost in [(ErrorKind.INTERNAL, False, True), (ErrorKind.UNAVAILABLE, False, True),
                              (ErrorKind.INTERNAL, True, False), (ErrorKind.UNAVAILABLE, True, False),
                              (ErrorKind.OVERLOADED, True, False), (ErrorKind.TIMEOUT, False, False)]:
        msg = answer(ScoreResult.failed(req, kind, "x"), alive)
        assert isinstance(msg, LostMsg if lost else ResultMsg), (kind, alive)
        assert (msg.uid if lost else msg.res.uid) == req.uid
    assert isinstance(answer(ScoreResult.failed(req, ErrorKind.INTERNAL, "x"), False), LostMsg)


def _loads_for_minutes(cfg: Config) -> None:
    """An engine factory whose load does not end in a test's time (module level: replica
    processes import it)."""
    time.sleep(600)
    raise RuntimeError("not reached")


def test_stopping_replicas_that_are_still_loading_does_not_wait_for_the_load() -> None:
    """A stop (shutdown, or a replica failing to start beside loading ones) reaches a replica
    whose engine is still loading: it exits at once instead of after its load."""
    from teacher_server.replicas.pool import ReplicaPool

    async def run() -> float:
        pool = ReplicaPool(Config(device="cpu", data_parallel_size=2), _loads_for_minutes)
        pool.start()
        await asyncio.sleep(3)  # the processes start; their engines load (or are about to)
        t0 = time.monotonic()
        await asyncio.to_thread(pool.shutdown, 60.0)
        assert all(r.process.exitcode is not None for r in pool.replicas)
        return time.monotonic() - t0

    assert asyncio.run(run()) < 20


def _front_that_dies_mid_message(conn, model_dir: str) -> None:
    """A front process (module level: spawned): starts one replica, waits until its engine is
    ready, leaves half a message in its queue (as a front killed while sending a large
    request does), sends the test the replica's pid and dies."""
    import multiprocessing as mp
    import struct

    from teacher_server.engine.engine import Engine
    from teacher_server.replicas.messages import ReadyMsg
    from teacher_server.replicas.worker import run_replica

    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    reader, writer = ctx.Pipe(duplex=False)
    cfg = Config(device="cpu", demo_model_dir=model_dir, max_num_batched_tokens=64, num_kv_blocks=64,
                 max_model_len=256)
    proc = ctx.Process(target=run_replica, args=(0, cfg, Engine, None, inbox, writer), daemon=False)
    proc.start()
    writer.close()
    while not isinstance(reader.recv(), ReadyMsg):
        pass
    os.write(inbox._writer.fileno(), struct.pack("!i", 1 << 20) + bytes(64))  # a 1 MiB message's first bytes
    conn.send(proc.pid)
    os._exit(0)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's parent may never reap it)."""
    return process_state(pid) not in (None, "Z")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_replica_whose_front_died_mid_message_exits(tmp_path) -> None:
    """The replica's reader blocks for good on a message its dead front half wrote (the
    replica holds the queue's write end too, so no end of file comes): the replica must still
    notice that the front is gone and exit, not go on holding its GPU."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    front = ctx.Process(target=_front_that_dies_mid_message, args=(there, str(tmp_path / "m")))
    front.start()  # (not a daemon: a daemon process may not start one)
    pid = None
    try:
        assert here.poll(180), "the front's replica never became ready"
        pid = here.recv()
        front.join(30)
        wait_until(lambda: not _running(pid), timeout=60, what="the orphaned replica's exit")
    finally:
        if front.is_alive():
            front.kill()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_replicas_do_not_import_the_http_server() -> None:
    """The replicas are the engine's side; their glue to the app lives in
    ``teacher_server.server.replica_lifecycle``: nothing under ``teacher_server/replicas``
    imports the HTTP stack or the server."""
    import ast
    from pathlib import Path

    import teacher_server.replicas

    for path in Path(teacher_server.replicas.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in {"fastapi", "starlette", "uvicorn"}, (path.name, name)
                assert not name.startswith("teacher_server.server"), (path.name, name)


def test_restart_backoff_doubles_for_quick_failures_and_resets_after_serving() -> None:
    """A replica going down again soon after a restart waits twice as long each time (at most
    64 x the backoff); one that served ``STABLE_S`` first restarts after the first backoff. A
    restart made after the pool began to stop, or for a replica already replaced, does nothing."""
    from teacher_server.replicas.pool import ReplicaPool

    pool = ReplicaPool(Config(device="cpu", data_parallel_size=2, replica_restart_backoff_s=2.0), factory=lambda c: None)
    later: list[tuple[float, object]] = []
    pool._loop = types.SimpleNamespace(call_later=lambda delay, fn, rep: later.append((delay, rep)))
    pool._started = types.SimpleNamespace(done=lambda: True)
    started: list[int] = []

    def fake(index: int) -> object:
        rep = pool.replicas[index].__class__.__new__(pool.replicas[index].__class__)
        rep.__dict__.update(index=index, name=str(index), state="starting", error=None, ready_at=None, down_at=None,
                            requests=0, tokens=0, _pending={}, process=types.SimpleNamespace(join=lambda t: None,
                                                                                                exitcode=3, pid=None))
        rep.start = lambda post: started.append(index)
        return rep

    pool._make = fake
    pool.replicas = [fake(0), fake(1)]

    def go_down(served_s: float) -> float:
        rep = pool.replicas[0]
        rep.state, rep.ready_at = "ready", time.monotonic() - served_s
        pool._exited(rep)
        delay, old = later[-1]
        pool._restart(old)
        return delay

    assert [go_down(1.0) for _ in range(9)] == [2, 4, 8, 16, 32, 64, 128, 128, 128]
    assert go_down(ReplicaPool.STABLE_S + 1) == 2.0
    assert pool.restarts == [10, 0] and started == [0] * 10 and pool.replicas[0].error == "process exited with code 3"
    stale = pool.replicas[0]
    pool.replicas[0] = fake(0)
    pool._restart(stale)  # replaced meanwhile: not started again
    pool._stopping = True
    pool._restart(pool.replicas[0])
    assert len(started) == 10


def test_a_replica_being_killed_is_not_served_to() -> None:
    """``kill`` sets the replica's error before its exit is seen: from then on it is not
    routed to, not counted as serving and named in the pool's error."""
    from teacher_server.replicas.pool import ReplicaPool
    from teacher_server.replicas.replica import Replica

    reps = []
    for i in range(2):
        r = Replica.__new__(Replica)
        r.index, r.state, r.error = i, "ready", None
        reps.append(r)
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.replicas = reps
    assert pool.capacity == (2, 2) and pool.fatal_error is None
    reps[1].error = "no heartbeat for 11s"  # what kill() sets first
    assert pool.capacity == (1, 2) and pool.alive
    assert "replica 1" in pool.fatal_error


def test_the_pool_gives_up_on_a_replica_that_keeps_failing_while_none_serves() -> None:
    """Five quick failures in a row with no replica serving end the pool (the server exits for
    its orchestrator, as a broken GPU needs); one serving replica keeps it restarting."""
    from teacher_server.replicas.pool import ReplicaPool

    reps = [FakeReplica(0), FakeReplica(1)]
    reps[0].state = "down"  # the one that just failed again
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.replicas, pool.on_give_up, pool._quick_failures = reps, print, [ReplicaPool.GIVE_UP_AFTER, 0]
    assert not pool.gives_up(0)  # replica 1 serves
    reps[1].state = "starting"
    assert pool.gives_up(0)
    pool._quick_failures[0] -= 1
    assert not pool.gives_up(0)


def test_a_replica_whose_start_hangs_is_killed_at_the_start_deadline() -> None:
    """A replica still loading ``replica_start_timeout_s`` after its process started is killed:
    at launch, waiting for the pool fails (naming the deadline) instead of waiting for good."""
    from teacher_server.replicas.pool import ReplicaPool

    async def run() -> tuple[str, float]:
        pool = ReplicaPool(Config(device="cpu", data_parallel_size=1, replica_start_timeout_s=3.0), _loads_for_minutes)
        t0 = time.monotonic()
        pool.start()
        try:
            with pytest.raises(RuntimeError) as e:
                await asyncio.wait_for(pool.ready(), 60)
            return str(e.value), time.monotonic() - t0
        finally:
            await asyncio.to_thread(pool.shutdown, 30.0)

    why, seconds = asyncio.run(run())
    assert "replica_start_timeout_s=3s" in why, why
    assert 3 <= seconds < 30, seconds


def test_a_request_cancelled_before_it_began_leaves_the_replicas_table() -> None:
    """A cancel read in the same loop turn as its request cancels a task before its first step,
    whose coroutine then never runs: the table of tasks drops it all the same (it had kept the
    request's arrays for the process's life)."""
    from teacher_server.replicas.worker import Tasks

    async def scenario() -> Tasks:
        tasks = Tasks()

        async def score() -> None:
            await asyncio.sleep(0.01)

        tasks.start(1, score())
        tasks.start(2, score())
        tasks[1].cancel()  # before it began
        await asyncio.sleep(0.05)
        return tasks

    assert asyncio.run(scenario()) == {}
