"""The ranks of the other nodes, seen from the leader (node 0, the engine's host) when one model's
ranks are spread over hosts (``nnodes`` > 1).

Each worker node (``teacher-server worker``, ``engine.node_worker``) connects to the leader's
control listener (``master_addr:master_port``, authenticated with ``node_authkey``) twice over:
once as the node, to learn which ranks are its and to exchange heartbeats, then once per rank it
starts. A rank's connection carries what a local worker's pipe carries (the start-up handshake,
then a step's plan per step), so the worker loop is the same. The node's connection is what the
watchdog watches: it closing (the node's process gone, its host gone with a reset) or falling
silent past ``HEARTBEAT_TIMEOUT_S`` fails the engine, as a local worker's exit does; a node whose
rank fails says so on it, then exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path

from teacher_server.config import Config
from teacher_server.engine.model_identity import model_fingerprint

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often each side says it is there
HEARTBEAT_TIMEOUT_S = 30.0  # silence after which the other side is taken as gone (a host lost without a reset)
GREET_TIMEOUT_S = 10.0  # an accepted connection's time, at most, to prove the key and name itself
MAX_JOINING = 64  # connections in the handshake at once (more are closed at once) ...
MAX_JOINING_PER_HOST = 16  # ... and from one address (a node's ranks connect at once: 8 GPUs and its retries)
# what the nodes need of the leader's settings: not the HTTP API key, nor the node key, which each
# node holds and proves in the handshake (the setup travels unencrypted)
SECRETS = {"api_key": None, "node_authkey": None}


def node_authkey(cfg: Config) -> bytes:
    """The control connections' shared secret; a multi-node group refuses to start without one."""
    if not cfg.node_authkey:
        raise ValueError("nnodes > 1 needs node_authkey (TEACHER_SERVER_NODE_AUTHKEY), the same on every node: the "
                         "control connection carries pickled plans and must only accept the group's own nodes")
    return cfg.node_authkey.encode()


def named(e: BaseException) -> str:
    """``Type: message`` of an exception (its type alone where it has no message)."""
    return f"{type(e).__name__}{': ' if str(e) else ''}{e}"


@contextlib.contextmanager
def cut_off_after(conn: Connection, seconds: float) -> Iterator[threading.Event]:
    """Within the block, ``conn`` is shut down ``seconds`` after it began (a blocked read then
    ends as EOFError) and the event yielded is set: one limit on the whole exchange, where a
    per-read limit lets a peer that sends a byte now and then hold it for ever."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # (shutdown acts on the connection, shared by its descriptors)
    expired, lock, over = threading.Event(), threading.Lock(), [False]

    def cut() -> None:
        with lock:
            if over[0]:  # (the block ended as the timer fired)
                return
            expired.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        with lock:
            over[0] = True
        timer.cancel()
        sock.close()


@contextlib.contextmanager
def read_timeout(conn: Connection, seconds: float) -> Iterator[None]:
    """A blocking read on ``conn`` fails (``BlockingIOError``) after ``seconds`` of silence, within
    the block; reads block without limit again after it."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # (the option is the socket's, shared by its descriptors)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        sock.close()


