"""What a new user meets first: a refused request's access line says why and its response
carries an id to quote (one of ours when the request gave none), ``/docs`` renders without a
CDN, a base URL copied with the endpoint path still works, and the in-process API in a
client-only install names the extra it needs."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import httpx
import pytest
from apiutil import assert_error, body, raw_http

from teacher_server.client import TeacherClient, normalise_base_url

GEN = "/inference/v1/generate"


def test_a_400_logs_its_reason_and_carries_a_request_id(demo_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="teacher_server.access")
    with demo_server.client() as c:
        r = c.post(GEN, json=body([1, 2], [99999]))  # no id in the body or the headers
        assert_error(r, 400)
        named = c.post(GEN, json=body([1, 2], [99999]), headers={"X-Request-Id": "mine-1"})
    rid = r.headers.get("x-request-id")
    assert rid and re.fullmatch(r"score-[0-9a-f]{32}", rid), rid
    assert named.headers["x-request-id"] == "mine-1"
    lines = {rec.request_id: rec for rec in caplog.records if rec.name == "teacher_server.access"}
    line = lines[rid]
    assert line.status == 400 and "reason=" in line.getMessage()
    assert line.reason == r.json()["error"]["message"] and line.reason in line.getMessage()
    assert lines["mine-1"].reason == named.json()["error"]["message"]


@pytest.mark.parametrize(("path", "name", "payload", "id_field", "logged"), [
    ("/v1/completions", "completions", {"prompt": [1, 99999], "max_tokens": 0}, "request_id", "cmpl-{}"),
    ("/generate", "sglang-generate", {"input_ids": [1, 99999]}, "rid", "{}"),
    ("/generate", "sglang-generate", {"input_ids": [[1, 2], [1, 99999]]}, "rid", "{}_0")])  # (a batch's first)
def test_a_trainers_endpoint_logs_a_refusals_reason_and_id(demo_server, caplog, path: str, name: str,
                                                          payload: dict, id_field: str, logged: str) -> None:
    """As the native endpoint: the refused call's access line ends with its reason and names it
    by the body's id; the response carries an X-Request-Id (the client's header as sent, else
    one to quote)."""
    caplog.set_level(logging.INFO, logger="teacher_server.access")
    with demo_server.client() as c:
        anon = c.post(path, json=payload)
        mine = c.post(path, json={**payload, id_field: "body-7"})
        header = c.post(path, json=payload, headers={"X-Request-Id": "hdr-3"})
    for r in (anon, mine, header):
        assert_error(r, 400)
    assert re.fullmatch(r"score-[0-9a-f]{32}", anon.headers["x-request-id"]), anon.headers
    assert header.headers["x-request-id"] == "hdr-3"
    lines = [rec for rec in caplog.records if rec.name == "teacher_server.access" and rec.getMessage().startswith(name)]
    by_id = {rec.request_id: rec for rec in lines}
    for rid, r in ((anon.headers["x-request-id"], anon), (logged.format("body-7"), mine)):
        line = by_id[rid]
        assert line.status == 400 and line.reason == r.json()["error"]["message"] and "reason=" in line.getMessage()


def test_a_path_with_no_route_is_a_404_naming_the_nearest(demo_server) -> None:
    """A trailing slash or a misspelt path: a 404 in the error shape naming the route meant,
    never a bare redirect (which an HTTP client posting JSON does not follow)."""
    with demo_server.client() as c:
        slash = c.post(GEN + "/", json=body([1, 2], [3]))
        typo = c.post("/v1/completion", json={"prompt": [1, 2]})
    assert_error(slash, 404, contains=f"did you mean '{GEN}'")
    assert_error(typo, 404, contains="did you mean '/v1/completions'")


def test_a_request_http_cannot_frame_gets_an_id_and_a_logged_reason(demo_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="teacher_server.access")
    reply = raw_http(demo_server.port, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                     b"Content-Length: 6\r\n\r\nhello!", timeout=30)
    head = reply.split(b"\r\n\r\n")[0].decode().lower()
    assert head.startswith("http/1.1 400") and "x-request-id: score-" in head, head
    assert any(rec.name == "teacher_server.access" and "invalid HTTP request" in getattr(rec, "reason", "")
               for rec in caplog.records)


def test_docs_page_loads_nothing_from_elsewhere(demo_server) -> None:
    with demo_server.client() as c:
        page = c.get("/docs")
        spec = c.get("/openapi.json")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # every src/href is relative (no CDN), and the page renders the spec it fetches
    assert not re.findall(r"(?:src|href)=\"?(?:https?:)?//", page.text), "a remote asset"
    assert "http://" not in page.text and "https://" not in page.text
    assert 'fetch("/openapi.json")' in page.text and spec.status_code == 200
    assert "/docs" not in spec.json()["paths"] and "/redoc" not in spec.json()["paths"]


@pytest.mark.parametrize("url,want", [
    ("http://h:8000", "http://h:8000"), ("http://h:8000/", "http://h:8000"),
    ("http://h:8000/inference/v1/generate", "http://h:8000"), ("http://h:8000/inference/v1/generate/", "http://h:8000"),
    ("http://h:8000/inference/v1", "http://h:8000"), ("https://h/prefix/inference/v1/generate", "https://h/prefix"),
])
def test_base_urls_lose_the_endpoint_path(url: str, want: str) -> None:
    assert normalise_base_url(url) == want


def test_a_base_url_without_a_scheme_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="http://127.0.0.1:8000"):
        TeacherClient("127.0.0.1:8000")


def test_a_base_url_with_the_endpoint_path_scores(demo_server) -> None:
    with TeacherClient(demo_server.url + GEN) as client:
        assert client.score([1, 2, 3, 4], [[5], [6]], start=1).shape == (2, 1)


def test_in_process_api_in_a_client_only_install_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys

        class Block:  # yaml (a server dependency) absent, as in `pip install teacher-server[client]`
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "yaml":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Block())
        from teacher_server import LLM
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and 'pip install "teacher-server[server]"' in last, r.stderr[-1500:]
    assert "teacher_server.client" in last


def test_py_typed_ships_with_the_package() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert (root / "teacher_server" / "py.typed").is_file()
    assert '"py.typed"' in (root / "pyproject.toml").read_text()


def test_models_and_version_answer(demo_server) -> None:
    from teacher_server import __version__

    card = httpx.get(demo_server.url + "/v1/models", timeout=30).json()["data"][0]
    assert isinstance(card["vocab_size"], int) and card["vocab_size"] > 0 and card["tokenizer"] is None
    assert httpx.get(demo_server.url + "/version", timeout=30).json() == {"version": __version__}


def test_docs_page_script_renders_the_spec(tmp_path) -> None:
    """The page's script, run by node against a stub of the DOM and this app's openapi.json, lists
    every endpoint with a table of its request body's fields (skipped where node is absent)."""
    import json
    import shutil

    from teacher_server.config import Config
    from teacher_server.server.app import create_app
    from teacher_server.server.docs_page import PAGE

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    spec = create_app(Config(device="cpu")).openapi()
    (tmp_path / "openapi.json").write_text(json.dumps(spec))
    (tmp_path / "page.js").write_text(re.search(r"<script>(.*)</script>", PAGE, flags=re.S).group(1))
    (tmp_path / "run.js").write_text("""
const fs = require("fs");
function node(tag) { return {tag, children: [], textContent: "", className: "", rows: [],
  append(...xs) { this.children.push(...xs); }, insertRow() { const r = node("tr"); this.rows.push(r); return r; },
  insertCell() { const c = node("td"); this.children.push(c); return c; } }; }
const els = {title: node("h1"), desc: node("p"), api: node("div")};
global.document = {createElement: node, getElementById: id => els[id]};
const spec = JSON.parse(fs.readFileSync(process.argv[2] + "/openapi.json"));
global.fetch = () => Promise.resolve({json: () => Promise.resolve(spec)});
eval(fs.readFileSync(process.argv[2] + "/page.js", "utf8"));
setTimeout(() => {
  const out = {title: els.title.textContent, endpoints: els.api.children.filter(c => c.tag === "h2")
    .map(h => h.children.map(c => c.textContent || c).join(" ")),
    fields: []};
  const walk = n => { if (n.tag === "table") out.fields.push(...n.rows.slice(1).map(r => r.children[0].textContent));
    (n.children || []).forEach(c => typeof c === "object" && walk(c)); };
  walk(els.api);
  console.log(JSON.stringify(out));
}, 200);
""")
    r = subprocess.run([node, str(tmp_path / "run.js"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["title"].startswith("teacher-server")
    assert any("POST" in e and "/inference/v1/generate" in e for e in out["endpoints"]), out["endpoints"]
    assert len(out["endpoints"]) == sum(len(ops) for ops in spec["paths"].values())
    assert {"token_ids *", "sampling_params", "prompt_logprob_token_ids"} <= set(out["fields"]), out["fields"]


def test_a_max_model_len_past_the_trained_positions_is_logged(checkpoints, caplog) -> None:
    """Served (a long-context experiment may mean it), with a warning naming both numbers:
    positions past the trained ones score by extrapolation."""
    import json

    from teacher_server.config import Config
    from teacher_server.engine.engine import Engine

    path = checkpoints["qwen3"]
    trained = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    caplog.set_level(logging.WARNING, logger="teacher_server.engine.engine")
    for max_len, warned in ((trained, False), (trained * 2, True)):
        caplog.clear()
        engine = Engine(Config(model=str(path), device="cpu", max_model_len=max_len, num_kv_blocks=max_len // 8 + 1,
                               block_size=8))
        engine.close()
        said = [r.getMessage() for r in caplog.records if "trained for" in r.getMessage()]
        assert bool(said) == warned and all(f"max_model_len={max_len}" in m and str(trained) in m for m in said)


@pytest.mark.parametrize("text", ["{'vocab_size': 8}", "[1, 2]"])
def test_a_malformed_config_json_is_named(tmp_path, text: str) -> None:
    from teacher_server.models.spec import ModelSpec

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} is not")):
        ModelSpec.from_dir(tmp_path)
