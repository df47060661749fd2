"""requirements.lock on the GPU machine (standard library only: it runs before anything is
installed).

  python3 bench/lock_wheels.py download .whl   # fetch the lock's wheels the GPU image lacks (Python 3.12, x86-64)
  python3 bench/lock_wheels.py select .whl     # the wheels of .whl/ to install: the locked version of each
  python3 bench/lock_wheels.py check           # what this Python has against the lock (a table; 1 line each)

``select`` prints one path per line. A package of the lock with only another version in the
folder is a warning (its wheel is installed, and ``check`` reports it), or an error with
``--strict``; a wheel of a package the lock does not name is left out. A locked wheel that a
package of the machine's image outside the lock refuses (transformers, the GPU tests' and the
baselines' reference, bounds huggingface-hub below the lock's 2.x) is left out too, the image's
own version kept, and said on stderr; ``check`` then lists it as different."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
# in the GPU machine's image already (its torch build), or built from source (flash-attn)
NOT_DOWNLOADED = {"torch", "triton", "numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "flash-attn",
                  "ninja"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")


def norm(name: str) -> str:
    """A distribution's name as PEP 503 compares them (Foo_Bar.baz -> foo-bar-baz)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """name -> exact version, from ``name==version`` lines (comments and blanks skipped)."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: not an exact pin (name==version): {raw!r}")
        pins[norm(m.group(1))] = m.group(2)
    return pins


def wheel_id(path: Path) -> tuple[str, str]:
    """(name, version) of a wheel file name (name-version[-build]-python-abi-platform.whl)."""
    parts = path.name[: -len(".whl")].split("-")
    return norm(parts[0]), parts[1]


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (1.5.0rc1 -> (1, 5, 0)), for the bounds below."""
    return tuple(int(m.group()) for m in (re.match(r"\d+", x) for x in version.split(".")) if m)


def _allows(spec: str, version: str) -> bool:
    """Whether ``version`` meets a requirement's comma-separated specifiers (==, !=, <, <=, >, >=,
    ~=; ``==X.*`` and ``!=X.*`` as the release's prefix; local labels read loosely: a bound this
    cannot read allows)."""
    have = _release(version)
    for part in filter(None, (x.strip() for x in spec.split(","))):
        m = re.fullmatch(r"(==|!=|<=|>=|~=|<|>)\s*([0-9][0-9A-Za-z.*+!-]*)", part)
        if m is None:
            continue
        if "*" in m.group(2):
            prefix = m.group(2).removesuffix(".*")
            if m.group(1) not in ("==", "!=") or "*" in prefix:
                continue
            bound = _release(prefix)
            if (have[:len(bound)] + (0,) * (len(bound) - len(have)) == bound) != (m.group(1) == "=="):
                return False
            continue
        op, bound = m.group(1), _release(m.group(2))
        n = max(len(have), len(bound))
        a, b = have + (0,) * (n - len(have)), bound + (0,) * (n - len(bound))
        ok = {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b,
              "~=": a >= b and a[:len(bound) - 1] == b[:len(bound) - 1]}[op]
        if not ok:
            return False
    return True


def image_refusals(pins: dict[str, str], dists: Iterable[md.Distribution] | None = None) -> dict[str, str]:
    """name -> why, for each locked package already installed here whose locked version an
    installed distribution outside the lock (of ``dists``: all) requires otherwise (its optional
    extras aside)."""
    why: dict[str, str] = {}
    seen: set[str] = set()
    for dist in md.distributions() if dists is None else dists:
        owner = norm(dist.metadata["Name"] or "")
        if not owner or owner in pins or owner in seen:  # (the first on the path is the one imported)
            continue
        seen.add(owner)
        for req in dist.requires or ():
            body, _, marker = req.partition(";")
            if not _applies(marker):
                continue
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?", body)
            if m is None:
                continue
            name = norm(m.group(1))
            if name in pins and not _allows(m.group(2), pins[name]) and _installed(name):
                why[name] = f"{owner} {dist.version} requires {name}{m.group(2).replace(' ', '')}"
    return why


def _applies(marker: str) -> bool:
    """Whether a requirement's environment marker holds here: an optional extra's never; others as
    ``packaging`` evaluates them where it is installed (the GPU image has it), else taken to hold."""
    if "extra" in marker:
        return False
    if not marker.strip():
        return True
    try:
        from packaging.markers import Marker

        return Marker(marker).evaluate()
    except Exception:  # (no packaging, or a marker it cannot read)
        return True


def _installed(name: str) -> bool:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def select(folder: Path, pins: dict[str, str], strict: bool,
           refused: dict[str, str] | None = None) -> list[Path]:
    refused = image_refusals(pins) if refused is None else refused
    by_name: dict[str, list[Path]] = {}
    for w in sorted(folder.glob("*.whl")):
        by_name.setdefault(wheel_id(w)[0], []).append(w)
    chosen, problems = [], []
    for name, wheels in sorted(by_name.items()):
        if name not in pins:
            print(f"lock_wheels: {wheels[0].name}: not in requirements.lock, left out", file=sys.stderr)
            continue
        if name in refused:
            print(f"lock_wheels: {wheels[0].name}: left out, this machine's own {name} {md.version(name)} kept: "
                  f"{refused[name]}", file=sys.stderr)
            continue
        exact = [w for w in wheels if wheel_id(w)[1] == pins[name]]
        if exact:
            chosen.append(exact[0])
            continue
        problems.append(f"{name}: requirements.lock pins {pins[name]}, .whl/ has "
                        f"{', '.join(wheel_id(w)[1] for w in wheels)}")
        chosen.append(max(wheels, key=lambda w: [int(x) if x.isdigit() else 0 for x in wheel_id(w)[1].split(".")]))
    for p in problems:
        print(f"lock_wheels: {'ERROR' if strict else 'WARNING'}: {p} (fetch it: bench/lock_wheels.py download)",
              file=sys.stderr)
    if problems and strict:
        raise SystemExit(1)
    return chosen


def check(pins: dict[str, str]) -> int:
    """Print each locked package's installed version; returns how many differ or are missing."""
    off = 0
    for name, want in pins.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        local = have.split("+")[0] if have else None  # torch 2.11.0+cu130 is 2.11.0
        status = "ok" if local == want else ("missing" if have is None else "DIFFERENT")
        off += status != "ok"
        print(f"{name:<24} {want:<20} {have or '-':<24} {status}")
    return off


def download(folder: Path, pins: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = [f"{n}=={v}" for n, v in pins.items() if n not in NOT_DOWNLOADED]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(folder), *wanted],
                   check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["select", "check", "download"])
    ap.add_argument("folder", nargs="?", default=".whl")
    ap.add_argument("--strict", action="store_true", help="select: refuse a wheel of another version")
    ap.add_argument("--lock", default=str(LOCK))
    args = ap.parse_args()
    pins = read_lock(Path(args.lock))
    if args.command == "select":
        print("\n".join(str(w) for w in select(Path(args.folder), pins, args.strict)))
    elif args.command == "check":
        off = check(pins)
        print(f"{off} of {len(pins)} locked packages differ or are missing here")
    else:
        download(Path(args.folder), pins)


if __name__ == "__main__":
    main()
