"""What the fork server imports (``preload.PRELOAD``; nothing else imports this module): the
replica process's target and the engine, so a replica forked from it starts with them
imported; and SIGTERM ignored there, as a replica ignores it: a signal to the whole process
group (a service manager's stop) is the front's to handle by draining, and a fork server that
died of it would read to the front as every replica gone at once."""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before the imports: they take seconds

import teacher_server.engine.engine  # noqa: E402
import teacher_server.replicas.worker  # noqa: E402, F401
