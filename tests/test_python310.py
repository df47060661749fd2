"""The package claims Python 3.10 (pyproject's requires-python): no name of the standard library
that 3.10 lacks is used outside a version guard (``enum.StrEnum`` had made the whole server fail
to import there), and where a 3.10 interpreter is on this machine, every file compiles with it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("teacher_server", "bench", "examples")

# what the standard library gained in 3.11 and 3.12 (module -> names; None: the module itself)
NEW: dict[str, set[str] | None] = {
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum",
             "show_flag_values"},
    "typing": {"Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "get_overloads", "clear_overloads",
               "override", "TypeAliasType", "get_protocol_members", "is_protocol"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier", "BrokenBarrierError"},
    "datetime": {"UTC"}, "hashlib": {"file_digest"}, "contextlib": {"chdir"}, "itertools": {"batched"},
    "logging": {"getLevelNamesMapping"}, "operator": {"call"}, "math": {"cbrt", "exp2", "sumprod"},
    "inspect": {"markcoroutinefunction", "getasyncgenstate"}, "tomllib": None, "wsgiref.types": None,
}
BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}


def _newer_than_310(test: ast.expr) -> bool | None:
    """For ``sys.version_info >= (3, 11)`` (or ``>`` a 3.11 bound): True, its body runs on 3.11+
    only; for ``< (3, 11)`` (or ``<=``): False, its ``else`` does; None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and "version_info" in ast.unparse(test.left)):
        return None
    try:
        version = tuple(ast.literal_eval(test.comparators[0]))
    except (ValueError, TypeError):
        return None
    if version[:2] < (3, 11):  # (``> (3, 10)`` holds on 3.10.1: only a 3.11 bound keeps 3.10 out)
        return None
    op = type(test.ops[0])
    return True if op in (ast.GtE, ast.Gt) else False if op in (ast.Lt, ast.LtE) else None


def guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """In the branch of an ``if sys.version_info ...`` that runs on 3.11+ only, or in the body
    of a ``try`` that catches ImportError/AttributeError (not in its handlers)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.If) and (newer := _newer_than_310(node.test)) is not None:
            if child in (node.body if newer else node.orelse):
                return True
        if isinstance(node, ast.Try) and child in node.body and any(h.type is not None and any(
                n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError", "AttributeError"))
                for h in node.handlers):
            return True
    return False


def uses_of_new_names(source: str) -> list[str]:
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.ImportFrom) and node.module in NEW:
            names = NEW[node.module]
            bad = [a.name for a in node.names if names is None or a.name in names]
            what = bad and f"from {node.module} import {', '.join(bad)}"
        elif isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name in NEW and NEW[a.name] is None]
            what = bad and f"import {', '.join(bad)}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in NEW:
            names = NEW[node.value.id]
            what = names is not None and node.attr in names and f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in BUILTINS:
            what = node.id
        elif type(node).__name__ == "TryStar":
            what = "except*"
        if what and not guarded(node, parents):
            found.append(f"line {node.lineno}: {what}")
    return found


def test_no_standard_library_name_newer_than_python_310() -> None:
    bad = {str(f.relative_to(ROOT)): u for d in DIRS for f in sorted((ROOT / d).rglob("*.py"))
           if (u := uses_of_new_names(f.read_text()))}
    assert not bad, f"names Python 3.10 lacks, outside a version guard: {bad}"
    assert uses_of_new_names("from enum import StrEnum\n") == ["line 1: from enum import StrEnum"]
    assert uses_of_new_names("import sys\nif sys.version_info >= (3, 11):\n    from enum import StrEnum\n") == []
    assert uses_of_new_names("if sys.version_info < (3, 11):\n    pass\nelse:\n    from enum import StrEnum\n") == []
    assert uses_of_new_names("try:\n    import tomllib\nexcept ImportError:\n    tomllib = None\n") == []
    for unguarded in ("if sys.version_info < (3, 11):\n    from enum import StrEnum\n",  # the 3.10 branch
                      "if sys.version_info >= (3, 11):\n    pass\nelse:\n    from enum import StrEnum\n",
                      "try:\n    import x\nexcept ImportError:\n    from enum import StrEnum\n",
                      "if sys.version_info > (3, 10):\n    from enum import StrEnum\n",  # (3.10.1 > (3, 10))
                      "if sys.version_info <= (3, 10):\n    pass\nelse:\n    from enum import StrEnum\n"):
        assert uses_of_new_names(unguarded) == ["line " + str(unguarded.count("\n")) + ": from enum import StrEnum"]


def python310() -> str | None:
    """A working Python 3.10 interpreter of this machine (pyenv's shim answers only where selected)."""
    for exe in [*map(str, sorted(Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))), shutil.which("python3.10")]:
        if exe and subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                                  capture_output=True, timeout=60).returncode == 0:
            return exe
    return None


def test_every_file_compiles_under_python_310(tmp_path: Path) -> None:
    exe = python310()
    if exe is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    for d in DIRS + ("tests",):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([exe, "-m", "compileall", "-q", *(str(tmp_path / d) for d in DIRS + ("tests",))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # ErrorKind and the shim it is built on, alone (the interpreter may lack numpy, which the module imports)
    tree = ast.parse((ROOT / "teacher_server/engine/request.py").read_text())
    kept = [n for n in tree.body if (isinstance(n, ast.Import) and {a.name for a in n.names} <= sys.stdlib_module_names) or (isinstance(n, ast.If) and _newer_than_310(n.test))
            or (isinstance(n, ast.ClassDef) and n.name == "ErrorKind")]
    check = ast.unparse(ast.Module(body=kept, type_ignores=[])) + (
        "\nassert str(ErrorKind.TIMEOUT) == 'timeout' and f'{ErrorKind.CANCELLED}' == 'cancelled'"
        "\nassert '%s' % ErrorKind.TIMEOUT == 'timeout' and ErrorKind('timeout') is ErrorKind.TIMEOUT == 'timeout'\n")
    r = subprocess.run([exe, "-c", check], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, check + r.stderr[-2000:]
