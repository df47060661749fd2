"""glu_gemm: the gate/up projection and SiLU-mul in one CUTLASS GEMM for Hopper (bf16).

``kernels/glu_gemm_sm90.cu`` holds the kernel: CUTLASS's SM90 mainloop (TMA loads multicast
over a two-CTA cluster, warp-specialised wgmma, a persistent tile scheduler) and an epilogue
that pairs each output's gate and up accumulators in registers, so the [T, 2I] product never
reaches memory. It wants the [gate; up] weight with its rows permuted once (``glu_rows``): the
epilogue finds gate and up in neighbouring accumulator columns that way. Its output has the
two-pass path's rounding (a bf16 GEMM output, then ``silu_mul`` with expf and IEEE division);
the GEMM's summation order is CUTLASS's.

The kernel is a plain shared library with a C interface (no torch headers), built with nvcc
against the CUTLASS headers of the ``nvidia-cutlass`` package (or ``TEACHER_SERVER_CUTLASS``,
a CUTLASS checkout's ``include`` directory) and cached beside the kernel extension, keyed by
its source and flags. Where it cannot be had (no nvcc or headers, not Hopper, not bf16),
``glu_gemm`` returns None and the caller takes another path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from teacher_server.ops.extension import source_dir

log = logging.getLogger(__name__)

SOURCE = "glu_gemm_sm90.cu"
# index in the library -> (name, tile N: the period of the weight's row permutation)
CONFIGS = {
    "c128x256_cl2x1": 0,
    "c128x256_cl1x2": 1,
    "c128x256": 2,
    "p64x256_cl2x1": 3,
    "c256x128_cl2x1": 4,
}
DEFAULT = "c128x256_cl2x1"
FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-shared", "-Xcompiler", "-fPIC",
         "-gencode=arch=compute_90a,code=sm_90a")


def cutlass_include() -> Path | None:
    """The CUTLASS headers: TEACHER_SERVER_CUTLASS, else the nvidia-cutlass package's copy."""
    env = os.environ.get("TEACHER_SERVER_CUTLASS")
    if env:
        return Path(env)
    try:
        import cutlass_library
    except Exception:
        return None
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return inc if (inc / "cutlass" / "cutlass.h").is_file() else None


def _cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass")
    except Exception:
        return "local"


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def library_path() -> Path:
    """Where the built library lives (TEACHER_SERVER_EXT_DIR or ~/.cache/teacher-server/ext),
    keyed by the source, the flags and the CUTLASS package's version."""
    src = source_dir() / SOURCE
    h = hashlib.sha256(src.read_bytes())
    h.update(repr((FLAGS, _cutlass_version())).encode())
    base = Path(os.environ.get("TEACHER_SERVER_EXT_DIR") or Path.home() / ".cache" / "teacher-server" / "ext")
    return base / f"glu_gemm-{h.hexdigest()[:16]}" / "libglu_gemm.so"


def build(verbose: bool = False) -> Path:
    """Build the library (or find it built); raises when nvcc or the headers are missing or
    the build fails. Needs no GPU."""
    lib = library_path()
    if lib.is_file():
        return lib
    nvcc, inc = _nvcc(), cutlass_include()
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, /usr/local/cuda, PATH)")
    if inc is None:
        raise RuntimeError("CUTLASS headers not found (pip install nvidia-cutlass, or TEACHER_SERVER_CUTLASS)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, *FLAGS, f"-I{inc}", f"-I{inc.parent / 'tools' / 'util' / 'include'}",
           str(source_dir() / SOURCE), "-o", str(tmp)]
    log.info("building the CUTLASS gate/up kernel: %s", " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nvcc failed ({out.returncode}): {(out.stderr or out.stdout)[-2000:]}")
    if verbose:
        print(out.stdout, out.stderr)
    tmp.replace(lib)  # atomic: a concurrent builder finds a whole file or none
    return lib


