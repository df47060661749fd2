"""teacher-server: teacher log-probs of student candidates, for on-policy distillation.

``from teacher_server import LLM, SamplingParams, TokensPrompt`` is the in-process API
(vLLM-shaped; needs the ``server`` extra); ``teacher_server.client`` talks to a running server
and needs only the core install (numpy, httpx). Imports are lazy so the client does not pull
in torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams", "TokensPrompt", "RequestOutput"):
        from teacher_server import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'teacher_server' has no attribute {name!r}")
