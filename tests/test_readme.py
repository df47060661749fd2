"""The README's examples are executed (no drift between the docs and the behaviour).

Code blocks of the README: ```python blocks are executed, ```bash blocks are run as written
with bash in a checkout where `make run` has run (its `.venv/`) against a live demo server (the
one place a command is changed: `127.0.0.1:8000`, `make run`'s address, becomes the test
server's); ```shell blocks (make, docker, helm: what builds or deploys) and ```text blocks are
read, not run. The headline table's numbers are those of the results files it names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKE_RUN_URL = "http://127.0.0.1:8000"  # where `make run` serves; the tests' server is elsewhere
# docs the README hands over to (its own reference pages): their names must resolve too
DOCS = ["docs/api.md", "docs/python.md", "docs/configuration.md", "docs/scaling.md", "docs/teachers.md",
        "docs/observability.md",
        "docs/architecture.md"]


def python_blocks(text: str = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def bash_blocks(text: str = README) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def at(block: str, url: str) -> str:
    """``block`` pointed at the test server ``url`` instead of `make run`'s."""
    return block.replace(MAKE_RUN_URL, url)


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
    ns: dict = {}
    exec(compile(at(block, demo_server.url), "README.md:http", "exec"), ns)
    assert ns["m"].shape == (4, 2)


def test_quick_start_client(demo_server) -> None:
    block = next(b for b in python_blocks() if "TeacherClient" in b)
    ns: dict = {}
    exec(compile(at(block, demo_server.url), "README.md:client", "exec"), ns)
    # Outside deterministic mode batching may change the last bits: the README's tolerance.
    assert ns["one"].shape == (4, 2) and len(ns["many"]) == 8
    for m in ns["many"]:
        np.testing.assert_allclose(m, ns["one"], rtol=0, atol=1e-5)
    assert ns["batch"].scores.shape == (3, 4, 2)
    np.testing.assert_allclose(ns["batch"].scores[0], ns["one"], rtol=0, atol=1e-5)
    assert ns["full"].scores.shape == (4, 2) and ns["full"].prompt_tokens == 9


def test_many_servers_client(demo_server) -> None:
    """The several-servers example: two base URLs (the same server under two names), and a
    name resolved to its addresses (localhost: 127.0.0.1, and ::1 where nobody listens, which
    the client takes out)."""
    block = next(b for b in python_blocks((ROOT / "docs" / "scaling.md").read_text()) if "HEADLESS_URL" in b)
    port = demo_server.port
    ns: dict = {"URL_A": demo_server.url, "URL_B": f"http://localhost:{port}",
                "HEADLESS_URL": f"http://localhost:{port}"}
    exec(compile(block, "docs/scaling.md:many-servers", "exec"), ns)
    assert len(ns["scores"]) == 8 and all(m.shape == (3, 1) for m in ns["scores"])


def test_every_python_and_bash_block_is_executed() -> None:
    assert len(python_blocks()) == 3 and len(bash_blocks()) == 1
    assert len(python_blocks((ROOT / "docs" / "scaling.md").read_text())) == 1
    fences = set(re.findall(r"^```(\w*)$", README, flags=re.M)) - {""}
    assert fences <= {"python", "bash", "shell", "text"}, fences  # a new kind must be run or listed here


