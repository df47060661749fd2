"""``.npy`` decoding without ``np.load`` (``teacher_server.npy``): the same arrays as
``np.load``, the same refusals, and no failure while another thread parses Python source."""

from __future__ import annotations

import ast
import base64
import gc
import io
import re
import sys
import threading

import numpy as np
import pytest

from teacher_server.client.protocol import parse_output
from teacher_server.npy import load_npy
from teacher_server.validation import BadRequest, decode_npy

PARAM = "sampling_params.prompt_logprob_token_ids"


def _npy(arr: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


ARRAYS = [
    np.arange(12, dtype="<i4").reshape(3, 4),
    np.arange(5, dtype=np.int64),
    np.zeros((0, 4), np.int32),
    np.zeros(0, np.int32),
    np.array(7, np.int64),  # 0-d
    np.arange(24, dtype=">i4").reshape(2, 3, 4),  # big-endian, 3-D
    np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),  # fortran_order: True
    np.arange(6, dtype=np.uint8),
    np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4),
    np.array([True, False]),
    np.array(["ab", "c"]),
    np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8", (2,))]),  # structured: a list descr
]


@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_same_array_as_np_load(arr: np.ndarray, version) -> None:
    raw = _npy(arr, version)
    got = load_npy(raw)
    want = np.load(io.BytesIO(raw), allow_pickle=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert got.flags.writeable  # a copy, not a read-only view of raw


def test_trailing_bytes_are_ignored_as_np_load_does() -> None:
    raw = _npy(np.arange(4, dtype=np.int32)) + b"\0\0\0\0"
    np.testing.assert_array_equal(load_npy(raw), np.arange(4))


@pytest.mark.parametrize("raw", [
    b"",
    b"hello world",
    b"\x93NUMPY",
    b"\x93NUMPY\x04\x00" + b"\0" * 20,  # unknown version
    _npy(np.arange(4, dtype=np.int32))[:-1],  # truncated data
    _npy(np.arange(4, dtype=np.int32))[:20],  # truncated header
], ids=["empty", "not npy", "magic only", "version 4.0", "data cut", "header cut"])
def test_refuses_what_is_not_an_npy_array(raw: bytes) -> None:
    with pytest.raises(ValueError) as e:
        load_npy(raw)
    # the 400 says what the reader found wrong (not one message for every case)
    with pytest.raises(BadRequest, match=f"p is not a valid .npy array: {re.escape(str(e.value)[:200])}$"):
        decode_npy(base64.b64encode(raw).decode(), "p")


def _with_header(header: str, data: bytes = b"") -> bytes:
    """Version 1.0 (latin-1), or 3.0 (UTF-8) when the header needs it."""
    try:
        h = header.encode("latin1") + b"\n"
        return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data
    except UnicodeEncodeError:
        h = header.encode("utf-8") + b"\n"
        return b"\x93NUMPY\x03\x00" + len(h).to_bytes(4, "little") + h + data


@pytest.mark.parametrize("header", [
    "{'descr': '<i4', 'fortran_order': False}",  # a key missing
    "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'x': 1}",  # a key too many
    "{'descr': '<i4', 'fortran_order': 0, 'shape': (2,)}",
    "{'descr': '<i4', 'fortran_order': False, 'shape': (-2,)}",
    "{'descr': '<i4', 'fortran_order': False, 'shape': 2}",
    "{'descr': '<i4', 'fortran_order': False, 'shape': ('2',)}",
    "{'descr': 'nonsense', 'fortran_order': False, 'shape': (2,)}",
    "{'descr': '<i4', 'fortran_order': False, 'shape': (2,)} extra",
    "{'descr': '<i4', 'fortran_order': __import__('os').system('true'), 'shape': (2,)}",
    "[" * 50 + "]" * 50,
    "{'descr': '<i4', 'fortran_order': False, 'shape': (" + "9" * 30 + ",)}",  # no 10^30-element allocation
    "{'descr': '<i4' " + " " * 10_001 + ", 'fortran_order': False, 'shape': (2,)}",  # over the header limit
    "{'descr': '<U0', 'fortran_order': False, 'shape': (4000000000,)}",  # zero-size items: no 16 GB array
    "{'descr': '<i4', 'fortran_order': False, 'shape': (\u0663,)}",  # a non-ASCII digit, as np.load refuses
    "{'descr': '<i4',\u00a0'fortran_order': False, 'shape': (2,)}",  # a non-ASCII space
])
def test_refuses_bad_headers(header: str) -> None:
    with pytest.raises(ValueError):
        load_npy(_with_header(header, b"\0" * 8))


def test_object_arrays_are_refused_and_never_unpickled() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object"):
        load_npy(buf.getvalue())


# --- the race that np.load loses -------------------------------------------------------------

def _nested(depth: int, fn):
    return _nested(depth - 1, fn) if depth else fn()


def _while_another_thread_parses(fn):
    """``fn()`` on this thread, where the first garbage collection that starts while this
    thread builds a Python AST (inside ``ast.parse``: ``np.load`` reads headers with
    ``ast.literal_eval``) waits for another thread to parse source at another stack depth.
    A collection runs Python code (finalisers, weakref callbacks), so the GIL can pass to
    another thread there; this makes that interleaving happen every time. Returns
    (fn's result, whether this thread was caught inside ast.parse)."""
    me = threading.get_ident()
    go, done = threading.Event(), threading.Event()
    caught: list[bool] = []

    def parse_elsewhere() -> None:
        go.wait()
        _nested(40, lambda: ast.parse("x = (1, [2, {3: 4}])"))
        done.set()

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and not caught and threading.get_ident() == me \
                and sys._getframe(1).f_code is ast.parse.__code__:
            caught.append(True)
            go.set()
            done.wait(10)

    other = threading.Thread(target=parse_elsewhere, daemon=True)
    other.start()
    thresholds = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)  # a collection at every allocation, so one starts inside the AST build
    try:
        return fn(), bool(caught)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(on_gc)
        go.set()
        other.join(10)


