"""The multi-node leader's control listener against peers that are not its nodes: one that sends
a byte now and then, many that connect and say nothing from one address, one whose greeting is
not a tuple; and a worker node that finds the leader's places for handshakes taken."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

import pytest
from conftest import free_port
from test_multinode import KEY, tiny_dir

from teacher_server.config import Config
from teacher_server.engine import node_worker, remote_ranks
from teacher_server.engine.remote_ranks import RemoteRanks


def leader(tmp_path: Path, port: int) -> RemoteRanks:
    cfg = Config(pipeline_parallel_size=2, nnodes=2, master_port=port, node_authkey=KEY)
    return RemoteRanks(cfg, 2, store_port=1234, model_dir=tiny_dir(tmp_path / "m"))


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the leader closed ``sock`` (reading what it sends), None if not within ``seconds``."""
    t0 = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def node_from(source: str, port: int) -> Connection:
    """A node's handshake and greeting from the loopback address ``source``."""
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    conn = Connection(sock.detach())
    answer_challenge(conn, KEY.encode())
    deliver_challenge(conn, KEY.encode())
    conn.send(("node", 1, 2))
    return conn


def test_a_peer_sending_a_byte_at_a_time_is_cut_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The handshake has one time limit in all: a peer that sends the start of a message every
    0.3 s (each read well inside the limit) is closed after GREET_TIMEOUT_S all the same."""
    monkeypatch.setattr(remote_ranks, "GREET_TIMEOUT_S", 1.0)
    port = free_port()
    remote = leader(tmp_path, port)
    stop = threading.Event()
    try:
        drip = socket.create_connection(("127.0.0.1", port))

        def trickle() -> None:
            for b in b"\x00\x00\x00\x40" + b"x" * 60:
                if stop.wait(0.3):
                    return
                try:
                    drip.send(bytes([b]))
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        took = closed_within(drip, 4.0)
        assert took is not None and 0.8 < took < 3.0, took  # (a per-read limit: never)
        deadline = time.monotonic() + 2
        while remote._joining and time.monotonic() < deadline:  # (its thread's last line)
            time.sleep(0.02)
        assert not remote.nodes and not remote._joining
    finally:
        stop.set()
        remote.close()


def test_silent_peers_of_one_address_leave_places_for_the_nodes(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Connections that say nothing take at most MAX_JOINING_PER_HOST places of their address:
    another of theirs is closed at once, a node from another address joins meanwhile; a greeting
    that is not a tuple is refused and closed (the thread that read it lives on)."""
    monkeypatch.setattr(remote_ranks, "MAX_JOINING_PER_HOST", 2)
    monkeypatch.setattr(remote_ranks, "GREET_TIMEOUT_S", 5.0)
    port = free_port()
    remote = leader(tmp_path, port)
    try:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.3)
        third = socket.create_connection(("127.0.0.1", port))
        took = closed_within(third, 2.0)
        assert took is not None and took < 2.5  # (at once, not after GREET_TIMEOUT_S)
        t0 = time.monotonic()
        node = node_from("127.0.0.2", port)
        assert node.recv()[0] == "ranks" and time.monotonic() - t0 < 2.5
        deadline = time.monotonic() + 2
        while 1 not in remote.nodes and time.monotonic() < deadline:  # (registered just after its answer is sent)
            time.sleep(0.02)
        assert 1 in remote.nodes
        for s in silent:
            s.close()
        deadline = time.monotonic() + 3
        while remote._joining and time.monotonic() < deadline:
            time.sleep(0.05)
        odd = Client(("127.0.0.1", port), authkey=KEY.encode())
        odd.send({"node": 1})
        with pytest.raises((EOFError, ConnectionResetError)):
            odd.recv()
        rank = Client(("127.0.0.1", port), authkey=KEY.encode())  # the listener still admits the rank
        rank.send(("rank", 1))
        assert len(remote.wait_all(5, lambda: None)) == 1
    finally:
        remote.close()


def test_a_node_retries_while_the_handshake_places_are_taken(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """A node whose connection the leader closes at once (its places taken) tries again and joins
    once a place is free, where it had exited as if the port were another program's."""
    monkeypatch.setattr(remote_ranks, "MAX_JOINING_PER_HOST", 1)
    monkeypatch.setattr(remote_ranks, "GREET_TIMEOUT_S", 1.5)
    port = free_port()
    remote = leader(tmp_path, port)
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.3)
        cfg = Config(pipeline_parallel_size=2, nnodes=2, node_rank=1, master_port=port, node_authkey=KEY)
        t0 = time.monotonic()
        conn = node_worker.connect(cfg, KEY.encode(), timeout=10)
        assert 0.8 < time.monotonic() - t0 < 8
        conn.send(("node", 1, 2))
        assert conn.recv()[0] == "ranks"
        silent.close()
    finally:
        remote.close()
    with socket.create_server(("127.0.0.1", 0)) as shut:  # a port that closes every connection: bounded
        threading.Thread(target=lambda: [shut.accept()[0].close() for _ in range(100)], daemon=True).start()
        cfg = Config(pipeline_parallel_size=2, nnodes=2, node_rank=1, master_port=shut.getsockname()[1],
                     node_authkey=KEY)
        with pytest.raises(ConnectionError, match="closed every control connection at once for 2s"):
            node_worker.connect(cfg, KEY.encode(), timeout=2)


def test_the_fingerprint_samples_spread_tensors_and_reads_odd_headers(tmp_path: Path) -> None:
    """A file of more tensors than TENSORS is sampled evenly, first and last included (a step of
    len // TENSORS had read 1,023 of 1,023 and half of 1,500); a header whose offsets are not
    pairs of numbers gives a digest of its bytes, not a TypeError on the leader."""
    import json
    import struct

    from teacher_server.engine.model_identity import TENSORS, _file_digest, sampled

    spans = [(i, i + 1) for i in range(1500)]
    got = sampled(spans)
    assert len(got) == TENSORS and got[0] == spans[0] and got[-1] == spans[-1] and len(set(got)) == TENSORS
    assert sampled(spans[:TENSORS]) == spans[:TENSORS]
    for offsets in (["a", "b"], [1], [5, 2], None):
        header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}).encode()
        f = tmp_path / "odd.safetensors"
        f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        assert len(_file_digest(f, weights=True)) == 16


def test_a_greeting_read_as_the_limit_falls_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the limit falls after the greeting was read (the thread descheduled at that moment,
    widened here by a delay after the read), the connection was shut by it: it is refused, not
    registered as a rank whose connection is already dead."""
    monkeypatch.setattr(remote_ranks, "GREET_TIMEOUT_S", 1.0)
    read = Connection.recv

    def slow_after_greeting(self: Connection):
        msg = read(self)
        if threading.current_thread().name == "teacher-node-join" and isinstance(msg, tuple):
            time.sleep(1.3)
        return msg

    monkeypatch.setattr(Connection, "recv", slow_after_greeting)
    port = free_port()
    remote = leader(tmp_path, port)
    try:
        rank = Client(("127.0.0.1", port), authkey=KEY.encode())
        rank.send(("rank", 1))
        time.sleep(2.0)
        assert 1 not in remote.ranks
        with pytest.raises(EOFError):
            rank.recv()  # (closed by the leader: a rank would retry)
        rank.close()
    finally:
        remote.close()
