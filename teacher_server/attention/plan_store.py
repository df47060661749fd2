"""Built cuDNN frontend graphs kept on disk (under the compile cache), so a restart loads each
attention graph's execution plan instead of building it again (~55 ms a graph on the H200,
some 5 s for the graphs the cudnn_fe backend builds at start-up).

A file holds one graph's serialized form (``pygraph.serialize()``: the graph and the cuDNN
backend's plan). Its name is a hash of the graph's key (shapes, strides, dtype, scale, the
heuristics, the code that makes the graph: ``CudnnFrontendBackend._store_key``) and of
everything the plan depends on besides: the GPU's name and compute capability, the
driver, cuDNN's and the frontend's versions, torch's. A plan from another GPU or version is
never read: its name differs. A file that cannot be read or loaded is removed and the graph
built again; a directory that cannot be written only costs the saving."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import types
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "TEACHER_SERVER_PLAN_DIR"  # set by the compile cache (compile_cache.use_compile_cache)
SUFFIX = ".plan"


class PlanStore:
    """``load(key)``: the saved bytes of a graph, or None; ``save(key, data)``; ``drop(key)``.
    ``versions``: what the plans depend on besides the key (``plan_versions``)."""

    def __init__(self, directory: Path, versions: dict[str, str]) -> None:
        self.dir = Path(directory)
        self.versions = dict(sorted(versions.items()))
        self.loaded = 0  # graphs read back this process
        self.saved = 0
        self._writable = True

    def path(self, key: tuple) -> Path:
        digest = hashlib.sha256(repr((key, self.versions)).encode()).hexdigest()[:32]
        return self.dir / f"{digest}{SUFFIX}"

    def load(self, key: tuple) -> bytes | None:
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        return data or None

    def save(self, key: tuple, data: bytes) -> None:
        """Write atomically (a file appears whole or not at all: processes may share the directory)."""
        if not self._writable:
            return
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))
            tmp = None
            self.saved += 1
        except OSError as e:
            if tmp is not None:  # a part written (a full disk): not left behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # read-only or full: the graphs are built at every start, as without a store
            log.warning("cuDNN plans not kept in %s (%s)", self.dir, e.strerror or e)
            self._writable = False

    def drop(self, key: tuple) -> None:
        """Forget a saved graph that did not load (it is built and saved again)."""
        try:
            self.path(key).unlink()
        except OSError:
            pass


def plan_versions(device: object) -> dict[str, str]:
    """What a cuDNN plan built on ``device`` depends on besides its graph (CUDA only)."""
    import cudnn
    import torch

    props = torch.cuda.get_device_properties(device)
    try:
        driver = str(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        driver = "unknown"
    return {"gpu": props.name, "cc": f"{props.major}.{props.minor}", "driver": driver,
            "cudnn": str(cudnn.backend_version()), "frontend": str(getattr(cudnn, "__version__", "unknown")),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}


def store_from_env(device: object) -> PlanStore | None:
    """The store of this process's compile cache (None: the cache is off, or not on CUDA)."""
    where = os.environ.get(ENV)
    if not where:
        return None
    try:
        return PlanStore(Path(where), plan_versions(device))
    except Exception as e:  # a version the bindings do not report: no store, the graphs are built
        log.warning("cuDNN plans not kept (%s)", e)
        return None


def code_digest(code: types.CodeType) -> str:
    """A digest of a function's code that changes with it and not between processes (its inner
    functions by their own digests: a code object's repr holds its address)."""
    parts = [code.co_code, repr(code.co_names).encode()]
    for c in code.co_consts:
        parts.append(code_digest(c).encode() if isinstance(c, types.CodeType) else repr(c).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