_AFFECTED = (3, 11) <= sys.version_info[:3] < (3, 11, 8) or (3, 12) <= sys.version_info[:3] < (3, 12, 2)


@pytest.mark.skipif(not _AFFECTED, reason="CPython without python/cpython#106905")
def test_np_load_fails_while_another_thread_parses() -> None:
    """Why ``load_npy`` exists: on these CPythons the interleaving above breaks ``np.load``
    (seen as a rare 400 'not a valid .npy array' to valid requests under load)."""
    raw = _npy(np.arange(8, dtype=np.int32).reshape(2, 4))
    with pytest.raises(SystemError, match="AST constructor recursion depth mismatch"):
        _while_another_thread_parses(lambda: np.load(io.BytesIO(raw), allow_pickle=False))


def test_candidates_decode_while_another_thread_parses() -> None:
    cands = np.arange(8, dtype=np.int32).reshape(2, 4)
    b64 = base64.b64encode(_npy(cands)).decode()
    try:
        arr, in_ast = _while_another_thread_parses(lambda: decode_npy(b64, PARAM))
    except BadRequest as e:
        pytest.fail(f"valid candidates refused: {e.message}")
    np.testing.assert_array_equal(arr, cands)
    assert arr.dtype == np.int64
    assert not in_ast  # decoding builds no Python AST, so no other thread can break it


def test_scores_decode_while_another_thread_parses() -> None:
    scores = np.linspace(-5, 0, 8, dtype=np.float32).reshape(2, 4)
    body = {"prompt_token_id_logprobs": base64.b64encode(_npy(scores)).decode(), "request_id": "r"}
    out, in_ast = _while_another_thread_parses(lambda: parse_output(body))
    np.testing.assert_array_equal(out.scores, scores)
    assert not in_ast


