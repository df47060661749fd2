"""A progress display for ``score_batch``: tqdm when installed, else a counter on stderr."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Counts finished requests; shows nothing when disabled. Safe to update from threads."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self._bar, self._last = total, 0, None, 0.0
        self.enabled, self._closed = enabled, False
        self._lock = threading.Lock()  # updated from worker threads
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc="scoring", unit="req")

    def update(self) -> None:
        with self._lock:
            self.done += 1
            if not self.enabled or self._closed:  # (a request of a batch given up, ending late)
                return
            if self._bar is not None:
                self._bar.update(1)
                return
            now = time.monotonic()
            if self.done == self.total or now - self._last > 0.5:
                self._last = now
                sys.stderr.write(f"\rscoring: {self.done}/{self.total}")
                sys.stderr.flush()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.total:
            sys.stderr.write("\n")