class _Library:
    """The ctypes library, loaded once per process (None with the reason when it cannot be)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.error: str | None = None

    def load(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    lib = ctypes.CDLL(str(build()))
                    i, p, v, z = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
                    lib.ts_glu_tile_n.argtypes, lib.ts_glu_tile_n.restype = [i], i
                    lib.ts_glu_workspace.argtypes = [i, i, i, i, v, i, i, i, ctypes.POINTER(z)]
                    lib.ts_glu_workspace.restype = i
                    lib.ts_glu_gemm.argtypes = [i, p, p, p, i, i, i, v, i, i, i, p, p]
                    lib.ts_glu_gemm.restype = i
                    self._lib = lib
                except Exception as e:  # no compiler, no headers: the caller takes another path
                    self.error = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                    log.warning("CUTLASS gate/up kernel unavailable: %s", self.error)
                self._tried = True
        return self._lib


library = _Library()


def tile_n(config: str = DEFAULT) -> int:
    """A config's tile width: the period of ``glu_rows``'s permutation."""
    lib = library.load()
    return lib.ts_glu_tile_n(CONFIGS[config]) if lib is not None else 0


def glu_rows(intermediate: int, bn: int) -> torch.Tensor:
    """The row of [gate; up] ([2I, H]) that each row of the kernel's weight takes: within a
    tile of bn rows, row c = 8i + 2q + s is gate (s = 0) or up (s = 1) of the tile's output
    (bn/8) q + i."""
    if intermediate % (bn // 2):
        raise ValueError(f"intermediate size {intermediate} is not a multiple of {bn // 2}")
    c = torch.arange(bn)
    out = (bn // 8) * ((c // 2) % 4) + c // 8
    tiles = torch.arange(2 * intermediate // bn).unsqueeze(1) * (bn // 2)
    return (tiles + out + (c % 2) * intermediate).reshape(-1)


@functools.cache
def _device(index: int) -> tuple[bool, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major == 9, props.multi_processor_count


_WS: dict[tuple[int, int], torch.Tensor] = {}


def glu_gemm(h: torch.Tensor, w_glu: torch.Tensor, config: str = DEFAULT, swizzle: int = 1,
             raster: int = 0) -> torch.Tensor | None:
    """silu(h @ gate^T) * (h @ up^T) from h [T, H] and w_glu (``[gate; up][glu_rows(I, bn)]``,
    [2I, H]) as [T, I]; None where the kernel does not apply. ``raster``: 0 CUTLASS's
    heuristic, 1 along M, 2 along N."""
    if not (h.is_cuda and h.dtype == torch.bfloat16 and w_glu.dtype == h.dtype and h.dim() == 2 and w_glu.dim() == 2
            and h.shape[1] == w_glu.shape[1] and h.shape[1] % 8 == 0 and h.is_contiguous() and w_glu.is_contiguous()
            and h.data_ptr() % 16 == 0 and w_glu.data_ptr() % 16 == 0):
        return None
    index = h.device.index if h.device.index is not None else torch.cuda.current_device()
    hopper, sms = _device(index)
    lib = library.load() if hopper else None
    if lib is None:
        return None
    cfg = CONFIGS[config]
    n, k, m = w_glu.shape[0], h.shape[1], h.shape[0]
    if n % lib.ts_glu_tile_n(cfg):
        return None
    out = torch.empty(m, n // 2, dtype=h.dtype, device=h.device)
    if m == 0:
        return out
    size = ctypes.c_size_t(0)
    lib.ts_glu_workspace(cfg, m, n, k, n // 2, sms, swizzle, raster, ctypes.byref(size))
    ws = _WS.get((index, cfg))
    if size.value and (ws is None or ws.numel() < size.value):
        ws = _WS[(index, cfg)] = torch.empty(size.value, dtype=torch.uint8, device=h.device)
    rc = lib.ts_glu_gemm(cfg, h.data_ptr(), w_glu.data_ptr(), out.data_ptr(), m, n, k, n // 2, sms, swizzle, raster,
                         ws.data_ptr() if size.value else None, torch.cuda.current_stream(h.device).cuda_stream)
    if rc:
        raise RuntimeError(f"CUTLASS gate/up kernel failed (code {rc}) at {m} x {n} x {k}, config {config}")
    return out
