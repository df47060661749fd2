"""ms-swift's GKD teacher-server client, ``fetch_teacher_logprobs``, from the installed ms-swift
release (requirements-swift.txt, installed with ``--no-deps`` by ``make setup-test``).

Its module, ``swift/rlhf_trainers/gkd_trainer.py``, cannot be imported beside this project's test
tools: at import it pulls in vLLM (ms-swift's rollout engine) and TRL < 1.0 APIs that TRL 1.x
removed (``trl.experimental.ppo``), and none of them is used by the teacher call. So the
function and the module-level helpers it reads are compiled from that installed file, unchanged,
and run with the module's ``torch`` and a logger: ms-swift's own code, at its own file and line
numbers in tracebacks, without executing the module's imports."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

VERSION = "4.2.3"  # requirements-swift.txt
MODULE = "swift/rlhf_trainers/gkd_trainer.py"
# What ``fetch_teacher_logprobs`` reads on the text-only path: the model name it caches, the
# retrying requests session and the prompt_logprobs parser. (The multimodal helpers are not taken:
# the trainer passes ``mm_raw_inputs=None`` for text.)
NAMES = {"teacher_model_server_model_name", "_build_teacher_session", "_teacher_session",
         "_parse_prompt_logprobs", "fetch_teacher_logprobs"}


def _defines(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def gkd_trainer_source() -> Path:
    """The installed ms-swift's gkd_trainer.py; skips the test where ms-swift is not installed."""
    try:
        dist = importlib.metadata.distribution("ms-swift")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ms-swift is not installed (make setup-test installs requirements-swift.txt)")
    assert dist.version == VERSION, f"ms-swift {dist.version} installed, the test is written for {VERSION}"
    return Path(str(dist.locate_file(MODULE)))


def fetch_teacher_logprobs() -> Callable:
    """ms-swift's ``fetch_teacher_logprobs(base_url, input_ids, topk=20, timeout=300.0,
    mm_raw_inputs=None)``, with fresh module state (no cached session or model name)."""
    import torch

    path = gkd_trainer_source()
    tree = ast.parse(path.read_text(), filename=str(path))
    body = [node for node in tree.body if _defines(node) & NAMES]
    found = set().union(*map(_defines, body))
    assert found == NAMES, f"{MODULE} of ms-swift {VERSION} lacks {sorted(NAMES - found)}"
    namespace = {"__name__": "swift.rlhf_trainers.gkd_trainer", "torch": torch,
                 "logger": logging.getLogger("swift")}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["fetch_teacher_logprobs"]
