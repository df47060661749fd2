"""One model's ranks over two "nodes" on localhost (gloo): the leader (this process's engine,
node 0) and a worker node (`teacher-server worker --node-rank 1`, its own process tree). PP2
with one rank per node gives one process's results within 1e-5, PP2 x TP2 with a stage per node
TP2's, and the group stops cleanly (a node with the wrong key turned away); the worker node
killed mid-request, or its rank killed while idle, makes the leader's /health 503 within a
bound; the leader killed makes the worker node exit 1; the control listener's admission and
heartbeat; world sizes nnodes does not divide, a node_rank outside the group, the wrong command
for a node and a missing key are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from apiutil import assert_error, body
from conftest import LiveServer, free_port, wait_healthy
from test_pipeline_parallel import GEN, _child_of, dense3  # noqa: F401  (dense3: the tiny three-layer Qwen3)
from test_tensor_parallel import assert_same, run, wait_gone

from teacher_server.config import Config

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-node-key"


def worker_node(model: Path, port: int, *extra: str, key: str = KEY, cwd: Path = ROOT) -> subprocess.Popen:
    """`teacher-server worker` as node 1 of 2 at PP2, reaching the leader on localhost."""
    return subprocess.Popen(
        [sys.executable, "-m", "teacher_server", "worker", "--device", "cpu", "--model", str(model),
         "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), *extra],
        env=dict(os.environ, PYTHONPATH=str(ROOT), TEACHER_SERVER_NODE_AUTHKEY=key), cwd=cwd,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def leader_settings(port: int) -> dict:
    return {"pipeline_parallel_size": 2, "nnodes": 2, "master_port": port, "node_authkey": KEY}


def children(pid: int) -> list[int]:
    """The rank processes a worker node started (not multiprocessing's resource tracker)."""
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _child_of(d, pid)]


