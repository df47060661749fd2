"""The README's examples are executed (no drift between the docs and the behaviour)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_the_two_commands() -> None:
    assert "make run" in README and "make test" in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "make test" in ci


def test_quick_start_in_process(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the demo model is written here
    block = next(b for b in python_blocks() if "from teacher_server import LLM" in b)
    ns: dict = {}
    exec(compile(block, "README.md:quick-start", "exec"), ns)
    assert ns["scores"].shape == (4, 3)


def test_quick_start_http(demo_server) -> None:  # noqa: ANN001
    block = next(b for b in python_blocks() if "BASE_URL" in b and "httpx.post" in b)
    ns: dict = {"BASE_URL": demo_server.url}
    exec(compile(block, "README.md:http", "exec"), ns)
    assert ns["m"].shape == (4, 2)


def test_quick_start_client(demo_server) -> None:  # noqa: ANN001
    block = next(b for b in python_blocks() if "TeacherClient" in b)
    ns: dict = {"BASE_URL": demo_server.url}
    exec(compile(block, "README.md:client", "exec"), ns)
    assert ns["one"].shape == (4, 2) and all((m == ns["one"]).all() for m in ns["many"])


def test_every_python_block_is_executed() -> None:
    assert len(python_blocks()) == 3


def test_config_table_lists_every_setting() -> None:
    from teacher_server.config import Config

    table = README[README.index("## Configuration"):README.index("## Operations")]
    for name in Config.model_fields:
        assert f"`{name}`" in table, name
