"""The HTTP side of ``mlx-redrafter serve``: OpenAI's API over an
:class:`~mlx_redrafter.serve.Engine` (FastAPI, pydantic request models).

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (with tools),
``POST /v1/completions`` (both streamed as server-sent events when
``stream`` is true), ``GET /health`` and ``GET /metrics`` (Prometheus).
Errors are OpenAI's error objects; a field we do not support yet is a 400
naming it (:func:`check_supported`), an unknown route a 404 listing the
supported ones. Responses add one field standard clients ignore,
``redrafter`` (the drafting stats) on a reply and its last streamed chunk,
``x_redrafter`` (each token's source, see
:class:`~mlx_redrafter.serve.engine.Piece`) on each streamed chunk with text.
``GET /`` is the chat page (``ui=False`` turns it off); Ollama's routes
come from :mod:`~mlx_redrafter.serve.ollama_api`.
``response_format`` (``text``, ``json_object``, ``json_schema``) makes the
reply structured output; cut by ``max_tokens`` (``finish_reason
"length"``) it is incomplete JSON, and ``redrafter.structured.complete``
says so.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..errors import RedrafterError
from .engine import Engine, GenParams, Job, QueueFull
from .metrics import Metrics, RequestCounter
from .openai_reply import Reply
from .tools import Rendered

# The chat page's static files (package data: no build step, no CDN).
UI_DIR = Path(__file__).resolve().parent / "ui"

# How often a request waiting for the model checks that its client is still there.
DISCONNECT_POLL_S = 0.25

# --------------------------------------------------------------------------- request models


class _Request(BaseModel):
    # Strict: "5" is not a number. Unknown OpenAI fields are accepted and ignored.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class FunctionCall(_Request):
    name: str
    arguments: Union[str, Dict[str, Any], None] = None  # OpenAI sends a JSON string


class ToolCallIn(_Request):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class Message(_Request):
    role: str
    content: Union[str, List[ContentPart], None] = None
    tool_calls: Optional[List[ToolCallIn]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool result's call
    name: Optional[str] = None

    def plain(self) -> dict:
        """The message as the chat template wants it: a role and a string
        (and, for tool history, the calls or the call id)."""
        content = self.content
        if isinstance(content, list):  # OpenAI's content parts: keep the text ones
            content = "".join(p.text or "" for p in content if p.type == "text")
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name
        out = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class JSONSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted;
    the schema is always enforced."""

    name: str
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    def grammar(self):
        """The grammar spec this format asks for (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json"
        if self.json_schema is None:
            raise APIError(400, "response_format of type 'json_schema' needs a 'json_schema' object.",
                           param="response_format.json_schema", code="missing_required_parameter")
        return self.json_schema.schema_ if self.json_schema.schema_ is not None else "json"


class _Generation(_Request):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    # Not OpenAI's, but what vLLM and llama.cpp's servers accept too.
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2**64 - 1)  # what mx.random.seed takes
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1)
    response_format: Optional[ResponseFormat] = None


class ChatRequest(_Generation):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None


class CompletionRequest(_Generation):
    prompt: Union[str, List[str]]


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}.",
                        code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, f"{where}{first.get('msg', 'invalid request')}.", param=param, code=code)


def check_supported(req: _Generation) -> None:
    """A 400 naming the first field asked for that we do not support yet
    (rather than silently ignoring it)."""
    unsupported = {
        "n": (req.n or 1) > 1,
        "logprobs": getattr(req, "logprobs", None) not in (None, False),
        "top_logprobs": bool(getattr(req, "top_logprobs", None)),
    }
    for name, asked in unsupported.items():
        if asked:
            raise APIError(400, f"'{name}' is not supported by mlx-redrafter serve yet; drop it from the request.",
                           param=name, code="unsupported_parameter")


def _generation_error(e: BaseException) -> APIError:
    if isinstance(e, RedrafterError):
        return APIError(400, e.problem, code="invalid_value")
    return APIError(500, f"Generation failed: {type(e).__name__}: {e}", type="server_error")


# --------------------------------------------------------------------------- the app


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

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        if exc.status_code == 404 and request.scope.get("route") is None:  # no route, not a handler's 404
            return _unknown_route(app, request.url.path).response()
        kind = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=kind).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error").response()

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(engine)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_supported(req)
        rendered = _render(engine, req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _serve(engine, req, request, rendered.ids, max_tokens, chat=True, rendered=rendered)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_supported(req)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "Only one prompt per request is supported.", param="prompt", code="invalid_value")
            prompt = prompt[0]
        return await _serve(engine, req, request, engine.text_ids(prompt), req.max_tokens, chat=False)

    from .ollama_api import ollama_router  # here: it builds on this module's streaming helpers

    app.include_router(ollama_router(engine))  # Ollama's native API, on the same engine and queue
    if ui:
        mount_ui(app)
    return app


def _render(engine: Engine, req: ChatRequest) -> Rendered:
    """The request's prompt through the chat template, with its tools."""
    try:
        return engine.render([m.plain() for m in req.messages], req.tools, req.tool_choice)
    except RedrafterError as e:  # a tool_choice that cannot be honoured
        raise APIError(400, e.problem, param="tool_choice", code="invalid_value") from None
    except Exception as e:  # e.g. a template that refuses a role or an order of roles
        raise APIError(400, f"The model's chat template refused these messages: {e}", param="messages",
                       code="invalid_value") from None


