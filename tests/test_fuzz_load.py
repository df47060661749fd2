"""Schema fuzzing of the live server from its OpenAPI document, hostile inputs, and a
bounded load run: thousands of generated requests, zero 5xx, every result equal to the
same request run alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from apiutil import body, decode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GEN = "/inference/v1/generate"
FUZZ = settings(max_examples=700, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def request_schema(client: httpx.Client) -> dict:
    """The request body schema from /openapi.json, refs made local for the generator."""
    spec = client.get("/openapi.json").json()
    comps = spec["components"]["schemas"]
    ref = spec["paths"][GEN]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    text = json.dumps({"defs": comps, "root": comps[ref.rsplit("/", 1)[1]]})
    text = text.replace("#/components/schemas/", "#/$defs/")
    d = json.loads(text)
    return {**d["root"], "$defs": d["defs"]}


def from_schema(schema: dict, defs: dict | None = None) -> st.SearchStrategy:
    """Values that match a JSON schema (the subset pydantic emits): $ref, anyOf, objects
    with optional properties, arrays, and scalars incl. edge-case integers."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not props:
            return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
        return st.fixed_dictionaries({k: from_schema(v, defs) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    if t == "array":
        items = from_schema(schema.get("items", {}), defs)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=64)
    if t == "integer":
        return st.integers(min_value=-5, max_value=5000) | st.sampled_from([-1, 0, 4095, 4096, 2 ** 31, -(2 ** 63)])
    if t == "number":
        return st.floats(allow_nan=False, allow_infinity=False, width=32)
    if t == "string":
        return st.text(max_size=24)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return JSON


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=12), c, max_size=6),
                    max_leaves=30)


@pytest.fixture(scope="module")
def fuzz(demo_server):
    with demo_server.client() as c:
        seen: dict[int, int] = {}

        def post(payload: object) -> None:
            r = c.post(GEN, content=json.dumps(payload), headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:300], str(payload)[:300])
            assert r.status_code in (200, 400, 404), r.status_code
            if r.status_code != 200:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
            else:
                m = r.json()["prompt_token_id_logprobs"]
                if m is not None:
                    assert decode(m).dtype == np.float32

        yield c, post, seen


def test_fuzz_from_openapi_schema(fuzz) -> None:
    c, post, seen = fuzz
    schema = request_schema(c)

    @FUZZ
    @given(from_schema(schema))
    def run(payload: dict) -> None:
        post(payload)

    run()


def test_fuzz_arbitrary_json(fuzz) -> None:
    _, post, _ = fuzz

    @FUZZ
    @given(JSON)
    def run(payload: object) -> None:
        post(payload)

    run()


def test_fuzz_mutated_valid_requests(fuzz) -> None:
    """A valid request with one field (top-level or sampling) replaced by arbitrary JSON."""
    _, post, seen = fuzz
    base = body([5, 17, 99, 3, 250, 1000, 7], [[1, 2], [3, -1], [4, 5]], start=3, prompt_logprobs=2)
    keys = ["token_ids", "request_id", "model", "stream", "cache_salt", "priority", "return_token_ids"]
    sp_keys = ["prompt_logprob_token_ids", "prompt_logprob_start", "prompt_logprobs", "max_tokens", "temperature",
               "top_k", "seed", "stop"]

    before = dict(seen)  # the module's earlier fuzz tests counted there too

    @FUZZ
    @given(st.sampled_from(keys + [f"sp.{k}" for k in sp_keys]), JSON)
    def run(key: str, value: object) -> None:
        payload = json.loads(json.dumps(base))
        if key.startswith("sp."):
            payload["sampling_params"][key[3:]] = value
        else:
            payload[key] = value
        post(payload)

    run()
    own = {code: n - before.get(code, 0) for code, n in seen.items()}
    assert sum(own.values()) >= 500 and own.get(200, 0) > 0 and own.get(400, 0) > 0, own
    r = fuzz[0].get("/health")
    assert r.status_code == 200  # healthy after thousands of hostile requests


def test_hostile_inputs(demo_server) -> None:
    import base64
    import io

    def npy(a: np.ndarray) -> str:
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=True)
        return base64.b64encode(buf.getvalue()).decode()

    toks = [5, 17, 99, 3, 250]
    cases = [
        {"token_ids": {"a": 1}}, {"token_ids": [[1, 2]]}, {"token_ids": [1e30]}, {"token_ids": [-(2 ** 63) - 1]},
        {"token_ids": [2 ** 64]}, {"token_ids": ["1"]}, {"token_ids": [None]},
        body(toks, [[1, 2], [3]], start=2), body(toks, [[1, 2], 7], start=2),
        body(toks, "==="), body(toks, "a" * 1001),
        body(toks, npy(np.array([{"x": 1}], dtype=object))),  # pickled payload: must not be unpickled
        body(toks, npy(np.array([1.5, 2.5]))), body(toks, npy(np.array(["ab", "cd"]))),
        body(toks, npy(np.zeros((2, 2, 2), np.int32))), body(toks, npy(np.zeros((0,), np.int32))),
        body(toks, npy(np.array([[1, 2]] * 9, np.int32)), start=0),
        body(toks, npy(np.array([True, False]))), body(toks, [1, 2], start=1.5), body(toks, max_tokens=-1),
        {"token_ids": toks, "sampling_params": None}, {"token_ids": toks, "sampling_params": []},
    ]
    with demo_server.client() as c:
        for payload in cases:
            r = c.post(GEN, json=payload)
            assert 400 <= r.status_code < 500, (payload if len(str(payload)) < 300 else str(payload)[:300], r.text)
            assert r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_bounded_load_run(demo_server) -> None:
    """2000 requests at concurrency 64 (200 distinct bodies, each sent 10 times): no
    errors, every result equal to the same request run alone."""
    rng = np.random.default_rng(42)
    distinct = []
    for i in range(200):
        n = int(rng.integers(2, 80))
        start = int(rng.integers(0, n))
        rows = n - 1 - start
        k = int(rng.choice([1, 4, 16]))
        if i % 2 and rows:
            cand = np.stack([rng.choice(4096, k, replace=False) for _ in range(rows)]).tolist()
        else:
            cand = rng.choice(4096, k, replace=False).tolist()
        distinct.append(body(rng.integers(0, 4096, n), cand, start=start, max_tokens=int(i % 3 == 0)))
    with demo_server.client() as c:
        alone = [decode(c.post(GEN, json=b).json()["prompt_token_id_logprobs"]) for b in distinct]
    order = [i % 200 for i in range(2000)]
    rng.shuffle(order)

    async def run() -> list[httpx.Response]:
        sem = asyncio.Semaphore(64)
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as c:
            async def one(i: int) -> httpx.Response:
                async with sem:
                    return await c.post(GEN, json=distinct[i])
            return await asyncio.gather(*(one(i) for i in order))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses].count(200) == 2000
    for i, r in zip(order, responses):
        got = decode(r.json()["prompt_token_id_logprobs"])
        assert got.shape == alone[i].shape
        np.testing.assert_allclose(got, alone[i], atol=2e-5, rtol=0)
