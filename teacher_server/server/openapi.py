"""The OpenAPI page's request schema: the generate body is read by hand (not through a
FastAPI parameter), so its pydantic model is put into the page here."""

from __future__ import annotations

from fastapi import FastAPI

from teacher_server.server.protocol import GenerateRequest


def register_schemas(app: FastAPI) -> None:
    """Put the request model's nested schemas into components (the body is read by hand)."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        full = GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in full.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault("GenerateRequest", full)
        body = schema["paths"]["/inference/v1/generate"]["post"]["requestBody"]
        body["content"]["application/json"]["schema"] = {"$ref": "#/components/schemas/GenerateRequest"}
        return schema

    app.openapi = openapi
