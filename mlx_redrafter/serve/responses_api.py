"""OpenAI's Responses API over the same :class:`~mlx_redrafter.serve.engine.Engine`
(and queue) as the other routes, for clients that speak it (Codex CLI, the
``openai`` SDK's ``client.responses``).

Route: ``POST /v1/responses`` (server-sent events when ``stream`` is true).
The server is stateless, as Ollama's Responses API is: a request carries
the whole conversation, ``previous_response_id``, ``conversation`` and
``store: true`` are a 400 that says so, and nothing is kept to fetch later.
A request holds ``input`` (a string, or items: messages of
``input_text``/``output_text`` parts, ``function_call`` and
``function_call_output`` items), ``instructions`` (a system message),
``tools`` (function tools, the API's flat shape) and ``tool_choice`` (calls
constrained by the grammar engine, see :mod:`~mlx_redrafter.serve.tools`),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``
and ``text.format`` (``text``, ``json_object`` or ``json_schema``, through
the grammar engine). ``namespace`` tools (Codex groups its agent tools in
one) are their functions, each call coming back with its ``namespace``.
Fields that do not change the reply here (``metadata``, ``user``,
``client_metadata``, ``prompt_cache_key``: the prompt cache finds prefixes
on its own, ``reasoning`` for a model that does not reason, ``include:
["reasoning.encrypted_content"]`` with no reasoning to include, ...) are
accepted and named once in the log (:mod:`.policy`); hosted tools
(``web_search``, ...) are left out of the prompt, with a log line. Anything
else this server cannot honour (images, files, other tool types, ...) is a
400 naming the field. A prompt longer than the context is a 400 with code
``context_length_exceeded``. Errors are OpenAI's error objects.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from .engine import Engine, GenParams
from .policy import hosted_tool, note_once
from .responses_reply import ResponseOut, ResponsesReply
from .streaming import (
    KEEPALIVE_S,
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

API = "Responses"
# Fields accepted although they change nothing here, and why (logged once per server).
NO_EFFECT = {
    "metadata": "it is bookkeeping for a hosted service",
    "client_metadata": "it is bookkeeping for a hosted service",
    "user": "it is bookkeeping for a hosted service",
    "safety_identifier": "it is bookkeeping for a hosted service",
    "prompt_cache_key": "the prompt cache finds every prefix it holds on its own",
    "prompt_cache_retention": "the prompt cache keeps entries by its own bounds (--prompt-cache-size, -bytes)",
    "service_tier": "one model serves every request alike",
    "stream_options": "the stream's events are the same either way",
}
# What ``include`` may ask for: this server's replies hold no reasoning to include.
INCLUDABLE = {"reasoning.encrypted_content"}
STATELESS = "mlx-redrafter serve is stateless (it keeps no responses or conversations)"


class _Body(BaseModel):
    # Unknown fields are kept so that the checks can name them.
    model_config = ConfigDict(extra="allow")


class Part(_Body):
    type: str
    text: Optional[str] = None
    annotations: Optional[List[Any]] = None  # an output_text part sent back as history
    logprobs: Optional[List[Any]] = None


class Item(_Body):
    """An input item: a message (``type`` ``"message"`` or none), a
    ``function_call`` or a ``function_call_output``; other types are refused."""

    type: Optional[str] = None
    role: Optional[Literal["user", "assistant", "system", "developer"]] = None
    content: Union[str, List[Part], None] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, List[Part], None] = None
    id: Optional[str] = None
    status: Optional[str] = None
    namespace: Optional[str] = None  # a function_call of a namespace's function


class FunctionTool(_Body):
    """A function tool, or a ``namespace`` of them (its ``tools``)."""

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None
    tools: Optional[List["FunctionTool"]] = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Body):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``'s body."""

    model: Optional[str] = None
    input: Union[str, List[Item]]
    instructions: Optional[str] = None
    tools: Optional[List[FunctionTool]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    text: Optional[TextConfig] = None
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    include: Optional[List[str]] = None
    truncation: Optional[str] = None
    reasoning: Optional[Dict[str, Any]] = None


# --------------------------------------------------------------------------- requests into prompts


def check_supported(engine: Engine, req: ResponsesRequest) -> None:
    """A 400 naming the first field asked for that this server cannot honour;
    those it accepts with no effect are logged once (:data:`NO_EFFECT`)."""
    if req.previous_response_id is not None:
        raise _stateless("previous_response_id", "send the whole conversation in 'input'")
    if req.store:
        raise _stateless("store", "send store: false, or leave it out")
    for name, value in (req.model_extra or {}).items():
        if name == "conversation" and value is not None:
            raise _stateless(name, "send the whole conversation in 'input'")
        if value is None:
            continue
        if name not in NO_EFFECT:
            raise unsupported(name)
        note_once(engine, API, name, NO_EFFECT[name])
    extra = [i for i in req.include or [] if i not in INCLUDABLE]
    if extra:
        raise unsupported("include", f"this server cannot include {extra[0]!r}")
    if req.include:
        note_once(engine, API, "include", "the replies hold no reasoning to include")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", "a conversation longer than the context is refused, not truncated")
    if req.reasoning and any(v not in (None, "none") for v in req.reasoning.values()):
        note_once(engine, API, "reasoning", "the served model does not reason: replies have no reasoning items")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity")


def _stateless(field: str, fix: str) -> Failure:
    return Failure(400, f"'{field}' cannot be honoured: {STATELESS}; {fix}.", UNSUPPORTED, field)


def _text(content: Union[str, List[Part], None], where: str) -> str:
    if not isinstance(content, list):
        return content or ""
    for j, p in enumerate(content):
        if p.type not in ("input_text", "output_text", "text"):
            raise Failure(
                400,
                f"'{where}.{j}' is an '{p.type}' part, which mlx-redrafter serve does not support; "
                "send input_text or output_text parts.",
                UNSUPPORTED,
                f"{where}.{j}",
            )
    return "".join(p.text or "" for p in content)


def _add_call(out: List[dict], item: Item, where: str) -> None:
    """A ``function_call`` item joins the assistant turn before it (a new one if there is none)."""
    if not item.name or item.call_id is None:
        raise Failure(400, f"'{where}': a function_call item needs its 'name' and 'call_id'.", param=where)
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments or "{}"},
    }
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def chat_messages(req: ResponsesRequest) -> List[dict]:
    """The request's instructions and input as the chat template reads them
    (OpenAI's chat shape: calls on the assistant, outputs as ``tool`` messages)."""
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out: List[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if item.type in (None, "message"):
            role = "system" if item.role == "developer" else (item.role or "user")
            text = _text(item.content, f"{where}.content")
            if role == "system" and out and out[-1]["role"] == "system":  # the instructions and a system message: one
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": role, "content": text})
        elif item.type == "function_call":
            _add_call(out, item, where)
        elif item.type == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": item.call_id or "", "content": _text(item.output, f"{where}.output")}
            )
        else:
            raise Failure(
                400,
                f"'{where}' is a '{item.type}' item, which mlx-redrafter serve does not support; "
                "send messages, function_call and function_call_output items.",
                UNSUPPORTED,
                where,
            )
    return out


