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

A ``system``-role message inside ``messages`` (Claude Code sends one) is
rendered in its place; tools with ``defer_loading`` are left out of the
prompt, as Anthropic's API leaves them out until a tool search loads them;
``thinking`` blocks of earlier turns are dropped, as Anthropic's API drops
them. Fields that do not change the reply here (``metadata``,
``service_tier``, ``cache_control``: the prompt cache works on its own,
``thinking`` and ``output_config.effort`` for a model that neither thinks
nor has effort levels, ``context_management`` edits that only clear
thinking) are accepted and named once in the log (:mod:`.policy`); server
tools (``web_search_*``, ...) are left out of the prompt, with a log line.
Anything else this server cannot honour (images, documents, other tool
types, ``context_management`` edits of tool results, a final assistant
message to continue, ...) is a 400 naming the field, as Anthropic's API
refuses a field it does not know. A prompt longer than the context is
Anthropic's ``prompt is too long: N tokens > M maximum`` (Claude Code
compacts its history on these words). Errors are Anthropic's: ``{"type":
"error", "error": {"type": ..., "message": ...}}``. The ``x-api-key``,
``anthropic-version`` and ``anthropic-beta`` headers and the ``?beta=true``
query are accepted (the key is checked where the server has one); the betas
they name are the fields above.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .anthropic_reply import CountOut, MessageOut, MessageReply
from .engine import Engine, GenParams
from .policy import hosted_tool, note_once
from .streaming import (
    KEEPALIVE_S,
    MISSING,
    UNSUPPORTED,
    Failure,
    check_model,
    client_left,
    refuse_nested_extras,
    request_grammar,
    request_prompt,
    sampling,
    shared_head,
    submit,
    tokenized,
    unsupported,
)
from .tools import Rendered

API = "Anthropic Messages"

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
# Top-level fields accepted although they change nothing here, and why (logged once per server).
NO_EFFECT = {
    "metadata": "it is bookkeeping for a hosted service",
    "service_tier": "one model serves every request alike",
    "inference_geo": "the model runs on this machine",
    "cache_control": "the prompt cache reuses every prefix it holds on its own",
}
THINKS_NOT = "the served model does not think: replies have no thinking blocks"


def error_body(f: Failure) -> dict:
    """Anthropic's error object for ``f`` (a prompt past the context in Anthropic's words: :func:`too_long`)."""
    kind = ERROR_TYPES.get(f.status, "api_error" if f.status >= 500 else "invalid_request_error")
    message = too_long(*f.sizes) if f.sizes is not None else f.message
    return {"type": "error", "error": {"type": kind, "message": message}}


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
    thinking: Optional[str] = None  # an earlier turn's thinking block (dropped, as Anthropic's API drops it)
    signature: Optional[str] = None
    data: Optional[str] = None  # redacted_thinking


class MessageIn(_Body):
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Block]]


class ToolIn(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None  # a custom tool's (required there); server tools have none
    type: Optional[str] = None  # "custom" (or none); server tools have other types
    cache_control: Optional[Dict[str, Any]] = None
    defer_loading: Optional[bool] = None  # left out of the prompt until a tool search loads it


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Body):
    type: str
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


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


def check_supported(engine: Engine, req: CountRequest) -> None:
    """A 400 naming the first field asked for that this server cannot honour;
    those it accepts with no effect are logged once (:data:`NO_EFFECT`)."""
    declared = {k: getattr(req, k) for k in NO_EFFECT if k in type(req).model_fields}
    for name, value in {**(req.model_extra or {}), **declared}.items():
        if value is None:
            continue
        if name == "context_management":
            _check_context_management(value)
            note_once(engine, API, name, "its edits clear thinking, and replies here have none")
        elif name in NO_EFFECT:
            note_once(engine, API, name, NO_EFFECT[name])
        else:
            raise unsupported(name)
    if req.thinking is not None and req.thinking.type != "disabled":
        note_once(engine, API, "thinking", THINKS_NOT)
    config = getattr(req, "output_config", None)
    if config is not None and config.effort is not None:
        note_once(engine, API, "output_config.effort", "the served model has no effort levels")
    if req.messages[-1].role == "assistant":
        raise unsupported(
            f"messages.{len(req.messages) - 1}",
            "a final assistant message (a prefill to continue) cannot be continued here; end with a user message",
        )


