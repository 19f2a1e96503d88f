"""A request's body is read as JSON whatever its ``Content-Type`` says, as
Ollama's server and OpenAI's clients' habits expect.

``curl -d '{...}'`` (the form of Ollama's own documentation and of many
scripts) sends ``Content-Type: application/x-www-form-urlencoded``; other
clients send ``text/plain`` or no type at all. FastAPI parses a body as JSON
only when the type says JSON, and answered every such request 400 ("Input
should be a valid dictionary"). Every route of ``serve`` that takes a body
takes JSON, so :class:`JsonBody` tells FastAPI the body is JSON: a body that
is not JSON is then a 400 that says so ("The body is not valid JSON: ...").

It opens no door to web pages. A browser sends a cross-origin form or
``text/plain`` post without a CORS preflight (a "simple request"), but it
always sends its ``Origin`` with it, and the Origin check
(:class:`~mlx_redrafter.serve.security.OriginGuard`) refuses any origin but
the server's own and the allowed ones before the body is read
(tests/test_server_security.py holds it to that).
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

JSON = b"application/json"
# The methods whose bodies the routes read (a GET's body, if any, is never parsed).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class JsonBody:
    """ASGI middleware: a POST, PUT or PATCH whose ``Content-Type`` is not
    JSON (form-encoded, ``text/plain``, none) reaches the app as
    ``application/json``. ``app.add_middleware(JsonBody)``, innermost: the
    security guards and the body bound see the request as it came."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in BODY_METHODS:
            # In place, not a copy: the route FastAPI marks in the scope is what /metrics counts by.
            scope["headers"] = as_json(scope["headers"])
        await self.app(scope, receive, send)


def as_json(headers: Iterable[Tuple[bytes, bytes]]) -> List[Tuple[bytes, bytes]]:
    """``headers`` (ASGI's raw pairs) with a JSON ``Content-Type`` kept as
    it is (``application/json``, ``...+json``, a charset) and any other
    replaced by ``application/json``."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    given = [v for k, v in headers if k.lower() == b"content-type"]
    media = given[0].split(b";")[0].strip().lower() if given else b""
    is_json = media == JSON or (media.startswith(b"application/") and media.endswith(b"+json"))
    return kept + [(b"content-type", given[0] if is_json else JSON)]