class Tools:
    """A request's tools in the chat shape (``functions``, None without any),
    the namespace of each namespaced function's name (``namespaces``), and
    the paths of hosted tools left out of the prompt (``skipped``, each logged
    once: :func:`~.policy.hosted_tool`); other tool types are refused by name."""

    def __init__(self, engine: Engine, tools: Optional[List[FunctionTool]]):
        self.namespaces: Dict[str, str] = {}
        self.skipped: List[str] = []
        out: List[dict] = []
        for i, t in enumerate(tools or []):
            if hosted_tool(engine, API, t.type, "tools"):
                self.skipped.append(f"tools.{i}")
            elif t.type == "namespace" and t.name:
                out += [self._function(f, f"tools.{i}.tools.{j}", t) for j, f in enumerate(t.tools or [])]
            else:
                out.append(self._function(t, f"tools.{i}"))
        names = [f["function"]["name"] for f in out]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise Failure(400, f"Two tools are named {twice!r} (namespaces included); name them apart.", param="tools")
        self.functions = out or None

    def _function(self, t: FunctionTool, where: str, namespace: Optional[FunctionTool] = None) -> dict:
        if t.type != "function" or not t.name:
            raise Failure(
                400,
                f"'{where}' is a '{t.type}' tool, which mlx-redrafter serve does not have; send "
                "function tools with a name.",
                UNSUPPORTED,
                where,
            )
        function = {"name": t.name, "parameters": t.parameters or {"type": "object", "properties": {}}}
        about = [namespace.description if namespace else None, t.description]
        if any(about):
            function["description"] = "\n\n".join(a for a in about if a)
        if namespace is not None:
            self.namespaces[t.name] = namespace.name
        return {"type": "function", "function": function}


def content_spec(req: ResponsesRequest):
    """The grammar spec ``text.format`` asks for (None: free text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json"
    if fmt.schema_ is None:
        raise Failure(400, "text.format of type 'json_schema' needs its 'schema'.", param="text.format.schema")
    return fmt.schema_


def _echo(req: ResponsesRequest, parallel: bool) -> dict:
    """The request's fields a response repeats."""
    fmt = (
        req.text.format.model_dump(by_alias=True, exclude_none=True)
        if req.text and req.text.format
        else {"type": "text"}
    )
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": parallel,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": fmt},
        "metadata": (req.model_extra or {}).get("metadata") or {},
    }


# --------------------------------------------------------------------------- the route


def responses_router(engine: Engine) -> APIRouter:
    """The Responses route over ``engine`` (include it in the app that runs the engine)."""
    router = APIRouter()

    @router.post("/v1/responses", response_model=ResponseOut)
    async def responses(req: ResponsesRequest, request: Request):
        check_supported(engine, req)
        check_model(engine, req.model)
        spec = content_spec(req)
        messages, tools = chat_messages(req), Tools(engine, req.tools)
        options = dict(parallel_tool_calls=req.parallel_tool_calls, content=spec)
        rendered = await request_prompt(
            engine,
            messages,
            tools.functions,
            req.tool_choice,
            content_param="text.format",
            prompt_param="input",
            **options,
        )
        refuse_nested_extras(req, tools.skipped)
        compiled = await request_grammar(engine, rendered.grammar, "text.format" if spec is not None else "tools")
        params = GenParams(
            req.max_output_tokens or engine.max_tokens,
            sampling(engine, temp=req.temperature, top_p=req.top_p),
            None,
            [],
            compiled,
        )
        head = await tokenized(shared_head, engine, messages, rendered.ids, tools.functions, req.tool_choice)
        queued = submit(engine, rendered.ids, params, "input", head=head)
        reply = ResponsesReply(engine, rendered, _echo(req, rendered.parallel), tools.namespaces)
        if req.stream:
            return queued.stream(reply.sse(queued.events(request, KEEPALIVE_S)))
        result = await queued.result(request)
        return client_left() if result is None else reply.whole(result)

    return router
