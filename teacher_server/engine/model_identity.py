"""What a multi-node group checks before its nodes load: that every node found the same model.
Each node resolves ``model`` on its own host (a path that names another checkpoint there, an
out-of-date copy, another revision), and nothing in the process group would notice: the same
shapes serve another model's scores, other shapes crash the leader in its first collective.

A fingerprint per file: config.json whole; each safetensors file's size, header (every tensor's
name, dtype, shape and offsets) and the first and last bytes of its tensors (of every one in a
file of up to ``TENSORS``, else of ``TENSORS`` evenly spread), so two copies of one checkpoint agree
and another checkpoint, or a fine-tune of this one, does not (a change that spares those bytes of
every sampled tensor goes unseen). Reading tens of KB per file, not the weights."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

TENSORS = 512  # tensors per weights file whose first and last bytes are read (all, where fewer)
EDGE_BYTES = 64
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


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
        header = f.read(min(n, size, MAX_HEADER))
        h.update(header)
        for begin, end in sampled(_spans(header)):
            for at in (begin,) if end - begin <= EDGE_BYTES else (begin, end - EDGE_BYTES):
                f.seek(8 + n + at)
                h.update(f.read(min(EDGE_BYTES, end - at)))
    return h.hexdigest()[:16]


def _spans(header: bytes) -> list[tuple[int, int]]:
    """Each tensor's data_offsets (relative to the end of the header), sorted; none where the
    header is not a safetensors one (its bytes and size only: the loader says what is wrong)."""
    try:
        spans = [v["data_offsets"] for k, v in json.loads(header).items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    if not all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) and 0 <= s[0] <= s[1]
               for s in spans):
        return []
    return sorted((b, e) for b, e in spans)


def sampled(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """All of ``spans`` up to ``TENSORS``, else ``TENSORS`` of them evenly spread, the last among them."""
    n = len(spans)
    if n <= TENSORS:
        return spans
    return [spans[(i * (n - 1)) // (TENSORS - 1)] for i in range(TENSORS)]


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
