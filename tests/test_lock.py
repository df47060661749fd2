"""requirements.lock, the one dependency lock of the image and the GPU runs: every requirement
of the shipped extras is in it, pinned exactly, inside pyproject.toml's range; the GPU
session installs .whl/ through it."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import lock_wheels  # noqa: E402

SHIPPED = ("server", "linear-attention", "cudnn-frontend", "cuda")  # what the image installs


def shipped_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for name in SHIPPED:
        reqs += [r for r in map(Requirement, extras[name]) if r.name != "teacher-server"]
    return reqs


def test_every_shipped_requirement_is_pinned_in_range() -> None:
    pins = lock_wheels.read_lock()
    for req in shipped_requirements():
        name = lock_wheels.norm(req.name)
        assert name in pins, f"{req} is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])


def test_the_lock_holds_the_measured_stack() -> None:
    """The versions every published GPU number was measured with (bench/results provenance)."""
    pins = lock_wheels.read_lock()
    assert (pins["torch"], pins["triton"], pins["nvidia-cudnn-frontend"], pins["fla-core"]) == \
        ("2.11.0", "3.6.0", "1.32.0", "0.6.0")


def test_a_line_that_is_not_an_exact_pin_is_refused(tmp_path) -> None:
    f = tmp_path / "lock"
    f.write_text("# c\nfastapi==0.165.0  # why\n\nuvicorn>=0.29\n")
    with pytest.raises(ValueError, match=r"lock:4: not an exact pin"):
        lock_wheels.read_lock(f)


def _wheel(folder: Path, name: str, version: str) -> Path:
    w = folder / f"{name}-{version}-py3-none-any.whl"
    w.write_bytes(b"")
    return w


def test_select_installs_the_locked_version_of_each(tmp_path, capsys) -> None:
    pins = {"fastapi": "0.165.0", "pydantic-core": "2.50.5", "einops": "0.8.1"}
    keep = [_wheel(tmp_path, "fastapi", "0.165.0"), _wheel(tmp_path, "pydantic_core", "2.50.5")]
    _wheel(tmp_path, "fastapi", "0.170.0")  # a second download: the locked one is chosen
    _wheel(tmp_path, "requests", "2.0.0")  # not in the lock: left out
    assert sorted(lock_wheels.select(tmp_path, pins, strict=False, refused={})) == sorted(keep)
    assert "requests" in capsys.readouterr().err
    other = _wheel(tmp_path, "einops", "0.7.0")  # only another version: a warning, or refused
    assert other in lock_wheels.select(tmp_path, pins, strict=False, refused={})
    assert "einops: requirements.lock pins 0.8.1, .whl/ has 0.7.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lock_wheels.select(tmp_path, pins, strict=True, refused={})


def test_select_keeps_what_the_machine_image_requires(tmp_path, capsys) -> None:
    """A locked version that an installed package outside the lock refuses (the image's transformers
    and huggingface-hub 2.x) is left out: the image's own stays, said on stderr."""
    info = tmp_path / "site" / "imagepkg-5.17.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: imagepkg\nVersion: 5.17.0\n"
                                   "Requires-Dist: pyyaml<2.0,>=1.5.0\n"
                                   "Requires-Dist: numpy==0.1; extra == \"dev\"\n"
                                   "Requires-Dist: not-installed-here<1\n"
                                   "Requires-Dist: pyyaml<1; python_version < \"3.0\"\n")  # (not here: ignored)
    image = list(md.distributions(path=[str(tmp_path / "site")]))
    pins = {"pyyaml": "6.0.4", "numpy": "2.5.2", "not-installed-here": "3.0"}
    refused = lock_wheels.image_refusals(pins, image)
    # pyyaml 6 is outside <2.0 and installed here; numpy's bound is an optional extra's; a package
    # the machine lacks is installed from the lock whatever the bound
    assert list(refused) == ["pyyaml"] and "imagepkg 5.17.0 requires pyyaml<2.0,>=1.5.0" in refused["pyyaml"]
    assert lock_wheels.image_refusals({"pyyaml": "1.6", "numpy": "2.5.2"}, image) == {}
    wheels = [_wheel(tmp_path, "PyYAML", "6.0.4"), _wheel(tmp_path, "numpy", "2.5.2")]
    assert lock_wheels.select(tmp_path, pins, strict=True, refused=refused) == [wheels[1]]
    assert "PyYAML-6.0.4-py3-none-any.whl: left out" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "version", "ok"), [
    ("<2.0,>=1.5.0", "1.9.9", True), ("<2.0,>=1.5.0", "2.4.0", False), ("<=0.23.0", "0.23.3", False),
    ("~=1.4", "1.9", True), ("~=1.4.2", "1.5.0", False), ("==2.*", "3.0", False), ("==2.*", "2.4.1", True),
    ("!=2.4.*", "2.4.0", False), ("!=2.4.*", "2.5", True), ("==2.*.1", "3.0", True), ("!=1.0", "1.0.0", False),
    ("", "1.0", True), (">0.21.1", "0.21.1rc1", False),
])
def test_version_bounds(spec: str, version: str, ok: bool) -> None:
    assert lock_wheels._allows(spec, version) is ok


def test_check_reports_each_locked_package(capsys) -> None:
    from importlib.metadata import version

    off = lock_wheels.check({"pyyaml": version("pyyaml"), "no-such-dist": "1.0", "numpy": "0.0.1"})
    lines = capsys.readouterr().out.splitlines()
    assert off == 2 and lines[0].endswith("ok") and lines[1].endswith("missing") and lines[2].endswith("DIFFERENT")


def test_gpu_session_installs_through_the_lock() -> None:
    script = (ROOT / "bench" / "gpu_session.sh").read_text()
    assert "bench/lock_wheels.py select .whl" in script and "bench/lock_wheels.py check" in script
    assert re.search(r"ttr\)", script) and "bench/time_to_ready.py" in script
    r = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_session.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
