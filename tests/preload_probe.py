"""A replica-process stand-in for test_preload: what a process forked from the fork server finds."""

from __future__ import annotations

import signal
import sys


def probe(q: object) -> None:  # q: a multiprocessing queue
    torch = sys.modules.get("torch")
    q.put({"engine imported": "teacher_server.engine.engine" in sys.modules,
           "worker imported": "teacher_server.replicas.worker" in sys.modules,
           "sigterm ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
           "cuda initialized": bool(torch is not None and torch.cuda.is_initialized())})
