"""Where start-up time goes, phase by phase, for one log line (and ``Engine.startup_phases``)."""

from __future__ import annotations

import time


class StartupPhases:
    """Seconds per phase, in order. ``done(name)``: the time since the last phase ended is
    ``name``'s; ``add(parts)``: phases timed inside the next one (a runner's attention plans and
    compiles), which that one then does not count again."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()
        self._claimed = 0.0

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + max(now - self._mark - self._claimed, 0.0)
        self._mark, self._claimed = now, 0.0

    def add(self, parts: dict[str, float]) -> None:
        for name, s in parts.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + s
            self._claimed += s

    def line(self) -> str:
        """``41.2s (weights 12.0s, attention plans 5.1s, ...)``, the phases under 0.05 s left out."""
        total = sum(self.seconds.values())
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items() if v >= 0.05)
        return f"{total:.1f}s ({parts})"
