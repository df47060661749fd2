"""Compile our Triton kernels for the GPU the service runs on (Hopper, sm_90) on a machine
without one: every launch an op makes inside ``compiled_launches()`` is compiled as Triton
would compile it there (the same argument specialisation: pointer alignment from the tensors'
addresses, integers divisible by 16, the launch's warps and stages) and not run. What a
launch would cost the GPU is then read from the binary: registers, spills, shared memory, and
whether a matrix kernel's loads are pipelined (cp.async / TMA feeding wgmma).

Needs triton (its CUDA backend ships ptxas and cuobjdump; no driver, no GPU). The inputs are
CPU tensors at the model's shapes; their values do not matter (nothing runs)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Hopper's opt-in shared memory per block (227 KB: 228 KB less the 1 KB the driver reserves)
SHARED_LIMIT = 232_448


@dataclass
class Launch:
    """One compiled launch: the kernel, its options and what its binary uses."""
    name: str
    options: dict[str, Any]
    shared: int  # dynamic shared memory, bytes
    registers: int
    stack: int  # bytes of stack frame (spilled registers and local arrays)
    ptx: str

    def count(self, instruction: str) -> int:
        return len(re.findall(re.escape(instruction), self.ptx))

    @property
    def pipelined(self) -> bool:
        """The matrix loads go to shared memory asynchronously (cp.async, or TMA's bulk copies)."""
        return self.count("cp.async") > 0

    @property
    def wgmma(self) -> bool:
        return self.count("wgmma.mma_async") > 0


class _Hopper:
    """The driver Triton asks for the current device and target: an H100/H200, device 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"no GPU here: the compile-only driver has no {name}")


def _cuobjdump() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def available() -> str | None:
    """None when kernels can be compiled here, else why not."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled"
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # the CPU torch wheel brings no triton
        return f"triton not installed ({type(e).__name__})"
    if not _cuobjdump().exists():
        return "triton's CUDA backend has no cuobjdump"
    return None


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the one kernel in ``cubin``."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(_cuobjdump()), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@contextlib.contextmanager
def compiled_launches() -> Iterator[list[Launch]]:
    """Inside, every Triton launch is compiled for sm_90 and appended to the list, not run."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        # a binder of its own: the kernel's per-device cache fixes its target when first made (a real
        # GPU's, if this process ran the kernel on one), and the compiled binary would be that one's
        caches, self.device_caches = self.device_caches, defaultdict(self.create_binder)
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            self.device_caches = caches
        registers, stack = _resources(kernel.asm["cubin"])
        launches.append(Launch(self.fn.__name__, {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs},
                               int(kernel.metadata.shared), registers, stack, kernel.asm["ptx"]))
        return kernel

    before = driver._active  # None until something asked for the real one
    driver.set_active(_Hopper())
    JITFunction.run = compile_only
    try:
        yield launches
    finally:
        JITFunction.run = run
        driver._active = before
