"""Run a script with Triton's interpreter (a subprocess: the interpreter is chosen when the
kernels are defined, so it cannot be switched on in a process that defined them already)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def interpreted(code: str, timeout: int = 600) -> str:
    """``code`` run by a fresh interpreter with ``TRITON_INTERPRET=1``; its last line of output
    (skips the test where triton is not installed; fails it on the script's error)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]
