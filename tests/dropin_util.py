"""A tiny Qwen3 checkpoint with a tokenizer.json (written with the ``tokenizers`` package: a
word-level vocabulary of the model's 512 ids), served on CPU, and the float64 reference of
its log-probs, for the trainers' endpoints and the real client libraries' tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

VOCAB = 512


def with_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` with a word-level tokenizer.json ("w0" ... "w511", split on
    whitespace; id 0 is the unknown word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(src, dst)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(dst / "tokenizer.json"))
    return dst


def reference_logprobs(path: Path, toks: list[int]) -> np.ndarray:
    """[L, V] float64 log-probs of the float32 transformers forward (row p predicts p + 1)."""
    from reference import reference_logprobs as ref

    return ref(path, toks)
