"""The CUDA extension holding every kernel of ``kernels/`` (one library, built once).

The sources are JIT-built with torch's C++/CUDA extension tooling and the library is cached
on disk, keyed by everything that changes the binary; later processes load it without a
compiler. ``python -m teacher_server.ops.extension`` builds it ahead of time (the Docker
image build) and prints the library's path. Ops call ``load()``: the module, or None when it
cannot be had (no CUDA, no compiler): one warning, and each op uses its torch reference.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

EXT_NAME = "teacher_server_kernels"
SOURCES = ("gather_logprob.cu", "elementwise.cu", "bindings.cpp")
_PACKAGE = Path(__file__).resolve().parent.parent


def source_dir() -> Path:
    """Where the kernel sources are: ``teacher_server/csrc`` in an installed package (the
    wheel ships them there as package data; in a checkout it is a link to ``kernels/``), else
    the checkout's ``kernels/`` (a checkout made without symlinks). No Python may live in
    ``kernels/``: a top-level ``kernels`` package would shadow the PyPI one."""
    for d in (_PACKAGE / "csrc", _PACKAGE.parent / "kernels"):
        if (d / SOURCES[0]).is_file():
            return d
    return _PACKAGE / "csrc"


class KernelLibrary:
    """Builds or loads the extension once per process, thread-safely; a failure is
    remembered (``error``) and logged once. ``builder`` makes the module (injectable)."""

    def __init__(self, builder: Callable[[bool], ModuleType] | None = None) -> None:
        self._builder = builder  # None: build_extension
        self._lock = threading.Lock()
        self._ext: ModuleType | None = None
        self._tried = False
        self.error: str | None = None  # why the library is unavailable, once a load was tried

    def load(self) -> ModuleType | None:
        """The loaded extension, or None when it cannot be had (no CUDA, a failed build)."""
        if self._tried:
            return self._ext
        with self._lock:
            if not self._tried:
                try:
                    if not torch.cuda.is_available():
                        raise RuntimeError("CUDA is not available")
                    self._ext = (self._builder or build_extension)(False)
                except Exception as e:  # a failed build must not take the server down
                    self.error = f"{type(e).__name__}: {e}"
                    # Compiler output is long: one line with its start (the command) and end
                    # (the error); `python -m teacher_server.ops.extension -v` shows all.
                    short = " ".join(self.error.split())
                    if len(short) > 400:
                        short = f"{short[:100]} ... {short[-300:]}"
                    log.warning("CUDA kernels unavailable, using the torch references (%s)", short)
                    log.debug("kernel build/load error:\n%s", self.error)
                self._tried = True
        return self._ext

    def build(self, verbose: bool = False) -> Path:
        """Build (or reuse the cached build of) the library and load it; return its path.
        Raises when the build fails."""
        with self._lock:
            if self._ext is None:
                self._ext = (self._builder or build_extension)(verbose)
                self.error = None
                self._tried = True
            return Path(self._ext.__file__)


library = KernelLibrary()


def load() -> ModuleType | None:
    """The process-wide extension (built or loaded on first call), or None."""
    return library.load()


def available() -> bool:
    """True when the CUDA kernels are built and loaded (builds them on first call)."""
    return library.load() is not None


def build(verbose: bool = False) -> Path:
    """Build the process-wide library now; raises when CUDA torch, nvcc or ninja is
    missing or the build fails. Needs no GPU: without one it builds for
    TEACHER_SERVER_CUDA_ARCH (default 9.0, H100/H200)."""
    return library.build(verbose)


def _arch_list() -> list[str]:
    """Compute capabilities to build for, e.g. ['90']: TEACHER_SERVER_CUDA_ARCH ("9.0",
    "90;100"), else the current GPU, else 9.0."""
    env = os.environ.get("TEACHER_SERVER_CUDA_ARCH", "").strip()
    if env:
        return [a.replace(".", "") for a in re.split(r"[;,\s]+", env) if a]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}{minor}"]
    return ["90"]


def build_extension(verbose: bool, name: str = EXT_NAME, src: Path | None = None) -> ModuleType:
    """Load the cached library when its key matches, else JIT-build it with ninja. ``name``
    and ``src`` (default: ``source_dir()``) build another checkout's ``kernels/`` as a module of
    its own, beside this one in a process (``bench/bench_kernel.py --qkv-baseline-src``)."""
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA")
    archs = _arch_list()
    # sm_XX code for each arch plus PTX of the newest, so newer GPUs can JIT it.
    arch_flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    arch_flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    # No --use_fast_math: exp2f/logf must stay accurate (outputs within ~1e-6 relative).
    cuda_flags = ["-O3", "-lineinfo", *arch_flags]
    cxx_flags = ["-O3"]
    src = source_dir() if src is None else src
    sources = [src / s for s in SOURCES]
    for s in sources:
        if not s.is_file():
            raise FileNotFoundError(f"kernel source missing: {s}")

    # Everything that changes the binary is in the key, so a build dir is never stale.
    h = hashlib.sha256()
    for s in sources:
        h.update(s.read_bytes())
    h.update(repr((cuda_flags, cxx_flags, torch.__version__, torch.version.cuda, sys.version_info[:2])).encode())
    base = Path(os.environ.get("TEACHER_SERVER_EXT_DIR") or Path.home() / ".cache" / "teacher-server" / "ext")
    build_dir = base / f"{name}-{h.hexdigest()[:16]}"
    lib = build_dir / f"{name}.so"
    if lib.is_file():
        return _import_library(lib, name)  # no nvcc/ninja needed at run time

    from torch.utils import cpp_extension  # heavy import: only when building

    _fix_cuda_home(cpp_extension)
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building the CUDA kernels in %s (archs %s)", build_dir, ",".join(archs))
    return cpp_extension.load(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=cxx_flags,
        extra_cuda_cflags=cuda_flags,
        build_directory=str(build_dir),
        verbose=verbose,
    )


def _fix_cuda_home(cpp_extension: ModuleType) -> None:
    """torch takes CUDA_HOME from the env or `which nvcc`; an nvcc wrapper script in
    /usr/local/bin makes that /usr/local (no CUDA headers, no libcudart to link), so
    point it at a real toolkit instead."""

    def is_toolkit(p: str | None) -> bool:
        return bool(p) and (Path(p) / "include" / "cuda_runtime.h").is_file() and (Path(p) / "bin" / "nvcc").is_file()

    if is_toolkit(cpp_extension.CUDA_HOME):
        return
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if is_toolkit(home):
            log.info("CUDA_HOME %s is not a CUDA toolkit, using %s", cpp_extension.CUDA_HOME, home)
            cpp_extension.CUDA_HOME = home  # read by torch's build helpers at call time
            return


def _import_library(path: Path, name: str = EXT_NAME) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build(verbose="-v" in argv))


if __name__ == "__main__":
    main(sys.argv[1:])
