"""The house's floors: a module imports only from its own floor or the floors below, no
module imports itself back through others (no cycle, lazy imports inside functions counted
too), and modules stay small enough to read in one sitting. Read from the source with ``ast``,
so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "teacher_server"

# Lowest first; a top-level module or package of teacher_server on each floor.
FLOORS: tuple[frozenset[str], ...] = (
    # plain data and helpers that know nothing of the engine
    frozenset({"step_context", "cache_layout", "b64", "npy", "candidates", "logging_setup", "routing", "config", "heap",
               "hub", "demo_model", "unsupported", "human_int", "compile_cache", "targets", "did_you_mean",
               "teachers", "parallel_settings", "env_names"}),
    frozenset({"ops"}),  # kernels and their references
    frozenset({"kv_pool", "attention"}),  # the cache's owner; attention backends
    frozenset({"layers"}),  # layers built from plain sizes
    frozenset({"models"}),  # families: layers composed from a spec
    frozenset({"engine"}),
    frozenset({"validation", "client"}),  # request rules; the HTTP client (numpy only)
    frozenset({"llm", "replicas"}),  # the in-process API; engine replicas in processes of their own
    frozenset({"server"}),
    frozenset({"cli", "__main__", "vllm_flags", "cli_reference", "benchmark"}),  # the command line; `teacher-server bench` (client, engine shapes)
)
# Modules may be longer than this only where the list below says why.
MAX_LINES = 350
LONGER: dict[str, str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The teacher_server modules ``name`` imports (at any depth of its code)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "teacher_server"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "teacher_server":
                continue
            for a in node.names:  # `from teacher_server.x import y`: y may be a module
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    return found - {name}


def floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module} is on no floor: add {top!r} to FLOORS")


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    """The package's own ``__init__`` is the public facade: it may name anything, lazily (in a
    function), and nothing at module level."""
    g = graph()
    facade = ast.parse((PACKAGE / "__init__.py").read_text())
    assert not [n for n in facade.body if isinstance(n, (ast.Import, ast.ImportFrom))
                and (getattr(n, "module", "") or "").startswith("teacher_server")]
    upward = sorted(f"{a} -> {b}" for a, bs in g.items() if a != "teacher_server"
                    for b in bs if b != "teacher_server" and floor(b) > floor(a))
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    g = graph()
    g["teacher_server"] = set()  # the facade's lazy names are the public API, not a dependency
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                cycles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_modules_stay_readable() -> None:
    long = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    over = {m: n for m, n in long.items() if n > MAX_LINES and m not in LONGER}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_the_checks_can_fail() -> None:
    """An upward import and a cycle are found (on made-up modules)."""
    known = {"teacher_server.layers.x", "teacher_server.models.spec", "teacher_server.engine.a"}
    src = "from teacher_server.models import spec\n\ndef f():\n    import teacher_server.engine.a\n"
    tmp = PACKAGE.parent / "build" / "layering_probe.py"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(src)
    try:
        found = imports("teacher_server.layers.x", tmp, known)
    finally:
        tmp.unlink()
    assert found == {"teacher_server.models.spec", "teacher_server.engine.a"}
    assert all(floor(b) > floor("teacher_server.layers.x") for b in found)
