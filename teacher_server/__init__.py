"""teacher-server: teacher log-probs of student candidates, for on-policy distillation.

``from teacher_server import LLM, SamplingParams, TokensPrompt`` is the in-process API
(vLLM-shaped; needs the ``server`` extra); ``teacher_server.client`` talks to a running server
and needs only the core install (numpy, httpx). Imports are lazy so the client does not pull
in torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "__version__", "main"]

# Import names of the packages that the `server` extra adds to the client's core install.
_SERVER_MODULES = frozenset({"torch", "safetensors", "fastapi", "uvicorn", "starlette", "pydantic", "orjson",
                             "prometheus_client", "yaml"})


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams", "TokensPrompt", "RequestOutput"):
        try:
            from teacher_server import llm
        except ModuleNotFoundError as e:  # a client-only install: say which extra, not which module
            if (e.name or "").split(".")[0] not in _SERVER_MODULES:
                raise
            raise ImportError(f"teacher_server.{name} runs the engine in this process and needs the server's "
                              f'dependencies ({e.name} is not installed): pip install "teacher-server[server]". '
                              "To score against a running server, teacher_server.client needs only the core "
                              "install", name=e.name) from None
        return getattr(llm, name)
    raise AttributeError(f"module 'teacher_server' has no attribute {name!r}")


def main() -> None:
    """The ``teacher-server`` command. With the client's install alone it says which extra
    the server needs instead of failing on an import."""
    try:
        from teacher_server.cli import main as cli_main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _SERVER_MODULES:
            raise
        raise SystemExit(f"teacher-server: {e.name} is not installed; the server needs "
                         f'`pip install "teacher-server[server]"`') from None
    cli_main()
