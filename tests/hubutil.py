"""A Hugging Face hub cache laid out by hand, as huggingface_hub writes it, for offline tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, src: Path, sha: str, refs: tuple[str, ...] = ("main",),
                 skip: tuple[str, ...] = ()) -> Path:
    """Put the files of `src` (minus `skip`) into the hub cache `cache` as commit `sha` of
    `repo_id`, pointed to by `refs`: models--org--name/{blobs/<sha256>, snapshots/<sha>/<file>
    -> ../../blobs/<sha256>, refs/<ref>}. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return snap
