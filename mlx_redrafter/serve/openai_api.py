"""OpenAI's API over an :class:`~mlx_redrafter.serve.Engine` (FastAPI,
pydantic request models); :mod:`~mlx_redrafter.serve.app` puts it in the app.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (with tools),
``POST /v1/completions`` (both streamed as server-sent events when
``stream`` is true). Errors are OpenAI's error objects (:func:`error_body`); a field we do not support yet is a 400
naming it (:func:`check_supported`), an unknown route a 404 listing the
supported ones. Responses add one field standard clients ignore,
``redrafter`` (the drafting stats) on a reply and its last streamed chunk,
``x_redrafter`` (each token's source, see
:class:`~mlx_redrafter.serve.engine.Piece`) on each streamed chunk with text.
``response_format`` (``text``, ``json_object``, ``json_schema``) makes the
reply structured output; cut by ``max_tokens`` (``finish_reason
"length"``) it is incomplete JSON, and ``redrafter.structured.complete``
says so. Tool calls are constrained too (:mod:`~mlx_redrafter.serve.tool_grammar`):
``tool_choice`` and ``parallel_tool_calls`` as OpenAI's; with tools and a
``response_format``, what is not a call is that JSON.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine import Engine, GenParams
from .openai_reply import Reply
from .streaming import (
    CRASH,
    INVALID,
    MISSING,
    UNSUPPORTED,
    Failure,
    check_model,
    client_left,
    generation_failure,
    request_grammar,
    request_prompt,
    sampling,
    submit,
    tokenized,
)
from .tools import Rendered

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

    def grammar_spec(self):
        """The grammar spec this format asks for (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json"
        if self.json_schema is None:
            raise Failure(
                400,
                "response_format of type 'json_schema' needs a 'json_schema' object.",
                MISSING,
                "response_format.json_schema",
            )
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
    parallel_tool_calls: Optional[bool] = None  # OpenAI's default: true


class CompletionRequest(_Generation):
    prompt: Union[str, List[str]]


# --------------------------------------------------------------------------- errors


def error_body(f: Failure) -> dict:
    """OpenAI's error object for ``f``."""
    kind = "server_error" if f.status >= 500 else "invalid_request_error"
    return {
        "error": {"message": f.message, "type": kind, "param": f.param, "code": None if f.kind == CRASH else f.kind}
    }


def error_response(f: Failure) -> JSONResponse:
    return JSONResponse(status_code=f.status, content=error_body(f))


def validation_failure(exc: RequestValidationError) -> Failure:
    """A request body that does not parse or validate: a 400 naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return Failure(
            400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}.", "invalid_json"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    kind = MISSING if first.get("type") == "missing" else INVALID
    return Failure(400, f"{where}{first.get('msg', 'invalid request')}.", kind, param)


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
            raise Failure(
                400,
                f"'{name}' is not supported by mlx-redrafter serve yet; drop it from the request.",
                UNSUPPORTED,
                name,
            )


# --------------------------------------------------------------------------- the routes


def openai_router(engine: Engine) -> APIRouter:
    """OpenAI's routes over ``engine`` (errors: the app's handlers answer them in OpenAI's shape)."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(engine)]}

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_supported(req)
        spec = req.response_format.grammar_spec() if req.response_format is not None else None
        rendered = await request_prompt(
            engine,
            [m.plain() for m in req.messages],
            req.tools,
            req.tool_choice,
            "response_format",
            parallel_tool_calls=req.parallel_tool_calls,
            content=spec,
        )
        check_model(engine, req.model)  # before the grammar's compilation, which may take a second
        # The reply's grammar: the tool calls' (the content's schema within), or the schema alone.
        compiled = await request_grammar(engine, rendered.grammar, "tools" if rendered.tools else "response_format")
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _serve(
            engine, req, request, rendered.ids, max_tokens, chat=True, compiled=compiled, rendered=rendered
        )

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_supported(req)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise Failure(400, "Only one prompt per request is supported.", INVALID, "prompt")
            prompt = prompt[0]
        ids = await tokenized(engine.text_ids, prompt, param="prompt")
        check_model(engine, req.model)
        spec = req.response_format.grammar_spec() if req.response_format is not None else None
        compiled = await request_grammar(engine, spec, "response_format")
        return await _serve(engine, req, request, ids, req.max_tokens, chat=False, compiled=compiled)

    return router


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "mlx-redrafter", **engine.card()}


def _params(engine: Engine, req: _Generation, max_tokens: Optional[int], grammar=None) -> GenParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampled = sampling(engine, temp=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)
    return GenParams(max_tokens or engine.max_tokens, sampled, req.seed, stop, grammar)


async def _serve(
    engine: Engine,
    req: _Generation,
    request: Request,
    ids: List[int],
    max_tokens,
    chat: bool,
    compiled,
    rendered: Optional[Rendered] = None,
):
    """Queue the request (its model checked, its grammar ``compiled``) and answer it, streamed or whole."""
    queued = submit(engine, ids, _params(engine, req, max_tokens, compiled), "messages" if chat else "prompt")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    reply = Reply(engine, queued.job, chat, include_usage, rendered, lambda e: error_body(generation_failure(e)))
    if req.stream:
        return queued.stream(reply.sse(queued.events(request)))
    result = await queued.result(request)
    return client_left() if result is None else reply.whole(result)
