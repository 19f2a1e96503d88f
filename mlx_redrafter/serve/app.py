"""The app of ``mlx-redrafter serve``: every API's routes over one
:class:`~mlx_redrafter.serve.Engine` (its queue and prompt cache shared).

Routes: OpenAI's (:mod:`~mlx_redrafter.serve.openai_api`), Ollama's
(:mod:`~mlx_redrafter.serve.ollama_api`), ``GET /health``, ``GET /metrics``
(Prometheus) and the chat page at ``/`` (``ui=False`` turns it off).

An error is answered in the shape of the API its path belongs to
(:func:`error_response`): Ollama's under ``/api/``, OpenAI's elsewhere. An
unknown route is a 404 listing the routes there are.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable, List, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from . import ollama_api, openai_api
from .engine import Engine
from .metrics import Metrics, RequestCounter
from .streaming import CRASH, NOT_FOUND, Failure

# The chat page's static files (package data: no build step, no CDN).
UI_DIR = Path(__file__).resolve().parent / "ui"

# Path prefix -> the error shape of the API there (the first match wins; OpenAI's is the default).
SHAPES: List[Tuple[str, Callable[[Failure], Response]]] = [
    ("/api/", ollama_api.error_response),
]


def error_response(path: str, failure: Failure) -> Response:
    """``failure`` answered in the error shape of the API that ``path`` belongs to."""
    shape = next((s for prefix, s in SHAPES if path.startswith(prefix)), openai_api.error_response)
    return shape(failure)


def create_app(engine: Engine, ui: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine`` (its worker runs with the app),
    with the chat page at ``/`` unless ``ui`` is False."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="mlx-redrafter", lifespan=lifespan)
    metrics = Metrics(engine)
    app.add_middleware(RequestCounter, metrics=metrics)
    _error_handlers(app)

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    app.include_router(openai_api.openai_router(engine))
    app.include_router(ollama_api.ollama_router(engine))  # Ollama's native API, on the same engine and queue
    if ui:
        mount_ui(app)
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
