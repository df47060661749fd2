"""transformers' fine-grained FP8 path without network: its Triton kernel package from a folder.

transformers (5.x) runs an FP8 checkpoint's linear layers through the ``finegrained-fp8``
kernel of the ``kernels-community`` hub organisation, which its ``kernels`` package downloads
at first use. The GPU machine has no network, so ``fp8_accuracy.py`` takes the kernel's
source folder instead (the ``torch-ext/finegrained_fp8`` folder of a checkout of
``huggingface/kernels-community`` at a commit whose ``build.toml`` has the version
transformers' ``_HUB_KERNEL_MAPPING`` asks for; it is pure Python and Triton):

    python bench/fp8_accuracy.py --hf-fp8-kernel PATH/finegrained-fp8/torch-ext/finegrained_fp8

``install(path)`` imports that folder as a package and puts it where transformers' loader looks
first (``hub_kernels._KERNEL_MODULE_MAPPING``), so transformers' own dispatch picks it as it
would the downloaded build. The kernel's build step generates one module, ``_ops``: the
namespace its ``torch.library`` ops are registered in; ``install`` makes it in memory. DeepGEMM,
which transformers prefers where it loads, needs the ``kernels`` package and nvcc at run time;
without them transformers takes the Triton kernel (its documented fallback), the recipe of this
server's block-wise path (1 x 128 activation groups, 128 x 128 weight blocks).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

PACKAGE = "finegrained_fp8"


def _ops_module(name: str, namespace: str) -> types.ModuleType:
    """The ``_ops`` module a kernel build writes: the op namespace and its prefixer."""
    mod = types.ModuleType(name)
    mod.ops = getattr(torch.ops, namespace)
    mod.add_op_namespace_prefix = lambda op: f"{namespace}::{op}"
    return mod


def load(path: str | Path) -> types.ModuleType:
    """Import the kernel package in ``path`` (a folder holding its ``__init__.py``)."""
    path = Path(path).resolve()
    init = path / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"{path} is not the finegrained_fp8 package folder (no __init__.py)")
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    # one namespace per source folder, as the builds name theirs (a hash suffix)
    namespace = f"_{PACKAGE}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    sys.modules[f"{PACKAGE}._ops"] = _ops_module(f"{PACKAGE}._ops", namespace)
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        unload()
        raise
    return mod


def unload() -> None:
    """Forget the imported package and its modules (the next ``load`` imports its folder anew)."""
    for name in [n for n in sys.modules if n.split(".")[0] == PACKAGE]:
        del sys.modules[name]


def install(path: str | Path) -> dict:
    """Load the kernel and hand it to transformers' FP8 integration; returns what was installed
    (for the results file): the folder, the kernel's version from ``build.toml`` where the folder
    sits in a checkout, and the version transformers asks for."""
    from transformers.integrations import finegrained_fp8 as tf_fp8
    from transformers.integrations import hub_kernels

    mod = load(path)
    missing = [n for n in ("matmul_2d", "matmul_batched", "matmul_grouped") if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"the kernel in {path} lacks {', '.join(missing)}: not the version transformers calls")
    hub_kernels._KERNEL_MODULE_MAPPING["finegrained-fp8"] = mod
    # transformers checks for the `kernels` package before it looks the module up; the module is
    # in its table already, so the check has nothing left to guard
    tf_fp8.is_kernels_available = lambda: True
    info = {"path": str(Path(path).resolve()),
            "asked_version": hub_kernels._HUB_KERNEL_MAPPING.get("finegrained-fp8", {}).get("version")}
    build = Path(path).resolve().parents[1] / "build.toml"
    if build.is_file():
        for line in build.read_text().splitlines():
            if line.strip().startswith("version"):
                info["kernel_version"] = int(line.split("=")[1].strip())
                break
    return info
