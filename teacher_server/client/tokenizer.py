"""Tokenizer identity: teacher and student must share a tokenizer (the service scores token
ids; ids from another vocabulary are scored as whatever the teacher's ids mean). The server
reports its checkpoint's identity and vocab size in ``GET /v1/models``; ``check_tokenizer``
compares them with a student's tokenizer files before a run.

The identity is the token <-> id mapping, not the file's bytes: two ``tokenizer.json`` files
that map the same strings to the same ids (a different pretty-printing, padding or truncation
setting, chat template) have the same identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx

MODELS_PATH = "/v1/models"
# what tokenizer_identity reads, in its order (the hub download fetches them: teacher_server/hub.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


class TokenizerMismatch(ValueError):
    """The student's tokenizer is not the teacher's (or the vocab sizes disagree)."""


def tokenizer_identity(directory: str | Path) -> dict[str, str] | None:
    """``{"sha256": hex, "source": file}`` of the tokenizer files in a checkpoint or tokenizer
    directory, or None when it has none. Read in this order: ``tokenizer.json`` (its vocabulary
    model and added tokens), ``tokenizer.model`` (SentencePiece, as bytes), ``vocab.json`` with
    ``merges.txt`` (byte-level BPE)."""
    d = Path(directory)
    h = hashlib.sha256()
    if (d / "tokenizer.json").is_file():
        tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        added = sorted((int(t["id"]), str(t["content"])) for t in tok.get("added_tokens") or [])
        h.update(json.dumps({"model": tok.get("model"), "added_tokens": added}, sort_keys=True,
                            ensure_ascii=False, separators=(",", ":")).encode())
        return {"sha256": h.hexdigest(), "source": "tokenizer.json"}
    if (d / "tokenizer.model").is_file():
        h.update((d / "tokenizer.model").read_bytes())
        return {"sha256": h.hexdigest(), "source": "tokenizer.model"}
    if (d / "vocab.json").is_file():
        vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
        h.update(json.dumps(vocab, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
        if (d / "merges.txt").is_file():
            h.update(b"\0" + (d / "merges.txt").read_bytes())
        return {"sha256": h.hexdigest(), "source": "vocab.json"}
    return None


def fetch_model_card(base_url: str, api_key: str | None = None, timeout: float = 30.0,
                     model: str | None = None) -> dict[str, Any]:
    """The served model's entry of ``GET /v1/models`` (id, max_model_len, vocab_size, tokenizer):
    the teacher named ``model`` (its name, the card's ``id``) where the server has several, else
    the first; a name it does not list is a ``ValueError`` naming those it does."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key is not None else {}
    r = httpx.get(base_url.rstrip("/") + MODELS_PATH, headers=headers, timeout=timeout)
    r.raise_for_status()
    cards = r.json()["data"]
    if model is None:
        return cards[0]
    for card in cards:
        if card["id"] == model:
            return card
    raise ValueError(f"the server serves no teacher {model!r}; it serves {', '.join(c['id'] for c in cards)}")


def check_tokenizer(base_url: str, student: str | Path, *, vocab_size: int | None = None,
                    api_key: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Raise ``TokenizerMismatch`` unless the student's tokenizer (a checkpoint or tokenizer
    directory) is the served teacher's (``model``: which, where the server has several), and,
    given ``vocab_size`` (the student's logits width), unless the teacher's vocab holds every id
    the student can emit. Returns the teacher's model card. A teacher checkpoint without
    tokenizer files cannot be checked: that raises too, naming what to do, since scoring ids of
    an unknown vocabulary is the failure this check exists for."""
    card = fetch_model_card(base_url, api_key, model=model)
    theirs = card.get("tokenizer")
    if vocab_size is not None and vocab_size > card["vocab_size"]:
        raise TokenizerMismatch(f"the student's vocab ({vocab_size}) is larger than the teacher's "
                                f"({card['vocab_size']}): ids past {card['vocab_size'] - 1} cannot be scored")
    if theirs is None:
        raise TokenizerMismatch(f"the teacher checkpoint ({card.get('root')}) has no tokenizer files to compare; "
                                "put the teacher's tokenizer.json beside its config.json")
    mine = tokenizer_identity(student)
    if mine is None:
        raise TokenizerMismatch(f"{student} has no tokenizer.json, tokenizer.model or vocab.json")
    if mine["sha256"] != theirs["sha256"]:
        raise TokenizerMismatch(f"the student's tokenizer ({student}/{mine['source']}, sha256 "
                                f"{mine['sha256'][:12]}) is not the teacher's ({theirs['source']}, "
                                f"{theirs['sha256'][:12]}): teacher and student must share a tokenizer")
    return card
