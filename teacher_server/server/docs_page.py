"""``GET /docs``: the API reference rendered from ``/openapi.json`` by a page of our own, with
no script or style from elsewhere, so it works on a machine without internet access (FastAPI's
default page loads Swagger UI from a CDN and is blank offline). It lists every endpoint with its
description, request body and responses, each schema as a table of fields."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>teacher-server API</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
h2{border-top:1px solid #ccc;padding-top:1rem;font-family:monospace}
.m{display:inline-block;min-width:3.5rem;color:#fff;border-radius:3px;padding:0 .4rem;margin-right:.5rem}
.get{background:#2a7}.post{background:#27c}.other{background:#888}
table{border-collapse:collapse;margin:.4rem 0 1rem}td,th{border:1px solid #ddd;padding:.2rem .5rem;
vertical-align:top;text-align:left}code,td:first-child{font-family:monospace}.s{margin-left:1.2rem}
</style></head><body><h1 id="title">teacher-server API</h1><p id="desc"></p><div id="api">loading
<a href="__OPENAPI__">openapi.json</a>...</div>
<script>
"use strict";
const el = (tag, text, cls) => { const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e; };
let spec;
function deref(s) { let seen = 0;
  while (s && s.$ref && seen++ < 20) s = spec.components.schemas[s.$ref.split("/").pop()]; return s || {}; }
function typeOf(s) {
  if (s.$ref) return s.$ref.split("/").pop();
  if (s.anyOf) return s.anyOf.map(typeOf).join(" | ");
  if (s.type === "array") return "list[" + typeOf(s.items || {}) + "]";
  if (s.enum) return s.enum.map(v => JSON.stringify(v)).join(" | ");
  return s.type || "any"; }
function schemaTable(s, into, depth, shown) {
  s = deref(s); const props = s.properties || {};
  if (!Object.keys(props).length) { into.append(el("div", typeOf(s), "s")); return; }
  const t = el("table"); const h = t.insertRow();
  ["field", "type", "default", "description"].forEach(x => h.append(el("th", x)));
  const nested = [];
  for (const [name, p] of Object.entries(props)) {
    const r = t.insertRow(); const req = (s.required || []).includes(name);
    r.insertCell().textContent = name + (req ? " *" : "");
    r.insertCell().textContent = typeOf(p);
    r.insertCell().textContent = p.default === undefined ? "" : JSON.stringify(p.default);
    r.insertCell().textContent = p.description || deref(p).description || "";
    for (const sub of [p, ...(p.anyOf || []), p.items || {}])
      if (sub.$ref && !shown.has(sub.$ref)) { shown.add(sub.$ref); nested.push(sub); } }
  into.append(t);
  if (depth < 3) for (const sub of nested) { const d = el("div", undefined, "s");
    d.append(el("b", sub.$ref.split("/").pop())); schemaTable(sub, d, depth + 1, shown); into.append(d); } }
function body(content, into) {
  const js = content && content["application/json"];
  if (js && js.schema) schemaTable(js.schema, into, 0, new Set());
  else if (content) into.append(el("div", Object.keys(content).join(", "), "s")); }
fetch("__OPENAPI__").then(r => r.json()).then(s => {
  spec = s; spec.components = spec.components || {schemas: {}};
  document.getElementById("title").textContent = s.info.title + " " + s.info.version;
  document.getElementById("desc").textContent = s.info.description || "";
  const api = document.getElementById("api"); api.textContent = "";
  for (const [path, ops] of Object.entries(s.paths)) for (const [method, op] of Object.entries(ops)) {
    const h = el("h2"); h.append(el("span", method.toUpperCase(),
      "m " + (["get", "post"].includes(method) ? method : "other")), path); api.append(h);
    if (op.description || op.summary) api.append(el("p", op.description || op.summary));
    if (op.requestBody) { api.append(el("h3", "Request body")); body(op.requestBody.content, api); }
    for (const [code, resp] of Object.entries(op.responses || {})) {
      api.append(el("h3", code + " " + (resp.description || ""))); body(resp.content, api); } } })
  .catch(e => { document.getElementById("api").textContent = "could not load openapi.json: " + e; });
</script></body></html>
"""


def add_docs_page(app: FastAPI) -> None:
    """Serve ``PAGE`` at ``/docs`` (build the app with ``docs_url=None, redoc_url=None``)."""

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        # behind a proxy's path prefix (root_path) the schema is under that prefix too
        root = request.scope.get("root_path", "").rstrip("/")
        return HTMLResponse(PAGE.replace("__OPENAPI__", root + app.openapi_url))
