"""A progress bar on stderr (no dependency): ``W1 [#######.......] 64/128 12.3s``, redrawn at
most ten times a second on a terminal; where stderr is not one (a log file) only the finished
bar is written, one line per pass."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30,
                 always: bool = False) -> None:
        self.label, self.total, self.width, self.done = label, total, width, 0
        self.stream = stream or sys.stderr
        self.enabled = always or self.stream.isatty()
        self.t0 = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * self.done // max(self.total, 1)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {now - self.t0:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
