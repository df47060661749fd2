"""The compile cache: one directory that keeps what start-up compiles and tunes, so a restart
(a pod rescheduled, a rolling update) loads it instead of doing it again.

What it holds, each in its library's own format (they key their entries on source, shapes,
versions and GPU, so a stale entry is never used):

- ``inductor/``: torch.compile's FX graph and AOT autograd caches and inductor's own kernel
  autotuning (``TORCHINDUCTOR_CACHE_DIR``; its default is under /tmp, lost with the container);
- ``triton/``: compiled Triton kernels, inductor's and fla-core's (``TRITON_CACHE_DIR``), and
  Triton's autotuning choices (``TRITON_CACHE_AUTOTUNING=1``: without it, every process times
  every config of fla-core's kernels again, minutes for a Qwen3.5 model);
- ``ext/``: our CUDA kernel library (``TEACHER_SERVER_EXT_DIR``), only when the directory is set
  explicitly (by default that library keeps its own ~/.cache/teacher-server/ext);
- ``cudnn_fe/``: the cudnn_fe attention backend's built graphs (``TEACHER_SERVER_PLAN_DIR``,
  ``attention.plan_store``: keyed by shapes, GPU and versions). The plans torch's own cuDNN
  attention builds (the ``cudnn`` backend's) stay in memory: torch offers no way to keep them.
A variable the user already set wins over this directory (an image that sets
TRITON_CACHE_DIR keeps it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

OFF = "off"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "teacher-server" / "compile"


def use_compile_cache(setting: str | None) -> Path | None:
    """Point the compilers' caches at ``setting`` (None: ``default_dir()``; ``off``: leave them)
    for this process and the processes it starts. Must run before fla-core is imported (Triton
    reads TRITON_CACHE_AUTOTUNING when a kernel is defined). Returns the directory, or None
    when off or not writable (a warning: start-up still works, it only compiles again)."""
    if setting is not None and setting.strip().lower() == OFF:
        return None
    root = Path(setting).expanduser() if setting else default_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as e:
        log.warning("compile cache %s is not writable (%s): kernels are compiled and tuned again at every "
                    "start", root, e.strerror or e)
        return None
    env = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor", "TRITON_CACHE_DIR": root / "triton",
           "TRITON_CACHE_AUTOTUNING": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TEACHER_SERVER_PLAN_DIR": root / "cudnn_fe"}
    if setting:
        env["TEACHER_SERVER_EXT_DIR"] = root / "ext"
    for key, value in env.items():
        os.environ.setdefault(key, str(value))
    return root


def cache_summary(root: Path | None) -> str:
    """``<dir>: N files, M MB`` (0 files: a cold start), for the start-up log line."""
    if root is None:
        return "off"
    files, size = 0, 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                size += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:  # removed meanwhile (another process's temporary file)
                pass
    return f"{root}: {files} files, {size / 1e6:.0f} MB"