def _unknown_route(app: FastAPI, path: str) -> APIError:
    """A 404 naming ``path`` and the routes this server has."""
    routes = sorted({r.path for r in app.routes if isinstance(r, APIRoute)})
    return APIError(404, f"{path} is not supported by mlx-redrafter serve; supported: {', '.join(routes)}.",
                    code="not_found")


def mount_ui(app: FastAPI, folder: Path = UI_DIR) -> None:
    """Serve the chat page at ``/`` and its files under ``/ui/``."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(folder / "index.html")

    app.mount("/ui", StaticFiles(directory=folder), name="ui")


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "mlx-redrafter", **engine.card()}


def _params(engine: Engine, req: _Generation, max_tokens: Optional[int], grammar=None) -> GenParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    asked = {"temp": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p}
    sampling = replace(engine.sampling, **{k: v for k, v in asked.items() if v is not None})
    return GenParams(max_tokens or engine.max_tokens, sampling, req.seed, stop, grammar)


async def _grammar(engine: Engine, req: _Generation):
    """The request's compiled grammar (None: free text); a bad schema is a 400 naming the problem."""
    spec = req.response_format.grammar() if req.response_format is not None else None
    if spec is None:
        return None
    try:  # off the event loop: the first compile builds the tokenizer's index (about a second)
        return await asyncio.to_thread(engine.grammar, spec)
    except RedrafterError as e:
        raise APIError(400, e.problem, param="response_format", code="invalid_value") from None


async def _serve(engine: Engine, req: _Generation, request: Request, ids: List[int], max_tokens, chat: bool,
                 rendered: Optional[Rendered] = None):
    """Queue the request and answer it, streamed or whole."""
    if req.model is not None and req.model != engine.model_id:
        raise APIError(404, f"The model '{req.model}' does not exist here; this server serves '{engine.model_id}'.",
                       param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind, value):  # called on the worker thread
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    if not ids:
        raise APIError(400, "The prompt is empty.", param="messages" if chat else "prompt", code="invalid_value")
    grammar = await _grammar(engine, req)
    try:
        job = engine.job(ids, _params(engine, req, max_tokens, grammar), emit)
    except RedrafterError as e:
        raise APIError(400, e.problem, param="messages" if chat else "prompt", code="context_length_exceeded")
    try:
        engine.submit(job)
    except QueueFull as e:
        raise APIError(503, f"The server is busy: {e} Retry later.", type="server_error", code="queue_full")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    reply = Reply(engine, job, chat, include_usage, rendered, lambda e: _generation_error(e).body())
    if req.stream:
        return _CancellingStream(job, reply.sse(_events(events, job, request)), media_type="text/event-stream")
    try:
        text, result = "", None
        async for kind, value in _events(events, job, request):
            if kind == "text":
                text += value.text
            elif kind == "error":
                raise _generation_error(value)
            else:
                result = value
    finally:
        job.cancel()  # a no-op once it is done; stops it when this handler is cancelled
    if result is None or result.cancelled:  # the client left: nobody reads this
        return JSONResponse(status_code=499, content=None)
    return reply.whole(result)


async def _events(events: asyncio.Queue, job: Job, request: Request) -> AsyncIterator[Tuple[str, object]]:
    """The job's events until it is done; cancels the job when the client leaves."""
    while True:
        try:
            kind, value = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            kind = None
        if await request.is_disconnected():
            job.cancel()
            return
        if kind is None:
            continue
        yield kind, value
        if kind in ("done", "error"):
            return


class _CancellingStream(StreamingResponse):
    """A streamed reply that stops its job however the stream ends."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