def test_after_make_run_commands_run_as_written(demo_server, tmp_path) -> None:
    """The "After `make run`" block, each line as written, in a checkout where `make run` has run:
    the repository's files and its `.venv/` (this interpreter's environment where the checkout
    has none, as in a development worktree)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for p in ROOT.iterdir():
        if p.name not in (".venv", ".git"):
            (clone / p.name).symlink_to(p)
    venv = ROOT / ".venv" if (ROOT / ".venv" / "bin" / "teacher-server").exists() else Path(sys.prefix)
    (clone / ".venv").symlink_to(venv)
    block = at(bash_blocks()[0], demo_server.url).replace("/tmp/teacher-server-bench", str(tmp_path / "bench"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run(["bash", "-e", "-c", block], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert '{"status":"ready"}' in r.stdout and '"vocab_size"' in r.stdout and "--max-logprobs" in r.stdout
    assert (tmp_path / "bench" / "bench.png").exists()


def test_config_table_lists_every_setting() -> None:
    from teacher_server.config import Config

    table = (ROOT / "docs" / "configuration.md").read_text()
    for name in Config.model_fields:
        assert f"`{name}`" in table, name


def test_api_reference_lists_every_scoring_field() -> None:
    """docs/api.md names every request field that changes the scores and every response field
    of the native endpoint, and each ``logprobs_mode``."""
    from typing import get_args

    from teacher_server.config import LogprobsMode
    from teacher_server.server.protocol import GenerateResponse, SamplingParams

    api = (ROOT / "docs" / "api.md").read_text()
    names = [n for n in SamplingParams.model_fields if n.startswith("prompt_logprob")]
    names += list(GenerateResponse.model_fields) + list(get_args(LogprobsMode))
    assert [n for n in names if f"`{n}`" not in api and f"`{n}." not in api] == []


def test_every_file_the_readme_names_exists() -> None:
    """Paths and file names in the README and the docs it hands over to resolve to files of the
    repository (a bare name such as ``values.yaml`` may live in a subfolder)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
             if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts]
    text = README + "".join((ROOT / d).read_text() for d in DOCS)
    named = set(re.findall(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:md|py|json|yaml|txt|png))\b(?!\()", text))
    # a checkpoint's files and what `teacher-server bench` writes, not ours
    named = (named - {"config.json", "tokenizer.json", "vocab.json", "merges.txt", "bench.png"}) | {"LICENSE"}
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


def test_headline_numbers_are_the_results_files() -> None:
    """Each headline row's numbers are its results file's (rounded as printed), and the plot is
    what bench/plot_headline.py draws from them."""
    sys.path.insert(0, str(ROOT / "bench"))
    from plot_headline import HEADLINE

    table = README[README.index("## Benchmarks"):README.index("**Benchmark on your GPU.**")]
    for label, file, workload in HEADLINE:
        row = next(line for line in table.splitlines() if line.startswith(f"| {label.split()[0]} (") and file in line)
        data = json.loads((ROOT / "bench" / "results" / file).read_text())
        want = [f"{data['engine'][workload]['tokens_per_s']:,.0f}", f"{data['engine'][workload]['mfu']:.3f}"]
        if workload in data.get("baseline", {}):
            base = data["baseline"][workload]
            want += [f"{base['tokens_per_s']:,.0f}", f"{base['mfu']:.3f}",
                     f"{data['engine'][workload]['tokens_per_s'] / base['tokens_per_s']:.2f}x"]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert [c for c in cells[1:6] if c] == want, (row, want)


def test_headline_plot_is_drawn_from_the_results(tmp_path) -> None:
    out = tmp_path / "headline.png"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_headline.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_bytes() == (ROOT / "docs" / "headline.png").read_bytes()
    assert "](docs/headline.png)" in README


def test_shell_block_commands_of_ours_parse() -> None:
    """The ```shell blocks' `teacher-server ...` lines (not run: they need a GPU or a checkpoint)
    are valid command lines of the commands they name; `make` targets exist (`make -n`)."""
    import shlex

    from teacher_server.benchmark.command import build_parser as bench_parser
    from teacher_server.cli import build_parser as serve_parser

    lines = [line.split("  #")[0].strip() for block in re.findall(r"```shell\n(.*?)```", README, flags=re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    ours = [shlex.split(line) for line in lines if line.startswith("teacher-server ")]
    assert any(a[1] == "bench" for a in ours)
    for argv in ours:
        if argv[1] == "bench":
            bench_parser().parse_args(argv[2:])  # SystemExit on an unknown or malformed flag
        else:
            serve_parser().parse_args(argv[1:])
    targets = {line.split()[1] for line in lines if line.startswith("make ")}
    assert targets == {"run", "test"}, targets


def test_python_md_names_every_public_argument_and_field() -> None:
    """docs/python.md is the reference of the client and the in-process API: every argument of
    their public methods and every field of what they return is named there."""
    import dataclasses
    import inspect

    from teacher_server.client import AsyncTeacherClient, ScoreOutput, Targets, TeacherClient, TeacherRequest
    from teacher_server.client.padding import PaddedScores
    from teacher_server.llm import RequestOutput

    doc = (ROOT / "docs/python.md").read_text()
    names: dict[str, str] = {}
    for cls in (TeacherClient, AsyncTeacherClient):
        for meth in ("__init__", "score", "score_full", "score_batch", "score_batch_full", "score_batch_padded"):
            for p in list(inspect.signature(getattr(cls, meth)).parameters)[1:]:
                names[p] = f"{cls.__name__}.{meth}"
    for cls in (ScoreOutput, Targets, TeacherRequest, PaddedScores, RequestOutput):
        for f in dataclasses.fields(cls):
            names[f.name] = cls.__name__
    # named in code (`name`, `name [...]`, `name(...)`), as an argument (name=...) or a signature's first (f(name, ...)
    missing = sorted(f"{where}: {n}" for n, where in names.items()
                     if not re.search(rf"`{n}[`\s(\[]|\b{n}=|\({n}[,)]", doc))
    assert not missing, missing
