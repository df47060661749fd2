"""``GET /v1/models`` says what a student needs to check before scoring against this teacher:
the vocab size and the identity of the checkpoint's tokenizer; ``check_tokenizer`` compares it
with a student's tokenizer files and refuses a mismatch."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import LiveServer

from teacher_server.client import TokenizerMismatch, check_tokenizer, fetch_model_card, tokenizer_identity


def _tokenizer(vocab: dict[str, int], added: list[tuple[int, str]], indent: int | None = None) -> str:
    return json.dumps({"version": "1.0", "truncation": None if indent is None else {"max_length": 8},
                       "added_tokens": [{"id": i, "content": c, "special": True} for i, c in added],
                       "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}, indent=indent)


VOCAB = {"a": 0, "b": 1, "ab": 2}
ADDED = [(3, "<|endoftext|>")]


def test_identity_is_the_mapping_not_the_bytes(tmp_path) -> None:
    one, two, other, none = (tmp_path / n for n in ("one", "two", "other", "none"))
    for d in (one, two, other, none):
        d.mkdir()
    (one / "tokenizer.json").write_text(_tokenizer(VOCAB, ADDED))
    (two / "tokenizer.json").write_text(_tokenizer(dict(reversed(VOCAB.items())), ADDED, indent=2))  # reordered
    (other / "tokenizer.json").write_text(_tokenizer({**VOCAB, "ab": 4}, ADDED))
    assert tokenizer_identity(one) == tokenizer_identity(two)
    assert tokenizer_identity(one)["source"] == "tokenizer.json"
    assert tokenizer_identity(other) != tokenizer_identity(one)
    assert tokenizer_identity(none) is None
    (none / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    assert tokenizer_identity(none)["source"] == "tokenizer.model"


@pytest.fixture(scope="module")
def teacher(checkpoints, tmp_path_factory):
    from teacher_server.config import Config

    d = tmp_path_factory.mktemp("teacher") / "qwen3"
    shutil.copytree(checkpoints["qwen3"], d)
    (d / "tokenizer.json").write_text(_tokenizer(VOCAB, ADDED))
    cfg = Config(model=str(d), device="cpu", max_num_batched_tokens=128, num_kv_blocks=64, max_model_len=256)
    with LiveServer(cfg) as s:
        yield s


def test_models_reports_vocab_size_and_tokenizer(teacher, demo_server, tmp_path) -> None:
    card = fetch_model_card(teacher.url)
    with open(teacher.cfg.model + "/config.json") as f:
        assert card["vocab_size"] == json.load(f)["vocab_size"]
    assert card["tokenizer"] == tokenizer_identity(teacher.cfg.model)
    # vLLM's ModelCard fields too (clients that parse the whole card, as vLLM's own models do)
    assert card["parent"] is None and card["object"] == "model"
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_logprobs"] is True and perm["organization"] == "*" and perm["group"] is None
    assert fetch_model_card(demo_server.url)["tokenizer"] is None  # the demo checkpoint has none

    student = tmp_path / "student"
    student.mkdir()
    (student / "tokenizer.json").write_text(_tokenizer(VOCAB, ADDED, indent=1))
    assert check_tokenizer(teacher.url, student, vocab_size=card["vocab_size"])["id"] == card["id"]
    with pytest.raises(TokenizerMismatch, match="larger than the teacher's"):
        check_tokenizer(teacher.url, student, vocab_size=card["vocab_size"] + 1)
    (student / "tokenizer.json").write_text(_tokenizer({"a": 1, "b": 0}, ADDED))
    with pytest.raises(TokenizerMismatch, match="must share a tokenizer"):
        check_tokenizer(teacher.url, student)
    with pytest.raises(TokenizerMismatch, match="no tokenizer files"):
        check_tokenizer(demo_server.url, student)


def test_hub_downloads_the_files_the_identity_reads() -> None:
    from teacher_server import hub
    from teacher_server.client import tokenizer

    assert hub.TOKENIZER_FILES == tokenizer.TOKENIZER_FILES
