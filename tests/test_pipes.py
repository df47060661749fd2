"""The pipes between the front and a replica process hold a W1f-shaped message whole
(``replicas.pipes``): a request's arrays cross in one read instead of a dozen, each of which
waited for the GIL in a busy receiver."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import numpy as np
import pytest

from teacher_server.config import Config
from teacher_server.replicas.pipes import PIPE_BYTES, pipe_bytes, queue_writer, system_cap, widen
from teacher_server.replicas.replica import Replica

linux_pipes = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe sizes are Linux's")
W1F_SCORES = np.zeros((3072, 64), dtype=np.float32)  # one W1f request's scores: 786 KB


def widened_here() -> int:
    """What ``widen`` makes of a pipe on this machine (the system's cap, or more for a process
    allowed past it); skips where it widens none."""
    r, w = mp.get_context("spawn").Pipe(duplex=False)
    try:
        size = widen(w)
    finally:
        r.close()
        w.close()
    if size is None:
        pytest.skip("pipes cannot be widened here")
    cap = system_cap()
    assert size >= min(PIPE_BYTES, cap or PIPE_BYTES)  # what was asked for, or the cap
    return size


def sent_without_a_reader(conn, payload: object, wait_s: float) -> bool:
    """Whether ``conn.send(payload)`` returns within ``wait_s`` while nobody reads the other end."""
    t = threading.Thread(target=conn.send, args=(payload,), daemon=True)
    t.start()
    t.join(wait_s)
    return not t.is_alive()


@linux_pipes
def test_a_widened_pipe_holds_a_requests_scores_whole() -> None:
    """As the system makes it (64 KiB) a pipe takes 786 KB of scores only as its reader reads
    them; widened, the whole message is in it before the reader looks, and reads back intact."""
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    if pipe_bytes(w) >= len(W1F_SCORES.tobytes()):
        pytest.skip("this system's pipes already hold the message")
    assert not sent_without_a_reader(w, W1F_SCORES, 0.5)  # blocked on the full pipe
    assert np.array_equal(r.recv(), W1F_SCORES)  # (the reader frees the writer)
    if widened_here() <= len(W1F_SCORES.tobytes()) + 4096:
        pytest.skip("this system's widest pipe does not hold the message")
    r2, w2 = ctx.Pipe(duplex=False)
    assert widen(w2) == pipe_bytes(r2) == widened_here()  # one pipe: either end tells its size
    scores = np.arange(W1F_SCORES.size, dtype=np.float32).reshape(W1F_SCORES.shape)
    assert sent_without_a_reader(w2, scores, 5.0)
    assert np.array_equal(r2.recv(), scores)
    for c in (r, w, r2, w2):
        c.close()


@linux_pipes
def test_a_replicas_pipes_are_widened() -> None:
    """Both of a replica's pipes: its inbox (the front's requests, through a queue) and its
    answers' connection, made when the replica is made (before its process starts)."""
    rep = Replica(0, mp.get_context("spawn"), Config(), lambda cfg: None, None)
    try:
        want = widened_here()
        assert pipe_bytes(queue_writer(rep._inbox)) == want
        assert pipe_bytes(rep._reader) == pipe_bytes(rep._writer) == want
    finally:
        rep._inbox.close()
        rep._reader.close()
        rep._writer.close()


def test_what_cannot_be_widened_is_left_alone(tmp_path) -> None:
    """No connection, a socket (a duplex connection), a queue without a pipe: nothing to do,
    no error."""
    a, b = mp.get_context("spawn").Pipe(duplex=True)  # (a socket pair)
    try:
        assert widen(None) is None and widen(a) is None
        assert queue_writer(object()) is None
    finally:
        a.close()
        b.close()


def _reports_its_switch_interval(cfg: Config) -> None:
    """An engine factory that fails with the replica process's switch interval in its message
    (module level: the replica process imports it)."""
    raise RuntimeError(f"switch interval {sys.getswitchinterval()}")


def test_a_replica_process_switches_threads_often() -> None:
    """A replica process runs with ``SWITCH_INTERVAL_S``: its intake and answer threads get the
    GIL back within 1 ms of the engine thread's launching, not Python's 5."""
    from teacher_server.replicas.messages import StartFailedMsg
    from teacher_server.replicas.worker import SWITCH_INTERVAL_S, run_replica

    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=run_replica, args=(0, Config(device="cpu"), _reports_its_switch_interval, None, inbox, w))
    p.start()
    try:
        assert r.poll(120), "the replica process said nothing"
        msg = r.recv()
        assert isinstance(msg, StartFailedMsg) and msg.error == f"RuntimeError: switch interval {SWITCH_INTERVAL_S}"
        assert SWITCH_INTERVAL_S < sys.getswitchinterval()  # (this process's: Python's default)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


def test_a_plan_reader_reads_what_send_bytes_wrote() -> None:
    """``PlanReader`` reads ``Connection.send_bytes``'s messages off a socket pair (a
    tensor-parallel rank's connection) as ``recv_bytes`` would: small ones (header and bytes in
    one write), large ones (header, then the bytes), empty ones (the stop), in order, and an
    EOFError once the sender is gone; a one-way pipe is read through ``recv_bytes``."""
    from teacher_server.engine.wire import PlanReader

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()  # duplex: a socket pair
    rng = np.random.default_rng(0)
    msgs = [b"x", rng.bytes(16384), rng.bytes(16385), b"", rng.bytes(6_600_000), rng.bytes(3)]
    reader = PlanReader(b)
    assert reader.sock is not None

    def send() -> None:
        for m in msgs:
            a.send_bytes(m)
        a.close()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    got = [bytes(reader.recv_bytes()) for _ in msgs]
    t.join(10)
    assert got == msgs
    with pytest.raises(EOFError):
        reader.recv_bytes()
    reader.close()
    b.close()

    r, w = ctx.Pipe(duplex=False)
    reader = PlanReader(r)
    assert reader.sock is None
    w.send_bytes(b"plan")
    assert reader.recv_bytes() == b"plan"
    for c in (r, w):
        c.close()
