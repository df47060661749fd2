"""The checkpoint's tokenizer for the trainers' endpoints (text prompts, ``decoded_token``):
``tokenizer.json`` from the model directory, read with the ``tokenizers`` package (the fast
tokenizer format every recent checkpoint ships; no ``transformers`` at run time). A
checkpoint without one serves token ids only: text is refused with a 400 that says so."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from teacher_server.validation import BadRequest

NO_TOKENIZER = "this model directory has no tokenizer.json, so {what} is not available: {hint}"
AS_IDS = "send the prompt as token ids"


class Tokenizer:
    """Encode text, decode single ids (cached: a response repeats the same ids many times)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._pieces: dict[int, str] = {}

    @classmethod
    def load(cls, model_dir: str | Path | None) -> Tokenizer | None:
        """The tokenizer of ``model_dir`` (None when it has no tokenizer.json)."""
        path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
        if path is None or not path.is_file():
            return None
        from tokenizers import Tokenizer as HFTokenizer  # (the server extra's dependency)

        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str, add_special_tokens: bool = True, keep: int | None = None,
               side: str = "left") -> list[int]:
        """``text``'s ids; ``keep``: at most that many, cut on ``side`` as a Hugging Face tokenizer
        truncates (room kept for the special tokens, which are added after the cut)."""
        if keep is None:
            return self.inner.encode(text, add_special_tokens=add_special_tokens).ids
        enc = self.inner.encode(text, add_special_tokens=False)
        pp = self.inner.post_processor
        extra = pp.num_special_tokens_to_add(False) if add_special_tokens and pp is not None else 0
        enc.truncate(max(keep - extra, 0), direction=side)
        return self.inner.post_process(enc, None, add_special_tokens).ids if add_special_tokens else enc.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def continuation(self, context: list[int], ids: list[int], skip_special_tokens: bool = True,
                     last: int | None = None) -> str:
        """The text ``ids`` add after ``context``, as an incremental detokenizer gives a generated
        token's: a space that a word-piece or sentencepiece decoder puts before a word comes with
        it, which decoding the ids alone drops. ``last`` None: vLLM's (tokenizers' DecodeStream
        primed with the shortest suffix of 4 to 23 ids that decodes whole, else all of
        ``context``: the bytes of a character split across tokens come out once it is whole, so
        its first piece adds no text); ``last``: SGLang's (the ids decoded after the context's
        ``last`` ids, less what those decode to)."""
        if last is not None:
            ctx = context[-last:] if last else []
            return self.decode(ctx + ids, skip_special_tokens)[len(self.decode(ctx, skip_special_tokens)):]
        from tokenizers.decoders import DecodeStream

        suffix = context
        for n in range(4, min(len(context) + 1, 24)) if len(context) > 4 else ():
            if "\ufffd" not in self.inner.decode(context[-n:]):
                suffix = context[-n:]
                break
        stream = [DecodeStream(skip_special_tokens=skip_special_tokens)]

        def step(i: int) -> str:
            try:
                return stream[0].step(self.inner, i) or ""
            except Exception as e:  # non-monotonic UTF-8 breaks the stream's state: a fresh one, as vLLM does
                if not str(e).startswith("Invalid prefix"):
                    raise
                stream[0] = DecodeStream(skip_special_tokens=skip_special_tokens)
                return stream[0].step(self.inner, i) or ""

        for i in suffix:
            step(i)
        return "".join(step(i) for i in ids)

    def pieces(self, ids: Iterable[int]) -> dict[int, str]:
        """Each id decoded alone (``decoded_token``), the new ones in one batch call."""
        new = sorted({int(i) for i in ids} - self._pieces.keys())
        if new:
            for i, text in zip(new, self.inner.decode_batch([[i] for i in new], skip_special_tokens=False)):
                self._pieces[i] = text
        return self._pieces


def require(tok: Tokenizer | None, what: str, hint: str = AS_IDS) -> Tokenizer:
    """The tokenizer, or the 400 that says the model has none."""
    if tok is None:
        raise BadRequest(NO_TOKENIZER.format(what=what, hint=hint))
    return tok
