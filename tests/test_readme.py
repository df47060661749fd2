"""The README's examples are executed (no drift between the docs and the behaviour)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_the_two_commands() -> None:
    assert "make run" in README and "make test" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_quick_start_in_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the demo model is written here
    block = next(b for b in python_blocks() if "from teacher_server import LLM" in b)
    ns: dict = {}
    exec(compile(block, "README.md:quick-start", "exec"), ns)
    assert ns["scores"].shape == (4, 3)


def test_quick_start_http(demo_server) -> None:
    block = next(b for b in python_blocks() if "BASE_URL" in b and "httpx.post" in b)
    ns: dict = {"BASE_URL": demo_server.url}
    exec(compile(block, "README.md:http", "exec"), ns)
    assert ns["m"].shape == (4, 2)


def test_quick_start_client(demo_server) -> None:
    block = next(b for b in python_blocks() if "TeacherClient" in b)
    ns: dict = {"BASE_URL": demo_server.url}
    exec(compile(block, "README.md:client", "exec"), ns)
    # Outside deterministic mode batching may change the last bits: the README's tolerance.
    assert ns["one"].shape == (4, 2) and len(ns["many"]) == 8
    for m in ns["many"]:
        np.testing.assert_allclose(m, ns["one"], rtol=0, atol=1e-5)
    assert ns["batch"].scores.shape == (3, 4, 2)
    np.testing.assert_allclose(ns["batch"].scores[0], ns["one"], rtol=0, atol=1e-5)


def test_many_servers_client(demo_server) -> None:
    """The several-servers example: two base URLs (the same server under two names), and a
    name resolved to its addresses (localhost: 127.0.0.1, and ::1 where nobody listens, which
    the client takes out)."""
    block = next(b for b in python_blocks() if "HEADLESS_URL" in b)
    port = demo_server.port
    ns: dict = {"URL_A": demo_server.url, "URL_B": f"http://localhost:{port}",
                "HEADLESS_URL": f"http://localhost:{port}"}
    exec(compile(block, "README.md:many-servers", "exec"), ns)
    assert len(ns["scores"]) == 8 and all(m.shape == (3, 1) for m in ns["scores"])


def test_every_python_block_is_executed() -> None:
    assert len(python_blocks()) == 4


def test_config_table_lists_every_setting() -> None:
    from teacher_server.config import Config

    table = README[README.index("## Configuration"):README.index("## Operations")]
    for name in Config.model_fields:
        assert f"`{name}`" in table, name


def test_every_file_the_readme_names_exists() -> None:
    """Paths and file names in the README resolve to files of the repository (a bare name
    such as ``values.yaml`` may live in a subfolder)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
             if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts]
    named = set(re.findall(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:md|py|json|yaml|txt))\b(?!\()", README))
    named = (named - {"config.json"}) | {"LICENSE"}  # config.json: a checkpoint's, not ours
    missing = [n for n in sorted(named) if not any(f == n or f.endswith("/" + n) for f in files)]
    assert not missing, missing


def test_license_matches_pyproject() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def _make_dry_run(target: str, tmp_path: Path) -> str:
    """The commands ``make TARGET`` would run on a fresh clone (a venv that does not exist yet)."""
    r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_run_installs_the_server_only(tmp_path) -> None:
    def extras(target: str) -> set[str]:
        """The extras of every ``pip install -e ".[...]"`` that ``make TARGET`` runs."""
        found = re.findall(r'pip install -q -e "\.\[([\w,]+)\]"', _make_dry_run(target, tmp_path))
        assert found, target
        return {e for group in found for e in group.split(",")}

    assert extras("run") == {"server"}  # no pytest, transformers or deployment checkers
    assert extras("test") == {"server", "test"}
