"""A worker node (``teacher-server worker``, ``node_rank`` >= 1): the ranks of one model that
live on this host while the leader (node 0) serves HTTP.

This process connects to the leader's control listener (``remote_ranks``), learns its global
ranks and the leader's settings, makes the model's files present here, then starts one process
per rank. Each rank connects to the leader itself and runs ``tp_workers.worker_main`` on that
connection, exactly as a local worker does on its pipe. This process then only keeps watch: a
rank of its that exits is reported to the leader (which fails its engine) and ends this node;
the leader gone (its connection closed, or silent past the heartbeat timeout) ends its ranks
and this node with code 1, as a local worker ends with its engine. The leader's ``stop`` (a
clean shutdown) lets the ranks finish: code 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path

from teacher_server.config import Config
from teacher_server.engine.model_identity import compare, model_fingerprint
from teacher_server.engine.remote_ranks import (
    GREET_TIMEOUT_S,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    named,
    node_authkey,
    read_timeout,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 900.0  # the leader's pod may start (pull its image, resolve its model) after this one
RANK_CONNECT_TIMEOUT_S = 120.0  # a rank's own connection, the leader known to be there
STOP_WAIT_S = 15.0  # after the leader's stop and close, for this node's ranks to end


def connect(cfg: Config, key: bytes, timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """The control connection to the leader, retried while it is not listening yet or closes the
    connection before its challenge (its places for handshakes in progress taken); the key's
    handshake within ``GREET_TIMEOUT_S`` (a port where something else listens and says nothing
    would hold this node for ever)."""
    return connect_to(cfg.master_addr, cfg.master_port, key, timeout)


def connect_to(addr: str, port: int, key: bytes, timeout: float) -> Connection:
    """``connect`` at ``addr:port`` (a rank's own connection too), for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    where, told = f"{addr}:{port}", 0.0
    while True:
        try:
            conn = Client((addr, port))  # (the key below, within a time limit)
        except OSError as e:  # not listening yet (refused), or a new pod's name not in the DNS yet
            if isinstance(e, socket.gaierror) and ipv6_only(addr):  # the control connection is IPv4
                raise ConnectionError(f"master_addr {addr} has only IPv6 addresses: the nodes' control "
                                      f"connection is IPv4") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        try:
            with read_timeout(conn, GREET_TIMEOUT_S):
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
            return conn
        except AuthenticationError:
            conn.close()
            raise
        except (EOFError, ConnectionResetError) as e:  # closed before a word: a leader busy with handshakes
            conn.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"{where} closed every control connection at once for {timeout:.0f}s "
                                      f"({type(e).__name__}): is master_port the leader's master_port?") from None
            if time.monotonic() - told > 30.0:
                told = time.monotonic()
                log.warning("%s closed the control connection at once (a leader with too many handshakes in "
                            "progress, or not a teacher-server leader's control port): retrying", where)
            time.sleep(1.0)
        except (OSError, AssertionError) as e:  # (Python 3.10 asserts the challenge's form)
            conn.close()
            why = "silent" if isinstance(e, BlockingIOError) else named(e)
            raise ConnectionError(f"{where} did not answer as a teacher-server leader's control port ({why}, "
                                  f"{GREET_TIMEOUT_S:g}s allowed for each message): is master_port the leader's "
                                  f"master_port, not its HTTP port?") from None


def ipv6_only(host: str) -> bool:
    """Whether ``host`` resolves, and only to IPv6 addresses."""
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(found) and all(family == socket.AF_INET6 for family, *_ in found)


def model_files(cfg: Config) -> Path:
    """The model's directory on this host, found or fetched as the leader's engine does."""
    if cfg.model is None:
        from teacher_server.demo_model import ensure_demo_model

        return Path(ensure_demo_model(cfg.demo_model_dir))
    from teacher_server.hub import resolve_model

    return Path(resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir,
                              weights=cfg.load_format != "dummy"))


def rank_main(rank: int, local: int, size: int, store_port: int, cfg_dict: dict, model_dir: str, device_name: str,
              addr: str, port: int, key: bytes, parent: int) -> None:
    """One rank of this node: its own control connection, then a local worker's life on it."""
    from teacher_server.engine.tp_workers import worker_main

    conn = connect_to(addr, port, key, RANK_CONNECT_TIMEOUT_S)
    conn.send(("rank", rank))
    worker_main(rank, size, store_port, cfg_dict, model_dir, device_name, conn, parent, host=addr, local=local)