# --- the base64 codec (teacher_server.b64) ---------------------------------------------------
BASE64_INVALID = [b"A", b"AA", b"AA=", b"AA==AA==", b"A===", b"====", b"AB\nCD", b"AB CD", b"AB=D", b"ab$d",
                  "AA\u00e9=", b"\xff\xfe", b"QQ", b"QQ="]


@pytest.mark.parametrize("fast", [True, False], ids=["pybase64", "stdlib"])
def test_codecs_agree_and_refuse_invalid_base64(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either codec: the standard library's bytes for valid text (both ways), and a
    ValueError for text outside the alphabet or badly padded, which
    ``decode_npy`` answers with a 400."""
    from teacher_server import b64

    if fast:
        assert b64.fast(), "pybase64 is a declared dependency: its codec must be in use"
    else:
        monkeypatch.setattr(b64, "_fast", None)
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, 4, 5, 1000, 1 << 20):
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        text = b64.encode(memoryview(raw))
        assert text == base64.b64encode(raw).decode("ascii")
        assert b64.decode(text) == raw == b64.decode(text.encode())
    for bad in BASE64_INVALID:
        with pytest.raises(ValueError):
            b64.decode(bad)
        with pytest.raises(BadRequest, match="not valid base64"):
            decode_npy(bad if isinstance(bad, str) else bad.decode("latin1"), "p")
    assert b64.decode("QU JD\n", validate=False) == b"ABC"  # (the client's lenient read of a response)


def test_token_ids_are_counted_on_the_bytes_before_parsing() -> None:
    """A body over max_model_len is refused from a count on its bytes (the top-level array,
    verified); a nested ``token_ids`` key that comes first is not taken for it; a count
    within the limit refuses nothing and the body is parsed as usual."""
    import orjson

    from teacher_server.server.parsing import PRECHECK_BYTES, count_token_ids, parse_request
    from teacher_server.validation import Limits

    limits = Limits(vocab_size=1000, max_model_len=50_000, max_logprobs=20, max_rows_x_k=10**8)
    body = lambda ids, **kw: orjson.dumps({"token_ids": ids, **kw, "sampling_params": {  # noqa: E731
        "max_tokens": 1, "prompt_logprob_start": 0, "prompt_logprob_token_ids": [1]}})
    big = body(list(range(100)) * 600)  # 60,000 ids
    assert len(big) > PRECHECK_BYTES and count_token_ids(big) == 60_000
    assert count_token_ids(big, above=60_000) is None and count_token_ids(big, above=59_999) == 60_000
    with pytest.raises(BadRequest, match="60000 tokens, more than max_model_len=50000"):
        parse_request(big, limits, "m")
    # a nested key first: its array is not the top-level member, so no count (no early refusal)
    nested = orjson.dumps({"cache_salt": None, "x": {"token_ids": list(range(60_000))}, "token_ids": [1, 2, 3]})
    assert count_token_ids(nested) is None
    ok = body([7] * 40_000)
    assert len(ok) > PRECHECK_BYTES and count_token_ids(ok, above=limits.max_model_len) is None
    _, req = parse_request(ok, limits, "m")
    assert req.length == 40_000


def test_a_body_with_more_values_than_a_valid_one_is_refused_unparsed(monkeypatch) -> None:
    """Whatever its keys say (escaped, repeated, a nested one first, or values in an ignored
    field), a large body holding more values than a valid request can is refused from a count
    of its bytes; the largest valid body (token_ids and per-row JSON candidates at the limits)
    is not."""
    import orjson

    from teacher_server.server import parsing
    from teacher_server.validation import Limits

    limits = Limits(vocab_size=1000, max_model_len=2000, max_logprobs=20, max_rows_x_k=10**8)
    most = parsing.max_commas(limits)
    ids = b",".join([b"1"] * (most + 10))
    bodies = [b'{"token\\u005fids":[' + ids + b']}',  # an escaped key
              b'{"token_ids":[1],"token_ids":[' + ids + b']}',  # a repeated key: the last one wins
              b'{"features":{"token_ids":[1]},"token_ids":[' + ids + b']}',  # a nested key first
              b'{"token_ids":[1,2],"features":[' + ids + b']}']  # an ignored field

    def no_parse(raw):
        raise AssertionError("parsed")

    with monkeypatch.context() as m:
        m.setattr(parsing.orjson, "loads", no_parse)
        for raw in bodies:
            with pytest.raises(BadRequest, match="comma-separated JSON values, more than this server parses"):
                parsing.parse_request(raw, limits, "m")
    limits = Limits(vocab_size=100_000, max_model_len=20_000, max_logprobs=20, max_rows_x_k=10**8)
    most = parsing.max_commas(limits)
    rows = limits.max_model_len - 1
    # the largest request, with the vLLM fields the server accepts and ignores at full size too
    biggest = orjson.dumps({"token_ids": [5] * limits.max_model_len, "assistant_tokens_mask": [1] * rows,
                            "token_offsets": [[0, 1]] * rows, "sampling_params": {
                                "max_tokens": 1, "prompt_logprob_start": 0, "prompt_logprob_token_ids": [[7] * 20] * rows,
                                "allowed_token_ids": list(range(limits.vocab_size))}})
    assert biggest.count(b",") <= most
    _, req = parsing.parse_request(biggest, limits, "m")
    assert req.candidates.shape == (rows, 20)


def test_a_trainers_endpoint_prompt_longer_than_max_model_len_is_refused_from_its_bytes(monkeypatch) -> None:
    """``/v1/completions``' ``prompt`` and SGLang's ``input_ids`` as the native ``token_ids``: a
    flat prompt longer than max_model_len is refused before the body is parsed (it had been
    parsed whole first: 3 s and 12 times the body in memory for 5M ids), with several teachers
    too, against the longest any of them takes. A batch of prompts, or a completion that names
    ``truncate_prompt_tokens`` (vLLM cuts the prompt then), is parsed as before."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import orjson
    from starlette.datastructures import State

    from teacher_server.server import completion_request, sglang_generate, teacher_set
    from teacher_server.validation import Limits

    limits = Limits(vocab_size=1000, max_model_len=2000, max_logprobs=20, max_rows_x_k=10**8)
    prompt = list(range(100)) * 300  # 30,000 ids

    def no_parse(*_):
        raise AssertionError("parsed")

    for m in (completion_request, sglang_generate, teacher_set):
        monkeypatch.setattr(m, "json_object" if m is not teacher_set else "body_object", no_parse)
    completion = lambda **kw: orjson.dumps({"prompt": prompt, "max_tokens": 1, **kw})  # noqa: E731
    with pytest.raises(BadRequest, match="prompt has 30000 tokens, more than max_model_len=2000") as e:
        completion_request.parse_completion(completion(), limits, "m", None)
    assert e.value.param == "prompt"
    with pytest.raises(BadRequest, match="input_ids has 30000 tokens, more than max_model_len=2000"):
        sglang_generate.parse_sglang(orjson.dumps({"input_ids": prompt}), limits, "m", None)
    texts = orjson.dumps({"prompt": ["a, b, c" * 1000] * 20})  # text prompts: their commas are no ids
    for parsed in (completion(truncate_prompt_tokens=100), orjson.dumps({"prompt": [prompt, prompt]}), texts):
        with pytest.raises(AssertionError, match="parsed"):
            completion_request.parse_completion(parsed, limits, "m", None)
    teachers = teacher_set.Teachers.__new__(teacher_set.Teachers)
    teachers.all = [State(), State()]
    teachers.all[0].limits, teachers.all[1].limits = limits, Limits(1000, 20_000, 20, 10**8)
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(BadRequest, match="prompt has 30000 tokens, more than max_model_len=20000"):
            asyncio.run(teachers.pick(completion(), pool, "completions"))
        with pytest.raises(AssertionError, match="parsed"):  # within the longer teacher's length: parsed
            asyncio.run(teachers.pick(orjson.dumps({"token_ids": prompt[:15_000]}), pool, "generate"))
