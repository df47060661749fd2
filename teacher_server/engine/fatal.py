"""Which failures of a step end the engine: the GPU's context or a communicator is not usable
after them, so no later step can run."""

from __future__ import annotations

import torch

from teacher_server.engine.tp_workers import TensorParallelError

# Errors after which the GPU's context (or a communicator) is not usable: CUDA's own, and the
# libraries' statuses for a failed execution (a cuDNN status such as NOT_SUPPORTED or
# INTERNAL_ERROR can be about a shape, not the GPU, and stays a failed step; so does running out
# of memory, whoever reports it). Triton reports CUDA errors as "Triton Error [CUDA]".
_FATAL_MARKS = ("CUDA error", "device-side assert", "Triton Error [CUDA]", "CUDNN_STATUS_EXECUTION_FAILED",
                "CUDNN_STATUS_MAPPING_ERROR", "NCCL error")


def is_fatal(e: Exception) -> bool:
    """CUDA errors other than out-of-memory leave the context unusable."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(e, TensorParallelError):
        return True
    msg = str(e)
    if "out of memory" in msg:  # reported through another library (Triton's "[CUDA]: out of memory")
        return False
    return isinstance(e, RuntimeError) and any(m in msg for m in _FATAL_MARKS)
