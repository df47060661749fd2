"""gather_logprobs: per row, log-softmax over the vocabulary (float32) gathered at K
candidate ids; negative candidates (``-1`` padding) give ``-inf``.

CUDA tensors go through the kernel in ``csrc/gather_logprob.cu`` (JIT-built once with
torch's extension tooling, cached on disk); CPU tensors, and CUDA ones when the kernel
cannot be built, use the torch reference. ``python -m teacher_server.ops.gather_logprob``
builds the kernel ahead of time (Docker image build) and prints the path of the library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_EXT_NAME = "teacher_server_kernels"
# teacher_server/csrc is a symlink to the repo's kernels/ (no .py may live in kernels/).
_SRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = ("gather_logprob.cu", "elementwise.cu", "bindings.cpp")
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CAND_DTYPES = (torch.int32, torch.int64)

_lock = threading.Lock()
_ext: ModuleType | None = None
_ext_error: str | None = None  # why the kernel is unavailable, once a load was tried
_tried = False


def gather_logprobs_reference(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """logits: [R, V] float32/bf16; cand: [R, K] or [K] int; returns [R, K] float32."""
    x = logits.float()  # [R, V]
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(x.shape[0], -1)
    idx = cand.long()
    pad = idx < 0
    vals = x.gather(1, idx.clamp(min=0))  # [R, K]
    if not logits_mode:
        # Subtract the row max before anything else: x - (max + log s) would round at
        # ulp(max), ~1e-3 for logits near 1e4; (x - max) - log s stays exact to ~1e-7.
        mx = x.amax(dim=-1, keepdim=True)  # [R, 1]
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        lse = torch.logsumexp(x - mx, dim=-1, keepdim=True)  # [R, 1]
        vals = (vals - mx) - lse
    return vals.masked_fill(pad, float("-inf"))


def gather_logprobs(
    logits: torch.Tensor,
    cand: torch.Tensor,
    logits_mode: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, K] float32: ``log_softmax(logits[r])[cand[r, j]]`` (the logit itself when
    ``logits_mode``); ``cand < 0`` gives ``-inf``.

    logits: [R, V] float32/bfloat16/float16, last dim contiguous (any row stride).
    cand: [K] (shared by every row) or [R, K], int32/int64, on the logits' device; ids in
    [0, V) or negative (padding). Callers validate ids: an id >= V makes the reference
    raise and the kernel write NaN (it never reads out of bounds).
    out: optional [R, K] float32 contiguous tensor to write into (returned).
    """
    _validate(logits, cand, out)
    rows, k = logits.shape[0], cand.shape[-1]
    if logits.is_cuda and rows > 0 and k > 0:
        ext = _load()
        if ext is not None:
            if out is None:
                out = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
            if k > 1 and cand.stride(-1) != 1:
                cand = cand.contiguous()  # [.., K] ints: a cheap copy
            ext.gather_logprobs_out(logits, cand, out, logits_mode)
            return out
    res = gather_logprobs_reference(logits, cand, logits_mode)
    if out is None:
        return res
    return out.copy_(res)


