"""/openapi.json from the request models the handlers actually parse.

The handlers read their bodies themselves (validation runs in a fixed order: availability,
model, fields, size, tokens; see serving_common.parse_body), so FastAPI cannot infer the
body from a signature. Each route's schema is instead taken from the pydantic model its
handler passes to parse_body, with the models' shared definitions under
components/schemas: what the document says is what the server validates.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from .responses_protocol import ResponsesRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_REF = "#/components/schemas/{model}"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {}}}}}


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Replace app.openapi with one that adds each route's request body and error shape."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        for path, model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            body_schema = model.model_json_schema(ref_template=_REF)
            components.update(body_schema.pop("$defs", {}))
            components[model.__name__] = body_schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            error = {"description": "an OpenAI-style error", "content": {
                "application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
            operation.setdefault("responses", {}).update(
                {str(code): error for code in (400, 401, 404, 413, 429, 503)})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
