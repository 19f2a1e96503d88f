"""Anthropic's Messages API over the same :class:`~mlx_redrafter.serve.engine.Engine`
(and queue) as the other routes, for clients that speak it (Claude Code, the
``anthropic`` SDKs).

Routes: ``POST /v1/messages`` (server-sent events when ``stream`` is true)
and ``POST /v1/messages/count_tokens``. A request holds ``system`` (a string
or text blocks), ``messages`` of text, ``tool_use`` and ``tool_result``
blocks (rendered through the chat template as the OpenAI route renders tool
history), ``tools`` (custom tools: ``name``, ``description``,
``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``,
``none``; calls constrained by the grammar engine, see
:mod:`~mlx_redrafter.serve.tools`), ``max_tokens`` (required),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` (the current SDK
sends them through ``extra_body``: they are read from the body either way)
and ``output_config.format`` (a JSON Schema, through the grammar engine).

Fields that do not change the reply (``metadata``, ``service_tier``,
``cache_control``: the prompt cache works without it) are accepted. Anything
else this server cannot honour (``thinking``, images, documents, server
tools, a final assistant message to continue, ...) is a 400 naming the
field, as Anthropic's API refuses a field it does not know. Errors are
Anthropic's: ``{"type": "error", "error": {"type": ..., "message": ...}}``.
The ``x-api-key`` and ``anthropic-version`` headers are accepted (the key is
checked where the server has one).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .anthropic_reply import CountOut, MessageOut, MessageReply
from .engine import Engine, GenParams
from .streaming import (
    MISSING,
    UNSUPPORTED,
    Failure,
    check_model,
    client_left,
    refuse_nested_extras,
    request_grammar,
    request_prompt,
    sampling,
    submit,
    unsupported,
)

# Anthropic's error types by HTTP status (its API answers 529 where this server answers 503).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Top-level fields accepted although they do not change the reply.
ACCEPTED = {"metadata", "service_tier", "cache_control", "inference_geo"}


def error_body(f: Failure) -> dict:
    """Anthropic's error object for ``f``."""
    kind = ERROR_TYPES.get(f.status, "api_error" if f.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": f.message}}


def error_response(f: Failure) -> JSONResponse:
    return JSONResponse(status_code=f.status, content=error_body(f))


# --------------------------------------------------------------------------- request models


class _Body(BaseModel):
    # Unknown fields are kept so that the checks can name them (Anthropic's API refuses them too).
    model_config = ConfigDict(extra="allow")


class Block(_Body):
    """A content block: ``text``, ``tool_use`` (an assistant's call) or
    ``tool_result`` (its result, in a user message); other types are refused."""

    type: str
    text: Optional[str] = None
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Union[str, List["Block"], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[Dict[str, Any]] = None
    citations: Optional[List[Any]] = None


class MessageIn(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, List[Block]]


class ToolIn(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None  # a custom tool's (required there); server tools have none
    type: Optional[str] = None  # "custom" (or none); server tools have other types
    cache_control: Optional[Dict[str, Any]] = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Body):
    type: str
    budget_tokens: Optional[int] = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None


class CountRequest(_Body):
    """``POST /v1/messages/count_tokens``'s body."""

    model: str
    messages: List[MessageIn] = Field(min_length=1)
    system: Union[str, List[Block], None] = None
    tools: Optional[List[ToolIn]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(CountRequest):
    """``POST /v1/messages``'s body."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    output_config: Optional[OutputConfig] = None
    metadata: Optional[Dict[str, Any]] = None
    service_tier: Optional[str] = None


# --------------------------------------------------------------------------- requests into prompts


def check_supported(req: CountRequest) -> None:
    """A 400 naming the first field asked for that this server cannot honour."""
    for name in req.model_extra or {}:
        if name not in ACCEPTED:
            raise unsupported(name)
    if req.thinking is not None and req.thinking.type != "disabled":
        raise unsupported("thinking", 'the served model does not think; drop it or send {"type": "disabled"}')
    config = getattr(req, "output_config", None)
    if config is not None and config.effort is not None:
        raise unsupported("output_config.effort")
    if req.messages[-1].role == "assistant":
        raise unsupported(
            f"messages.{len(req.messages) - 1}",
            "a final assistant message (a prefill to continue) cannot be continued here; end with a user message",
        )


def _blocks(content: Union[str, List[Block]]) -> List[Block]:
    return [Block(type="text", text=content)] if isinstance(content, str) else content


def _text(blocks: List[Block], where: str) -> str:
    """The text of blocks that may only be text (a system prompt, a tool result)."""
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise Failure(
                400,
                f"'{where}.{j}' is a '{b.type}' block, which mlx-redrafter serve does not support "
                "there; send text blocks.",
                UNSUPPORTED,
                f"{where}.{j}",
            )
    return "".join(b.text or "" for b in blocks)


def _result(b: Block, where: str) -> dict:
    """A ``tool_result`` block as the chat template's tool message."""
    text = _text(_blocks(b.content or ""), f"{where}.content")
    return {"role": "tool", "tool_call_id": b.tool_use_id or "", "content": f"Error: {text}" if b.is_error else text}


def chat_messages(req: CountRequest) -> List[dict]:
    """The request's system prompt and messages as the chat template reads
    them (OpenAI's shape: tool calls on the assistant, results as ``tool``
    messages that answer them)."""
    out: List[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(_blocks(req.system), "system")})
    for i, m in enumerate(req.messages):
        texts, calls, results = [], [], []
        for j, b in enumerate(_blocks(m.content)):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                arguments = json.dumps(b.input or {}, ensure_ascii=False)
                calls.append(
                    {"id": b.id or "", "type": "function", "function": {"name": b.name or "", "arguments": arguments}}
                )
            elif b.type == "tool_result" and m.role == "user":
                results.append(_result(b, where))
            else:
                raise Failure(
                    400,
                    f"'{where}' is a '{b.type}' block, which mlx-redrafter serve does not support in "
                    f"{m.role} messages; send text, tool_use (assistant) and tool_result (user) blocks.",
                    UNSUPPORTED,
                    where,
                )
        out += results  # they answer the previous turn's calls
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def openai_tools(tools: Optional[List[ToolIn]]) -> Optional[list]:
    """Anthropic's custom tools as function tools; server tools are refused by name."""
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise Failure(
                400,
                f"'tools.{i}' is the server tool '{t.type}', which mlx-redrafter serve does not "
                "have; send custom tools (name, description, input_schema).",
                UNSUPPORTED,
                f"tools.{i}",
            )
        if t.input_schema is None:
            raise Failure(400, f"'tools.{i}.input_schema': Field required.", MISSING, f"tools.{i}.input_schema")
        function = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            function["description"] = t.description
        out.append({"type": "function", "function": function})
    return out or None


def tool_choice(choice: Optional[ToolChoice]):
    """Anthropic's tool_choice in the neutral form :func:`~mlx_redrafter.serve.tools.prompt_with_tools` takes,
    and whether several calls may come (``disable_parallel_tool_use`` says no; None: the format's default)."""
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise Failure(400, "tool_choice of type 'tool' needs the tool's 'name'.", param="tool_choice.name")
        return {"name": choice.name}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


async def _render(engine: Engine, req: CountRequest, content=None, bounded: bool = True):
    check_supported(req)
    choice, parallel = tool_choice(req.tool_choice)
    rendered = await request_prompt(
        engine,
        chat_messages(req),
        openai_tools(req.tools),
        choice,
        content_param="output_config.format",
        parallel_tool_calls=parallel,
        content=content,
        bounded=bounded,
    )
    refuse_nested_extras(req)
    return rendered


# --------------------------------------------------------------------------- the routes


def anthropic_router(engine: Engine) -> APIRouter:
    """The Messages routes over ``engine`` (include it in the app that runs the engine)."""
    router = APIRouter()

    @router.post("/v1/messages", response_model=MessageOut, response_model_exclude_none=True)
    async def messages(req: MessagesRequest, request: Request):
        check_model(engine, req.model)
        fmt = req.output_config.format if req.output_config is not None else None
        rendered = await _render(engine, req, fmt.schema_ if fmt is not None else None)
        compiled = await request_grammar(engine, rendered.grammar, "output_config.format" if fmt else "tools")
        sampled = sampling(engine, temp=req.temperature, top_p=req.top_p, top_k=req.top_k)
        params = GenParams(req.max_tokens, sampled, None, list(req.stop_sequences or []), compiled)
        queued = submit(engine, rendered.ids, params)
        reply = MessageReply(engine, rendered, error_body)
        if req.stream:
            return queued.stream(reply.sse(queued.events(request)))
        result = await queued.result(request)
        return client_left() if result is None else reply.whole(result)

    @router.post("/v1/messages/count_tokens", response_model=CountOut)
    async def count_tokens(req: CountRequest):
        check_model(engine, req.model)
        # Counted whatever the length (no early refusal): what a client decides on; the body bound limits the work.
        return JSONResponse({"input_tokens": len((await _render(engine, req, bounded=False)).ids)})

    return router