@pytest.mark.parametrize("tp", [1, 2])
def test_two_nodes_equal_one_process(tp: int, dense3: Path) -> None:  # noqa: F811
    """PP2 x TP1 (a rank per node) and PP2 x TP2 (a stage per node: the leader spawns its
    tensor-parallel peer, the worker node two ranks), against one process (TP2 alone at TP2, as
    for one host). A node with the wrong key, started beside the right one (at TP1), is
    refused (exit 2) and the group forms without it."""
    port = free_port()
    stranger = worker_node(dense3, port, key="not-the-key") if tp == 1 else None
    node = worker_node(dense3, port, "--tensor-parallel-size", str(tp))
    try:
        many, hits = run(dense3, tp, **leader_settings(port))
        one, hits1 = run(dense3, tp)
        assert hits == hits1 > 0
        assert_same(one, many)
        assert node.wait(60) == 0, node.stderr.read()[-3000:]  # the leader's close stops the node cleanly
        if stranger is not None:
            assert stranger.wait(30) == 2 and "refused this node's node_authkey" in stranger.stderr.read()
    finally:
        for p in [node, *([stranger] if stranger is not None else [])]:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_node_that_finds_another_model_is_refused_by_name(dense3: Path, tmp_path: Path,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node resolves the leader's ``model`` on its own host: one that finds another checkpoint
    there (here a relative path from another folder; the same shapes, other weights: it had served
    the other model's scores, off by up to 19) fails the group's start, the leader's error naming
    the node and the file."""
    import shutil

    from safetensors.torch import load_file, save_file

    from teacher_server.engine.tp_workers import TensorParallelError

    shutil.copytree(dense3, tmp_path / "leader" / "m")
    other = tmp_path / "node" / "m"
    shutil.copytree(dense3, other)
    w = load_file(str(other / "model.safetensors"))
    w = {n: t * 1.5 if t.dim() == 2 else t for n, t in w.items()}  # a fine-tune: every matrix moved
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    port = free_port()
    node = worker_node(Path("m"), port, cwd=tmp_path / "node")
    monkeypatch.chdir(tmp_path / "leader")
    try:
        with pytest.raises(TensorParallelError, match=r"worker node 1: ValueError: this node's model at "
                                                      r".*node/m is not the leader's: model\.safetensors differs"):
            run(Path("m"), 1, **leader_settings(port))
        assert node.wait(60) == 1
    finally:
        if node.poll() is None:
            node.kill()
        node.wait()


def test_model_fingerprints(tmp_path: Path) -> None:
    """Two copies agree; config.json, a weight, a missing file or another file each differ by name;
    a dummy load compares config.json alone."""
    import shutil

    from teacher_server.engine.model_identity import compare, model_fingerprint

    a = tiny_dir(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    compare(model_fingerprint(a, True), model_fingerprint(b, True), b)
    data = bytearray((b / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte of the last weight
    (b / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model at .*b is not the leader's: model\.safetensors differs \(every"):
        compare(model_fingerprint(a, True), model_fingerprint(b, True), b)
    compare(model_fingerprint(a, False), model_fingerprint(b, False), b)
    (b / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"config\.json differs"):
        compare(model_fingerprint(a, False), model_fingerprint(b, False), b)
    (b / "model.safetensors").rename(b / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors not in the leader's; "
                                         r"model\.safetensors missing here"):
        compare(model_fingerprint(a, True), model_fingerprint(b, True), b)


def test_the_worker_nodes_handshake_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A master_port where something else listens and says nothing (or answers otherwise) ends the
    node with a line saying so, not a wait for ever; an IPv6 master_addr is refused at once."""
    import socket

    from teacher_server.engine import node_worker
    from teacher_server.engine.remote_ranks import node_authkey

    monkeypatch.setattr(node_worker, "GREET_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        cfg = Config(pipeline_parallel_size=2, nnodes=2, node_rank=1, master_port=silent.getsockname()[1],
                     node_authkey=KEY)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"did not answer as a teacher-server leader's control port "
                                                  r"\(silent, 0\.5s allowed for each message\): is master_port"):
            node_worker.connect(cfg, node_authkey(cfg), timeout=5)
        assert time.monotonic() - t0 < 3
    with pytest.raises(ValueError, match="master_addr=::1 holds a ':': an IPv6 address"):
        Config(pipeline_parallel_size=2, nnodes=2, master_addr="::1", node_authkey=KEY)


def test_a_killed_worker_node_makes_health_503(dense3: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The worker node's process killed while a request waits on its stage (its rank stopped,
    so no socket of the group breaks): the leader's watchdog sees the node's control connection
    close, fails the engine (/health 503, the request answered), in bounded time; the node's
    rank, orphaned, exits too."""
    port = free_port()
    node = worker_node(dense3, port)
    fired = threading.Event()
    cfg = Config(model=str(dense3), device="cpu", max_num_batched_tokens=16, **leader_settings(port))
    try:
        with LiveServer(cfg, on_fatal=fired.set) as srv, srv.client() as c:
            (rank,) = children(node.pid)
            os.kill(rank, signal.SIGSTOP)  # the step waits on stage 0, held on the worker node
            out: list[httpx.Response] = []
            poster = threading.Thread(target=lambda: out.append(c.post(GEN, json=body(range(1, 120), [1, 2]))))
            poster.start()
            time.sleep(1.0)
            assert not out and not fired.is_set()
            t0 = time.monotonic()
            node.kill()
            assert fired.wait(30)
            poster.join(30)
            assert time.monotonic() - t0 < 30
            assert_error(c.get("/health"), 503)
            assert out and out[0].status_code in (500, 503), out
            assert "worker node 1 is gone (its control connection closed)" in caplog.text
            os.kill(rank, signal.SIGCONT)
            assert wait_gone([rank], 20)
    finally:
        if node.poll() is None:
            node.kill()
        node.wait()
        if dist.is_initialized():  # (the failed engine's group, in this test process)
            dist.destroy_process_group()


def test_a_worker_nodes_rank_lost_while_idle_makes_health_503(dense3: Path,  # noqa: F811
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A rank of the worker node killed while nothing runs (no collective of the leader's to
    fail): the node reports it by name on its control connection and exits 1; the leader fails
    its engine (/health 503) in bounded time."""
    port = free_port()
    node = worker_node(dense3, port)
    fired = threading.Event()
    cfg = Config(model=str(dense3), device="cpu", **leader_settings(port))
    try:
        with LiveServer(cfg, on_fatal=fired.set) as srv, srv.client() as c:
            (rank,) = children(node.pid)
            t0 = time.monotonic()
            os.kill(rank, signal.SIGKILL)
            assert fired.wait(30) and time.monotonic() - t0 < 30
            assert_error(c.get("/health"), 503)
            assert "worker node 1: tensor-parallel worker teacher-tp1 exited (code -9)" in caplog.text
            assert node.wait(20) == 1
    finally:
        if node.poll() is None:
            node.kill()
        node.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_worker_node_exits_when_the_leader_is_killed(dense3: Path) -> None:  # noqa: F811
    port, http = free_port(), free_port()
    leader = subprocess.Popen(
        [sys.executable, "-m", "teacher_server", "serve", "--device", "cpu", "--model", str(dense3),
         "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-port", str(port), "--host", "127.0.0.1",
         "--port", str(http), "--num-kv-blocks", "256", "--block-size", "8"],
        env=dict(os.environ, PYTHONPATH=str(ROOT), TEACHER_SERVER_NODE_AUTHKEY=KEY), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = worker_node(dense3, port)
    try:
        wait_healthy(f"http://127.0.0.1:{http}", leader, 180)
        (rank,) = children(node.pid)
        t0 = time.monotonic()
        leader.kill()
        assert node.wait(60) == 1
        assert time.monotonic() - t0 < 60
        assert wait_gone([rank], 20)
    finally:
        for p in (leader, node):
            if p.poll() is None:
                p.kill()
            p.wait()


def tiny_dir(path: Path) -> Path:
    """A model folder for the fingerprint (config.json and one weights file)."""
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    save_file({"w": torch.arange(4096.0)}, str(path / "model.safetensors"))
    return path


def test_the_control_listener_admits_only_the_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The leader's side of the control connections, without a model: a wrong key and a node of
    another group size are turned away (and the listener goes on); the node learns its ranks,
    the group is complete once its rank connects; the node's connection closing, or its
    heartbeats stopping, is reported as the node lost."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from teacher_server.engine import remote_ranks
    from teacher_server.engine.remote_ranks import RemoteRanks

    port = free_port()
    cfg = Config(pipeline_parallel_size=2, nnodes=2, master_port=port, node_authkey=KEY, api_key="k")
    remote = RemoteRanks(cfg, 2, store_port=1234, model_dir=tiny_dir(tmp_path / "m"))
    try:
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", port), authkey=b"wrong")
        other = Client(("127.0.0.1", port), authkey=KEY.encode())
        other.send(("node", 1, 3))
        assert other.recv() == ("refused", "the leader runs nnodes=2, this node nnodes=3")
        node = Client(("127.0.0.1", port), authkey=KEY.encode())
        node.send(("node", 1, 2))
        kind, first, count, size, store_port, sent, fingerprint = node.recv()
        assert (kind, first, count, size, store_port) == ("ranks", 1, 1, 2, 1234)
        assert list(fingerprint) == ["config.json", "model.safetensors"]
        # the leader's settings, but neither secret: the node proves its own key, and needs no API key
        assert sent["node_authkey"] is None and sent["api_key"] is None
        assert Config(**{**sent, "node_authkey": KEY, "api_key": "k"}) == cfg
        rank = Client(("127.0.0.1", port), authkey=KEY.encode())
        rank.send(("rank", 1))
        (conn,) = remote.wait_all(10, lambda: None)
        conn.send(("hello",))
        assert rank.recv() == ("hello",)
        watched = remote.watched()
        assert list(watched.values()) == [1] and remote.check([]) is None
        assert node.recv() == ("beat",)  # the leader's side of the heartbeat
        monkeypatch.setattr(remote_ranks, "HEARTBEAT_TIMEOUT_S", 0.2)
        time.sleep(0.3)
        assert remote.check([]) == "worker node 1 sent no heartbeat for 0s"
        node.send(("beat",))
        assert remote.check(list(watched)) is None  # heard again
        node.close()
        assert remote.check(list(watched)) == "worker node 1 is gone (its control connection closed)"
    finally:
        remote.close()


def test_a_silent_connection_holds_up_no_node_and_the_port_is_freed(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """A peer that connects to the control port and says nothing (a scanner, a load balancer's
    probe) is dropped after GREET_TIMEOUT_S, and the group's nodes join meanwhile; once the group
    is whole, or closed while waiting, the port is free again (a restarted group binds it)."""
    import socket
    from multiprocessing.connection import Client, Listener

    from teacher_server.engine import remote_ranks
    from teacher_server.engine.remote_ranks import RemoteRanks

    monkeypatch.setattr(remote_ranks, "GREET_TIMEOUT_S", 1.0)
    port = free_port()
    cfg = Config(pipeline_parallel_size=2, nnodes=2, master_port=port, node_authkey=KEY)
    remote = RemoteRanks(cfg, 2, store_port=1234, model_dir=tiny_dir(tmp_path / "m"))
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        node = Client(("127.0.0.1", port), authkey=KEY.encode())
        node.send(("node", 1, 2))
        assert node.recv()[0] == "ranks" and time.monotonic() - t0 < 0.9
        assert silent.recv(1024) and silent.recv(1024) == b""  # the key's challenge, then closed unanswered
        rank = Client(("127.0.0.1", port), authkey=KEY.encode())
        rank.send(("rank", 1))
        remote.wait_all(10, lambda: None)
        deadline = time.monotonic() + 5
        while remote._acceptor.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        Listener(("", port)).close()  # the whole group's port is free
        silent.close()
    finally:
        remote.close()
    waiting = RemoteRanks(cfg, 2, store_port=1234, model_dir=tmp_path / "m")  # closed before any node came
    late = Client(("127.0.0.1", port), authkey=KEY.encode())  # (its greeting after the close: not admitted)
    waiting.close()
    late.send(("node", 1, 2))
    assert late.recv() == ("refused", "the group is closing") and not waiting.nodes
    waiting._acceptor.join(5)
    assert not waiting._acceptor.is_alive()
    Listener(("", port)).close()


def test_the_control_connection_closed_mid_read_ends_the_reader_quietly() -> None:
    """The node's exit closes its control connection while the reader thread may be inside
    recv (multiprocessing then fails with a TypeError on the cleared handle): the reader records
    the end instead of dying with a traceback."""
    from teacher_server.engine.node_worker import LeaderLink

    class ClosedMidRead:
        def recv(self) -> tuple:
            raise TypeError("'NoneType' object cannot be interpreted as an integer")

        def send(self, msg: tuple) -> None:
            pass

    died: list = []
    old, threading.excepthook = threading.excepthook, lambda a: died.append(a.exc_value)
    try:
        link = LeaderLink(ClosedMidRead())
        deadline = time.monotonic() + 5
        while link.closed_at is None and not died and time.monotonic() < deadline:
            time.sleep(0.01)
        link.done.set()
    finally:
        threading.excepthook = old
    assert not died and link.closed_at is not None


def test_node_settings_are_checked() -> None:
    from teacher_server.cli import config_from_args

    cfg = Config(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1)
    assert (cfg.ranks_per_node(), Config().nnodes, Config().node_rank) == (2, 1, 0)
    with pytest.raises(ValueError, match=r"nnodes=2 does not divide the 3 ranks \(pipeline_parallel_size=3 x "
                                         r"tensor_parallel_size=1\)"):
        Config(pipeline_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2 must be below nnodes=2"):
        Config(pipeline_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="neither data_parallel_size > 1"):
        Config(pipeline_parallel_size=2, nnodes=2, data_parallel_size=2)
    got = config_from_args(["worker", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5"])
    assert (got.nnodes, got.node_rank, got.master_addr, got.master_port) == (2, 1, "10.0.0.5", 29500)
    assert Config.load(None, {"TEACHER_SERVER_NODE_AUTHKEY": "k"}).node_authkey == "k"


@pytest.mark.parametrize(("argv", "needle"), [
    (["worker", "--nnodes", "2", "-pp", "2"], "node 0 (the leader) runs `teacher-server serve`"),
    (["serve", "--nnodes", "2", "-pp", "2", "--node-rank", "1"], "nodes 1..nnodes-1 run `teacher-server worker`"),
    (["worker", "--nnodes", "2", "-pp", "3", "--node-rank", "1"], "nnodes=2 does not divide the 3 ranks"),
    (["worker", "--nnodes", "2", "-pp", "2", "--node-rank", "1"], "needs node_authkey"),
    (["serve", "--nnodes", "2", "-pp", "2"], "needs node_authkey"),  # the leader too, before its port opens
])
def test_the_command_line_refuses(argv: list[str], needle: str, capsys: pytest.CaptureFixture,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from teacher_server.cli import main

    monkeypatch.delenv("TEACHER_SERVER_NODE_AUTHKEY", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_leader_whose_master_port_is_taken_is_refused_before_it_loads(capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A --master-port another process holds (or the HTTP port itself): one line naming it and
    exit 2, as for --port (it was an engine failure, exit 3, "Address already in use")."""
    import socket

    from teacher_server.cli import main

    monkeypatch.setenv("TEACHER_SERVER_NODE_AUTHKEY", "k")
    port = free_port()
    base = ["serve", "--device", "cpu", "--nnodes", "2", "-pp", "2", "--host", "127.0.0.1", "--port", str(port)]
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        busy = held.getsockname()[1]
        for extra, says in ((["--master-port", str(busy)], f"port {busy} on 0.0.0.0 is not free (Address already in "
                                                            f"use): another process listens there; pick another with "
                                                            f"--master-port N (or TEACHER_SERVER_MASTER_PORT=N)"),
                            (["--master-port", str(port)], f"master_port {port} is the HTTP port too")):
            with pytest.raises(SystemExit) as e:
                main([*base, *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def test_a_leader_without_a_key_is_refused(dense3: Path) -> None:  # noqa: F811
    from teacher_server.engine.engine import Engine

    with pytest.raises(ValueError, match="needs node_authkey"):
        Engine(Config(model=str(dense3), device="cpu", pipeline_parallel_size=2, nnodes=2, master_port=free_port()))


# --- GPU (two GPUs of one host as two "nodes": NCCL between processes that each see one GPU) ---

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.gpu
@two_gpus
def test_gpu_two_nodes_equal_one_gpu(checkpoints) -> None:
    """The leader on GPU 0 (this process), the worker node seeing only GPU 1 (its rank's local
    GPU 0): PP2 over NCCL equals one GPU within 1e-4 in float32."""
    from test_tensor_parallel import assert_same_within

    path, port = checkpoints["qwen3hd128"], free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "teacher_server", "worker", "--model", str(path), "--pipeline-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), TEACHER_SERVER_NODE_AUTHKEY=KEY, CUDA_VISIBLE_DEVICES="1"),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        settings = {"device": "cuda", "dtype": "float32", "max_model_len": 1024}
        one, hits1 = run(path, 1, **settings)
        two, hits2 = run(path, 1, **settings, **leader_settings(port))
        assert hits2 == hits1 > 0
        assert_same_within(one, two, 1e-4)
        assert node.wait(60) == 0, node.stderr.read()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
        node.wait()