def run_worker_node(cfg: Config) -> int:
    """Run this node's ranks until the leader stops them (0) or the group fails (1); 2 when the
    leader refuses this node (a setting that differs)."""
    from teacher_server.engine.process_group import set_nccl_env
    from teacher_server.engine.rank_setup import resolve_device

    set_nccl_env()
    key = node_authkey(cfg)
    log.info("worker node %d of %d: connecting to the leader at %s:%d", cfg.node_rank, cfg.nnodes, cfg.master_addr,
             cfg.master_port)
    conn = connect(cfg, key)
    conn.send(("node", cfg.node_rank, cfg.nnodes))
    try:
        with read_timeout(conn, GREET_TIMEOUT_S):
            msg = conn.recv()
    except (OSError, EOFError) as e:
        why = "no answer" if isinstance(e, BlockingIOError) else named(e)
        log.error("the leader did not answer this node's greeting within %gs (%s)", GREET_TIMEOUT_S, why)
        return 1
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "refused":
        log.error("the leader refused this node: %s", msg[1])
        return 2
    if not (isinstance(msg, tuple) and len(msg) == 7 and msg[0] == "ranks"):
        log.error("the leader's answer has another form (%.100r): is it the same teacher-server version as this "
                  "node?", msg)
        return 2
    _, first, count, size, store_port, cfg_dict, fingerprint = msg
    leader = Config(**cfg_dict)
    link = LeaderLink(conn)
    device = resolve_device(leader.device)
    log.info("worker node %d: ranks %d..%d of %d on %s", cfg.node_rank, first, first + count - 1, size, device)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    try:
        if device.type == "cuda":
            import torch

            if torch.cuda.device_count() < count:
                raise RuntimeError(f"this node holds {count} ranks, {torch.cuda.device_count()} GPUs are visible")
        model_dir = model_files(leader)
        compare(fingerprint, model_fingerprint(model_dir, weights=leader.load_format != "dummy"), model_dir.resolve())
        for local in range(count):
            p = ctx.Process(target=rank_main, name=f"teacher-tp{first + local}", daemon=True,
                            args=(first + local, local, size, store_port, cfg_dict, str(model_dir), str(device),
                                  cfg.master_addr, cfg.master_port, key, os.getpid()))
            p.start()
            procs.append(p)
        return _watch(link, procs)
    except BaseException as e:
        log.exception("worker node %d failed", cfg.node_rank)
        link.say(("error", f"{type(e).__name__}: {e}"[:2000]))
        return 1
    finally:
        link.done.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        conn.close()


class LeaderLink:
    """This node's side of its control connection, kept by two threads from the start (fetching
    the model's files may take long): one sends the heartbeat, one reads the leader's, so the
    leader never blocks on a full socket and its silence, stop or end is known here."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.heard = time.monotonic()
        self.stopping = False  # the leader said stop (a clean shutdown)
        self.closed_at: float | None = None  # when the connection ended
        self.done = threading.Event()
        self._lock = threading.Lock()  # the heartbeat thread and the main one both send
        threading.Thread(target=self._beat, name="teacher-node-heartbeat", daemon=True).start()
        threading.Thread(target=self._read, name="teacher-node-reader", daemon=True).start()

    def say(self, msg: tuple) -> None:
        try:
            with self._lock:
                self.conn.send(msg)
        except OSError:
            pass  # the leader is gone: the reader says so

    def _beat(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            self.say(("beat",))

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed by this node's exit mid-read
                self.closed_at = time.monotonic()
                return
            self.heard = time.monotonic()
            self.stopping = self.stopping or msg[0] == "stop"


def _watch(link: LeaderLink, procs: list[mp.process.BaseProcess]) -> int:
    """Until the ranks end: the leader's word, end or silence, and the ranks' exits (a rank
    exits 0 only when the leader has told it to stop)."""
    alive = {p.sentinel: p for p in procs}
    while alive:
        for s in wait(list(alive), timeout=1.0):
            p = alive.pop(s)
            p.join(1.0)
            if p.exitcode != 0:
                why = f"tensor-parallel worker {p.name} exited (code {p.exitcode})"
                log.critical("%s; stopping this node's ranks", why)
                link.say(("error", why))
                return 1
        now = time.monotonic()
        if link.stopping:
            if link.closed_at is not None and now - link.closed_at > STOP_WAIT_S and alive:
                # stopped before they were serving (the leader's start-up failed): they are not reading
                log.warning("this node's ranks did not end within %.0fs of the leader's stop; killing them",
                            STOP_WAIT_S)
                return 0
        elif link.closed_at is not None:
            log.critical("the leader is gone (its control connection closed); stopping this node's ranks")
            return 1
        elif now - link.heard > HEARTBEAT_TIMEOUT_S:
            log.critical("no heartbeat from the leader for %.0fs; stopping this node's ranks", HEARTBEAT_TIMEOUT_S)
            return 1
    log.info("the leader stopped this node's ranks")
    return 0
