"""The app of ``mlx-redrafter serve``: every API's routes over one
:class:`~mlx_redrafter.serve.Engine` (its queue and prompt cache shared).

Routes: OpenAI's (:mod:`~mlx_redrafter.serve.openai_api`), Ollama's
(:mod:`~mlx_redrafter.serve.ollama_api`), Anthropic's Messages
(:mod:`~mlx_redrafter.serve.anthropic_api`), OpenAI's Responses
(:mod:`~mlx_redrafter.serve.responses_api`), ``GET /health``, ``GET /metrics``
(Prometheus) and the chat page at ``/`` (``ui=False`` turns it off).

An error is answered in the shape of the API its path belongs to
(:func:`error_response`): Ollama's under ``/api/``, Anthropic's under
``/v1/messages``, OpenAI's elsewhere (the Responses API's included). An
unknown route is a 404 listing the routes there are. A client's error is one
line in the log; the server's own failures keep their tracebacks.

Who may use the app (Host names, browser origins, the API key) is its
:class:`~mlx_redrafter.serve.security.SecurityConfig`; how much of a body it
reads, :mod:`~mlx_redrafter.serve.limits`; a body is read as JSON whatever
its ``Content-Type`` (:mod:`~mlx_redrafter.serve.json_body`); ``/openapi.json``
documents what each route really answers (:mod:`~mlx_redrafter.serve.openapi`).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from . import anthropic_api, ollama_api, openai_api, responses_api
from .engine import Engine
from .json_body import JsonBody
from .limits import BodyLimit, default_body_bytes
from .metrics import Metrics, RequestCounter
from .openapi import document
from .security import SecurityConfig, secure
from .streaming import CRASH, NOT_FOUND, Failure

log = logging.getLogger(__name__)

# The chat page's static files (package data: no build step, no CDN).
UI_DIR = Path(__file__).resolve().parent / "ui"

# Path prefix -> the error shape of the API there (the first match wins; OpenAI's is the default).
SHAPES: List[Tuple[str, Callable[[Failure], Response]]] = [
    ("/api/", ollama_api.error_response),
    ("/v1/messages", anthropic_api.error_response),
]


def error_response(path: str, failure: Failure) -> Response:
    """``failure`` answered in the error shape of the API that ``path``
    belongs to; a client's (a 4xx) is logged as one line."""
    if failure.status < 500:  # no traceback: the mistake is the client's, the message says it
        log.warning("%d %s: %s", failure.status, path, failure.message)
    return shaped_error(path, failure)


def shaped_error(path: str, failure: Failure) -> Response:
    """``failure`` in the error shape of ``path``'s API (not logged), with its headers."""
    shape = next((s for prefix, s in SHAPES if path.startswith(prefix)), openai_api.error_response)
    response = shape(failure)
    response.headers.update(failure.headers)
    return response


# What an app trusts when its maker does not say: this machine's loopback names, no other origin, no key.
LOCAL_ONLY = SecurityConfig()


def create_app(
    engine: Engine,
    ui: bool = True,
    security: Optional[SecurityConfig] = LOCAL_ONLY,
    max_body_bytes: Optional[int] = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (its worker runs with the app),
    with the chat page at ``/`` unless ``ui`` is False, guarded as
    ``security`` says (``serve`` resolves it from its flags; by default
    loopback names only, so that no web page can drive it by DNS
    rebinding; None: no Host, Origin or key checks, for an app that
    guards itself), reading at most ``max_body_bytes`` of a request's body
    (:mod:`~mlx_redrafter.serve.limits`; None: the default for the model's context)."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="mlx-redrafter", lifespan=lifespan)
    bound = max_body_bytes or default_body_bytes(engine.card()["context_length"])  # the context /v1/models says
    app.add_middleware(JsonBody)  # innermost: a body is JSON whatever its Content-Type (curl -d sends a form's)
    app.add_middleware(BodyLimit, max_bytes=bound, refuse=error_response)  # inside the guards below
    if security is not None:
        secure(app, security, error_response)
    metrics = Metrics(engine)
    app.add_middleware(RequestCounter, metrics=metrics)  # added last, so outermost: refusals are counted too
    _error_handlers(app)

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as the text it is
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    app.include_router(openai_api.openai_router(engine))
    app.include_router(ollama_api.ollama_router(engine))  # Ollama's native API, on the same engine and queue
    app.include_router(anthropic_api.anthropic_router(engine))  # Anthropic's Messages API
    app.include_router(responses_api.responses_router(engine))  # OpenAI's Responses API, stateless
    if ui:
        mount_ui(app)
    document(app, shaped_error, security)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error, in the shape of its path's API."""

    @app.exception_handler(Failure)
    async def _failure(request: Request, exc: Failure):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, openai_api.validation_failure(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if exc.status_code == 404 and request.scope.get("route") is None:  # no route, not a handler's 404
            failure = _unknown_route(app, request.url.path)
        elif isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body"
            failure = Failure(400, f"The body is not UTF-8 JSON: {exc.__cause__}.", "invalid_json")
        else:
            failure = Failure(exc.status_code, str(exc.detail), NOT_FOUND if exc.status_code == 404 else None)
        return error_response(request.url.path, failure)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        return error_response(request.url.path, Failure(500, f"{type(exc).__name__}: {exc}", CRASH))


def _unknown_route(app: FastAPI, path: str) -> Failure:
    """A 404 naming ``path`` and the routes this server has (those its
    OpenAPI schema documents: included routers' routes are not in ``app.routes``)."""
    routes = sorted(app.openapi().get("paths", {}))
    return Failure(404, f"{path} is not supported by mlx-redrafter serve; supported: {', '.join(routes)}.", NOT_FOUND)


def mount_ui(app: FastAPI, folder: Path = UI_DIR) -> None:
    """Serve the chat page at ``/`` and its files under ``/ui/``."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(folder / "index.html")

    app.mount("/ui", StaticFiles(directory=folder), name="ui")