def _check_context_management(value) -> None:
    """Only edits that clear thinking (a no-op: no thinking here) are accepted;
    one that clears tool results would change the prompt, which this server does not."""
    if not isinstance(value, dict):
        raise Failure(400, "'context_management' must be an object.", param="context_management")
    for key in value:
        if key != "edits":
            raise unsupported(f"context_management.{key}")
    for i, edit in enumerate(value.get("edits") or []):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not str(kind).startswith("clear_thinking"):
            raise unsupported(
                f"context_management.edits.{i}",
                f"this server cannot apply the edit {kind!r} (it keeps the prompt as sent); "
                "only clear_thinking edits, a no-op here, are accepted",
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


# Claude Code's first system block: billing metadata for Anthropic, not for the model, whose
# cc_version suffix and cch hash change with each conversation (and request) at the prompt's
# first tokens, so no new conversation would reuse the cached system prompt and tools.
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_blocks(system: Union[str, List[Block]]) -> List[Block]:
    """The system prompt's blocks less Claude Code's billing header (as sglang and vllm-mlx drop it)."""
    return [b for b in _blocks(system) if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER))]


def chat_messages(req: CountRequest) -> List[dict]:
    """The request's system prompt and messages as the chat template reads
    them (OpenAI's shape: tool calls on the assistant, results as ``tool``
    messages that answer them); Claude Code's billing-header block is left out."""
    out: List[dict] = []
    system = _system_blocks(req.system) if req.system else []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(req.messages):
        if m.role == "system":  # in its place in the conversation (Claude Code's environment notes)
            out.append({"role": "system", "content": _text(_blocks(m.content), f"messages.{i}.content")})
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(_blocks(m.content)):
            where = f"messages.{i}.content.{j}"
            if b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier turns' thinking is not part of the prompt (as in Anthropic's API)
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


def openai_tools(engine: Engine, tools: Optional[List[ToolIn]]) -> Tuple[Optional[list], List[str]]:
    """Anthropic's custom tools as function tools, and the paths of those
    left out of the prompt: deferred ones (``defer_loading``) and server
    tools (logged once, :func:`~.policy.hosted_tool`); other tool types are
    refused by name."""
    out, skipped = [], []
    for i, t in enumerate(tools or []):
        if t.defer_loading or hosted_tool(engine, API, t.type, "tools"):
            skipped.append(f"tools.{i}")
            continue
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
    return out or None, skipped


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


async def _render(engine: Engine, req: CountRequest, content=None, bounded: bool = True) -> Tuple[Rendered, int]:
    """The request's prompt, and how many of its tokens are the head every turn repeats (:func:`shared_head`)."""
    check_supported(engine, req)
    choice, parallel = tool_choice(req.tool_choice)
    messages = chat_messages(req)
    tools, skipped = openai_tools(engine, req.tools)
    options = dict(parallel_tool_calls=parallel, content=content, bounded=bounded)
    rendered = await request_prompt(engine, messages, tools, choice, content_param="output_config.format", **options)
    refuse_nested_extras(req, skipped)
    return rendered, await tokenized(shared_head, engine, messages, rendered.ids, tools, choice)


def too_long(tokens: int, maximum: int) -> str:
    """Anthropic's words for a prompt past the context (Claude Code compacts its history on them)."""
    return f"prompt is too long: {tokens} tokens > {maximum} maximum"


# --------------------------------------------------------------------------- the routes


def anthropic_router(engine: Engine) -> APIRouter:
    """The Messages routes over ``engine`` (include it in the app that runs the engine)."""
    router = APIRouter()

    @router.post("/v1/messages", response_model=MessageOut, response_model_exclude_none=True)
    async def messages(req: MessagesRequest, request: Request):
        check_model(engine, req.model)
        fmt = req.output_config.format if req.output_config is not None else None
        rendered, head = await _render(engine, req, fmt.schema_ if fmt is not None else None)
        compiled = await request_grammar(engine, rendered.grammar, "output_config.format" if fmt else "tools")
        sampled = sampling(engine, temp=req.temperature, top_p=req.top_p, top_k=req.top_k)
        params = GenParams(req.max_tokens, sampled, None, list(req.stop_sequences or []), compiled)
        queued = submit(engine, rendered.ids, params, head=head)
        reply = MessageReply(engine, rendered, error_body)
        if req.stream:
            return queued.stream(reply.sse(queued.events(request, KEEPALIVE_S)))
        result = await queued.result(request)
        return client_left() if result is None else reply.whole(result)

    @router.post("/v1/messages/count_tokens", response_model=CountOut)
    async def count_tokens(req: CountRequest):
        check_model(engine, req.model)
        # Counted whatever the length (no early refusal): what a client decides on; the body bound limits the work.
        return JSONResponse({"input_tokens": len((await _render(engine, req, bounded=False))[0].ids)})

    return router
