"""What a multi-node group checks before its nodes load: that every node found the same model.
Each node resolves ``model`` on its own host (a path that names another checkpoint there, an
out-of-date copy, another revision), and nothing in the process group would notice: the same
shapes serve another model's scores, other shapes crash the leader in its first collective.

A fingerprint per file: config.json whole; each safetensors file's size, header (every tensor's
name, dtype, shape and offsets) and samples of its data at fixed places, so two copies of one
checkpoint agree and a fine-tune of it (every weight moved) does not. Reading a few hundred KB per
file, not the weights."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLES = 16  # data samples per weights file
SAMPLE_BYTES = 4096


def _file_digest(path: Path, weights: bool) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        if not weights:
            h.update(f.read())
            return h.hexdigest()[:16]
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(f.read(min(n, size)))
        start = 8 + n
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def model_fingerprint(model_dir: Path, weights: bool) -> dict[str, str]:
    """File name -> digest: config.json, and the weights files (``weights``: not a dummy load)."""
    from teacher_server.models.loader import checkpoint_files

    out = {"config.json": _file_digest(model_dir / "config.json", weights=False)}
    if weights:
        for f in checkpoint_files(model_dir):
            out[f.name] = _file_digest(f, weights=True)
    return out


def compare(leader: dict[str, str], mine: dict[str, str], where: Path) -> None:
    """Raise ``ValueError`` naming what differs between the leader's model and this node's."""
    if leader == mine:
        return
    diff = sorted(n for n in leader.keys() | mine.keys() if leader.get(n) != mine.get(n))

    def how(name: str) -> str:
        return "missing here" if name not in mine else "not in the leader's" if name not in leader else "differs"
    what = "; ".join(f"{n} {how(n)}" for n in diff[:4]) + (" ..." if len(diff) > 4 else "")
    raise ValueError(f"this node's model at {where} is not the leader's: {what} (every node must load the same "
                     f"checkpoint: the same path, revision and files)")
