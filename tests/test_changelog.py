"""CHANGELOG.md names commits of this repository's history (a hash that is not in it is a typo
or a commit lost in a rewrite)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_commit_the_changelog_names_exists() -> None:
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the history")
    hashes = set(re.findall(r"`([0-9a-f]{7})`", (ROOT / "CHANGELOG.md").read_text()))
    assert len(hashes) > 50
    missing = [h for h in sorted(hashes) if subprocess.run(["git", "cat-file", "-e", f"{h}^{{commit}}"], cwd=ROOT,
                                                           capture_output=True).returncode != 0]
    assert not missing, missing
