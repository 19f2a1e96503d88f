"""``/openapi.json`` that says what each route really answers, so that a
client generated from it (and schemathesis' conformance checks) is right.

FastAPI documents a 422 for every request it validates and one media type
per route; this server answers a 400 (in the error shape of the path's API)
for a body that does not parse or validate, streams some routes, and refuses
requests before any route runs (:mod:`~mlx_redrafter.serve.security`). One
post-processing of ``app.openapi()`` (:func:`document`) adds, to every
operation, new routes included:

* 500: the server's own failure (any route);
* 400 instead of 422, for an operation that takes a body or parameters;
* 413, for an operation that takes a body (:mod:`~mlx_redrafter.serve.limits`);
* 404, for a body that names a ``model`` (another model is not served here);
* 503, and the streamed media type beside JSON, for a body with ``stream``
  (it queues a generation; the queue may be full);
* 403 (a foreign Host or Origin) when the app is guarded, and 401 where the
  API key is needed.

Each error's schema is read from the error the path's API really answers
(``refuse``), so an API added later is documented in its own shape.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Optional

from .security import SecurityConfig, needs_key
from .streaming import CRASH, INVALID, Failure

# Path prefix -> the media type its streamed replies have (the first match wins; else server-sent events).
STREAM_TYPES = [("/api/", "application/x-ndjson")]
SSE = "text/event-stream"

Refuse = Callable[[str, Failure], object]


def document(app, refuse: Refuse, security: Optional[SecurityConfig] = None) -> None:
    """Make ``app.openapi()`` document what every route answers (see the
    module); ``refuse(path, failure)`` is how the app answers an error at
    ``path``, ``security`` how it is guarded (None: not)."""
    build = app.openapi  # FastAPI's: builds the schema once and keeps it in app.openapi_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path, item in schema.get("paths", {}).items():
                for op in item.values():
                    _document_operation(schema, path, op, refuse, security)
        return app.openapi_schema

    app.openapi = openapi


def _document_operation(schema: dict, path: str, op: dict, refuse: Refuse, security) -> None:
    responses = op.setdefault("responses", {})
    body = _body_properties(schema, op)
    errors: Dict[str, str] = {"500": "The server's own failure."}
    if responses.pop("422", None) is not None or "requestBody" in op:
        errors["400"] = "The request does not parse, is not valid, or asks for what this server cannot do."
    if "requestBody" in op:
        errors["413"] = "The body is larger than this server reads (--max-body-bytes)."
    if "model" in body:
        errors["404"] = "The request names a model this server does not serve."
    if "stream" in body:
        errors["503"] = "The server is busy: its queue of requests is full. Retry later."
        _add_stream_type(responses, path)
    if security is not None:
        errors["403"] = "The request's Host or Origin is not allowed (--allow-host, --allow-origin)."
        if security.api_key is not None and needs_key(path):
            errors["401"] = "The API key is missing or wrong."
    error_schema = _error_schema(refuse, path)
    for status, description in errors.items():
        responses.setdefault(
            status, {"description": description, "content": {"application/json": {"schema": error_schema}}}
        )


def _body_properties(schema: dict, op: dict) -> dict:
    """The JSON body's top-level properties (``$ref`` followed)."""
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = body.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        body = schema.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[1], {})
    return body.get("properties", {})


def _add_stream_type(responses: dict, path: str) -> None:
    media = next((m for prefix, m in STREAM_TYPES if path.startswith(prefix)), SSE)
    ok = responses.setdefault("200", {"description": "Successful Response"})
    ok.setdefault("content", {}).setdefault(media, {"schema": {"type": "string"}})
    ok["description"] = f"{ok.get('description', '')} (streamed as {media} when the body asks for it)".strip()


def _error_schema(refuse: Refuse, path: str) -> dict:
    """The JSON Schema of the errors ``refuse`` answers at ``path``: read
    from two real ones (a client's, naming a field, and the server's own)."""
    samples = [refuse(path, Failure(400, "m", INVALID, "p")), refuse(path, Failure(500, "m", CRASH))]
    return _merged([_shape(json.loads(r.body)) for r in samples])


def _shape(value) -> dict:
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _shape(v) for k, v in value.items()}, "required": sorted(value)}
    if value is None:
        return {"type": "null"}
    return {"type": {str: "string", bool: "boolean", int: "integer", float: "number", list: "array"}[type(value)]}


def _merged(shapes: list) -> dict:
    """One schema every one of ``shapes`` validates against (a field one of
    them has is optional; a field of two types takes either)."""
    if all(s.get("type") == "object" for s in shapes):
        keys = sorted({k for s in shapes for k in s["properties"]})
        props = {k: _merged([s["properties"][k] for s in shapes if k in s["properties"]]) for k in keys}
        required = [k for k in keys if all(k in s["required"] for s in shapes)]
        return {"type": "object", "properties": props, "required": required}
    types = sorted({s["type"] for s in shapes if "type" in s})
    return {"type": types[0] if len(types) == 1 else types}