class RemoteRanks:
    """Accepts the worker nodes and their ranks; watches the nodes' connections."""

    def __init__(self, cfg: Config, size: int, store_port: int, model_dir: Path) -> None:
        self.nnodes, self.local, self.size = cfg.nnodes, cfg.ranks_per_node(), size
        # the ranks learn from here what a spawned worker gets as arguments, and what model to find
        self._setup = (size, store_port, {**cfg.model_dump(), **SECRETS},
                       model_fingerprint(model_dir, weights=cfg.load_format != "dummy"))
        self._key = node_authkey(cfg)
        self.listener = Listener(("", cfg.master_port))  # (the key is checked per connection: _join)
        self.nodes: dict[int, Connection] = {}
        self.ranks: dict[int, Connection] = {}
        self._heard: dict[int, float] = {}  # node -> when it last spoke
        self._beat = 0.0
        self._lock = threading.Lock()  # the node connections are sent on from the watchdog and from close()
        self._complete = threading.Event()
        self._port = cfg.master_port
        self._closed = False  # (close() called: no node admitted after it)
        self._joining: dict[str, int] = {}  # connections in the handshake per peer address (under _lock)
        self._acceptor = threading.Thread(target=self._accept, name="teacher-node-listener", daemon=True)
        self._acceptor.start()
        log.info("waiting for %d worker node(s) on port %d (ranks %d..%d)", self.nnodes - 1, cfg.master_port,
                 self.local, size - 1)

    # --- joining -------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError) as e:  # (a peer gone mid-accept; out of descriptors)
                if self._complete.is_set():
                    return
                log.warning("control listener: %s", e)
                time.sleep(0.1)  # (an error that lasts, EMFILE, would spin here)
                continue
            if self._complete.is_set():  # (the group is whole, or closing: _wake's connection)
                conn.close()
                break
            host = str(self.listener.last_accepted[0]) if self.listener.last_accepted else "?"
            if not self._enter(host):
                conn.close()
                continue
            threading.Thread(target=self._join, args=(conn, host), name="teacher-node-join", daemon=True).start()
        self.listener.close()

    def _enter(self, host: str) -> bool:
        """Whether a connection from ``host`` may start its handshake: at most ``MAX_JOINING`` at
        once, ``MAX_JOINING_PER_HOST`` of one address (a peer that opens many and says nothing
        cannot take every place; a node refused one retries)."""
        with self._lock:
            if sum(self._joining.values()) >= MAX_JOINING or self._joining.get(host, 0) >= MAX_JOINING_PER_HOST:
                return False
            self._joining[host] = self._joining.get(host, 0) + 1
            return True

    def _leave(self, host: str) -> None:
        with self._lock:
            left = self._joining[host] - 1
            if left:
                self._joining[host] = left
            else:
                del self._joining[host]

    def _wake(self) -> None:
        """Bring the accept loop out of its wait (a connection of this process's own) to close the
        listener, which frees the port; closing it from another thread would not end the wait."""
        if self._acceptor.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self._port), timeout=1.0).close()

    def _join(self, conn: Connection, host: str) -> None:
        """One connection's key handshake and greeting, on a thread of its own, within
        ``GREET_TIMEOUT_S`` in all: a peer that connects and says nothing, or a byte at a time (a
        port scanner, a load balancer's probe, a hostile peer), holds up no node for longer."""
        try:
            with cut_off_after(conn, GREET_TIMEOUT_S) as expired:
                try:
                    deliver_challenge(conn, self._key)
                    answer_challenge(conn, self._key)
                    msg = conn.recv()
                except (OSError, EOFError) as e:
                    if expired.is_set():
                        raise TimeoutError(f"no key and greeting within {GREET_TIMEOUT_S:g}s") from None
                    raise e
            if expired.is_set():  # (the limit fell after the greeting was read: the connection is shut)
                raise TimeoutError(f"no key and greeting within {GREET_TIMEOUT_S:g}s")
            self._greet(conn, msg)  # (reads on it block without limit from here: the watchdog's, the steps')
            if self._complete.is_set():
                self._wake()
        except Exception as e:  # a wrong key, a peer gone or too slow, a greeting of another form: this one only
            log.warning("refused a control connection from %s: %s", host, named(e))
            conn.close()
        finally:
            self._leave(host)

    def _greet(self, conn: Connection, msg: tuple) -> None:
        with self._lock:
            if self._closed:
                conn.send(("refused", "the group is closing"))
                raise ValueError("the group is closing")
            if not (isinstance(msg, tuple) and msg and isinstance(msg[0], str)):
                raise ValueError(f"unexpected greeting {msg!r:.100}")
            if msg[0] == "node" and len(msg) == 3 and all(isinstance(x, int) for x in msg[1:]):
                _, n, nnodes = msg
                if nnodes != self.nnodes or not 1 <= n < self.nnodes or n in self.nodes:
                    why = (f"the leader runs nnodes={self.nnodes}, this node nnodes={nnodes}" if nnodes != self.nnodes
                           else f"node_rank={n} is taken or outside 1..{self.nnodes - 1}")
                    conn.send(("refused", why))
                    raise ValueError(f"node {n}: {why}")
                conn.send(("ranks", n * self.local, self.local, *self._setup))
                self.nodes[n], self._heard[n] = conn, time.monotonic()
                log.info("worker node %d joined", n)
            elif (msg[0] == "rank" and len(msg) == 2 and isinstance(msg[1], int) and self.local <= msg[1] < self.size
                  and msg[1] not in self.ranks):
                self.ranks[msg[1]] = conn
            else:
                raise ValueError(f"unexpected greeting {msg!r:.100}")
            if len(self.nodes) == self.nnodes - 1 and len(self.ranks) == self.size - self.local:
                self._complete.set()

    def _missing(self) -> list[int]:
        """The worker nodes not connected yet."""
        return sorted(set(range(1, self.nnodes)) - set(self.nodes))

    def wait_all(self, timeout: float, failed: Callable[[], None]) -> list[Connection]:
        """The remote ranks' connections in rank order, once every one has connected; raises
        ``TimeoutError`` past ``timeout``, or what ``failed()`` (the group's other faults) raises."""
        deadline = time.monotonic() + timeout
        note = time.monotonic() + 60.0
        while not self._complete.wait(0.2):
            failed()
            if time.monotonic() > note:  # a line a minute: whom the leader still waits for, and how long at most
                note += 60.0
                log.info("still waiting for worker node(s) %s on port %d (at most %.0fs more)", self._missing(),
                         self._port, deadline - time.monotonic())
            if time.monotonic() > deadline:
                missing = self._missing()
                raise TimeoutError(f"worker node(s) {missing or 'ranks'} did not connect to the leader within "
                                   f"{timeout:.0f}s (is `teacher-server worker` running there with master_addr and "
                                   f"master_port pointing here and the same node_authkey?)")
        failed()  # (closed while waiting: a node's failure, said by the watchdog, is the reason)
        absent = [r for r in range(self.local, self.size) if r not in self.ranks]
        if absent:
            raise RuntimeError(f"the multi-node group closed before rank(s) {absent} connected")
        return [self.ranks[r] for r in range(self.local, self.size)]

    # --- watching --------------------------------------------------------------------------
    def watched(self) -> dict[Connection, int]:
        """The node connections to wait on (readable: a heartbeat, an error, or closed)."""
        with self._lock:
            return {c: n for n, c in self.nodes.items()}

    def check(self, ready: list[Connection]) -> str | None:
        """Read what the ready node connections say, send this side's heartbeat; the failure, if any."""
        now = time.monotonic()
        watched = self.watched()
        for conn in ready:
            n = watched[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return f"worker node {n} is gone (its control connection closed)"
            if msg[0] == "error":
                return f"worker node {n}: {msg[1]}"
            self._heard[n] = now
        for n in watched.values():
            if now - self._heard[n] > HEARTBEAT_TIMEOUT_S:
                return f"worker node {n} sent no heartbeat for {now - self._heard[n]:.0f}s"
        if now - self._beat >= HEARTBEAT_S:
            self._beat = now
            try:
                self.tell(("beat",))
            except OSError as e:
                return f"a worker node is gone ({e})"
        return None

    def tell(self, msg: tuple) -> None:
        with self._lock:
            for c in self.nodes.values():
                c.send(msg)

    def close(self, stop: bool = True) -> None:
        """Tell the nodes the group is stopping (``stop``; their ranks were told by their own
        connections), then close: a node not told (the group failed) takes its connection's end
        as the leader gone and ends its ranks at once."""
        self._complete.set()
        self._wake()
        if stop:
            try:
                self.tell(("stop",))
            except (OSError, ValueError):
                pass
        with self._lock:
            self._closed = True
            for c in [*self.nodes.values(), *self.ranks.values()]:
                c.close()
        try:
            self.listener.close()
        except OSError:
            pass