def _validate(logits: torch.Tensor, cand: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError on anything the kernel (or the reference) cannot take."""
    if logits.dim() != 2:
        raise ValueError(f"gather_logprobs: logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"gather_logprobs: logits dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("gather_logprobs: logits have an empty vocab dimension")
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError(f"gather_logprobs: logits last dim must be contiguous (stride 1), got strides {logits.stride()}")
    if cand.dtype not in _CAND_DTYPES:
        raise ValueError(f"gather_logprobs: candidates must be int32 or int64, got {cand.dtype}")
    if cand.dim() not in (1, 2):
        raise ValueError(f"gather_logprobs: candidates must be [K] or [rows, K], got shape {tuple(cand.shape)}")
    if cand.dim() == 2 and cand.shape[0] != rows:
        raise ValueError(f"gather_logprobs: per-row candidates have {cand.shape[0]} rows, logits have {rows}")
    if cand.device != logits.device:
        raise ValueError(f"gather_logprobs: candidates on {cand.device}, logits on {logits.device}")
    if out is not None:
        k = cand.shape[-1]
        if out.shape != (rows, k) or out.dtype != torch.float32:
            raise ValueError(
                f"gather_logprobs: out must be [{rows}, {k}] float32, got {tuple(out.shape)} {out.dtype}"
            )
        if out.device != logits.device:
            raise ValueError(f"gather_logprobs: out on {out.device}, logits on {logits.device}")
        if not out.is_contiguous():
            raise ValueError(f"gather_logprobs: out must be contiguous, got strides {out.stride()}")


def kernel_available() -> bool:
    """True when the CUDA kernel is built and loaded (builds it on first call)."""
    return _load() is not None


def build(verbose: bool = False) -> Path:
    """Build (or reuse the cached build of) the kernel and load it; return the library path.

    Raises when CUDA torch, nvcc or ninja is missing or the build fails. Needs no GPU:
    without one it builds for TEACHER_SERVER_CUDA_ARCH (default 9.0, H100/H200).
    """
    global _ext, _ext_error, _tried
    with _lock:
        if _ext is None:
            _ext = _build_extension(verbose)
            _ext_error = None
            _tried = True
        return Path(_ext.__file__)


def _load() -> ModuleType | None:
    """The loaded extension, or None (logged once) when it cannot be had."""
    global _ext, _ext_error, _tried
    if _tried:
        return _ext
    with _lock:
        if not _tried:
            try:
                if not torch.cuda.is_available():
                    raise RuntimeError("CUDA is not available")
                _ext = _build_extension(verbose=False)
            except Exception as e:  # a failed build must not take the server down
                _ext_error = f"{type(e).__name__}: {e}"
                # Compiler output is long: one line with its start (the command) and end
                # (the error); `python -m teacher_server.ops.gather_logprob -v` shows all.
                short = " ".join(_ext_error.split())
                if len(short) > 400:
                    short = f"{short[:100]} ... {short[-300:]}"
                log.warning("gather_logprobs: CUDA kernel unavailable, using the torch reference (%s)", short)
                log.debug("gather_logprobs: kernel build/load error:\n%s", _ext_error)
            _tried = True
    return _ext


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


def _build_extension(verbose: bool) -> ModuleType:
    """Load the cached library when its key matches, else JIT-build it with ninja."""
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA")
    archs = _arch_list()
    # sm_XX code for each arch plus PTX of the newest, so newer GPUs can JIT it.
    arch_flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    arch_flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    # No --use_fast_math: exp2f/logf must stay accurate (outputs within ~1e-6 relative).
    cuda_flags = ["-O3", "-lineinfo", *arch_flags]
    cxx_flags = ["-O3"]
    sources = [_SRC_DIR / s for s in _SOURCES]
    for s in sources:
        if not s.is_file():
            raise FileNotFoundError(f"kernel source missing: {s}")

    # Everything that changes the binary is in the key, so a build dir is never stale.
    h = hashlib.sha256()
    for s in sources:
        h.update(s.read_bytes())
    h.update(repr((cuda_flags, cxx_flags, torch.__version__, torch.version.cuda, sys.version_info[:2])).encode())
    base = Path(os.environ.get("TEACHER_SERVER_EXT_DIR") or Path.home() / ".cache" / "teacher-server" / "ext")
    build_dir = base / f"{_EXT_NAME}-{h.hexdigest()[:16]}"
    lib = build_dir / f"{_EXT_NAME}.so"
    if lib.is_file():
        return _import_library(lib)  # no nvcc/ninja needed at run time

    from torch.utils import cpp_extension  # heavy import: only when building

    _fix_cuda_home(cpp_extension)
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("gather_logprobs: building the CUDA kernel in %s (archs %s)", build_dir, ",".join(archs))
    return cpp_extension.load(
        name=_EXT_NAME,
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
            log.info("gather_logprobs: CUDA_HOME %s is not a CUDA toolkit, using %s", cpp_extension.CUDA_HOME, home)
            cpp_extension.CUDA_HOME = home  # read by torch's build helpers at call time
            return


def _import_library(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_EXT_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build(verbose="-v" in sys.argv[1:]))
