"""Ollama's native API over the same :class:`~mlx_redrafter.serve.engine.Engine`
(and queue) as the OpenAI routes, for clients that speak only Ollama
(Enchanted, Zed's and Goose's Ollama providers, Open WebUI's Ollama mode,
the ``ollama`` Python client).

Routes: ``GET /api/tags``, ``POST /api/show``, ``GET /api/version``, ``GET
/api/ps``, and ``POST /api/chat`` / ``POST /api/generate``, streamed as
NDJSON unless the body says ``"stream": false``. ``options`` may set
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``num_predict``
(-1 or -2: until the context is full) and ``stop``; options that only tune
Ollama's own runtime (``num_ctx``, ``num_gpu``, ...) are ignored with a
warning in the log; any other option, and the fields this server cannot
honour yet (``images``, ``think``, ...), get a 400 that names them.
``format`` (``"json"`` or a JSON Schema) makes the reply structured output
(:mod:`~mlx_redrafter.step.grammar`). ``tools`` on ``/api/chat`` go through :mod:`~mlx_redrafter.serve.tools`,
their calls constrained (with ``format``, what is not a call is that JSON).
Errors are Ollama's: ``{"error": "..."}``, also as a line of a stream.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine import Engine, GenParams
from .ollama_reply import ModelFacts, OllamaReply, line
from .streaming import (
    CRASH,
    INVALID,
    NO_MODEL,
    Failure,
    client_left,
    generation_failure,
    request_grammar,
    request_prompt,
    sampling,
    submit,
    tokenized,
)

log = logging.getLogger(__name__)

# The Ollama API version whose routes and fields these follow (clients check it).
OLLAMA_VERSION = "0.12.0"

# Options that tune Ollama's runtime, not the reply: ignored here, with a warning.
RUNTIME_OPTIONS = {
    "num_ctx",
    "num_keep",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "vocab_only",
    "f16_kv",
    "logits_all",
}
# Sampling options not implemented here, accepted at the value that changes nothing.
NEUTRAL_OPTIONS = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "mirostat": 0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "repeat_last_n": None,
    "penalize_newline": None,
    "mirostat_tau": None,
    "mirostat_eta": None,
}


def error_response(f: Failure) -> JSONResponse:
    """Ollama's error: ``{"error": message}`` (the message names the field at fault)."""
    named = f.param is None or f.param in f.message
    return JSONResponse(status_code=f.status, content={"error": f.message if named else f"{f.param}: {f.message}"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Options(_Body):
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, le=2**64 - 1)  # negative: a random seed, as llama.cpp's -1
    num_predict: Optional[int] = Field(None, ge=-2)
    stop: Union[str, List[str], None] = None


class Message(_Body):
    role: str
    content: Optional[str] = ""
    images: Optional[List[Any]] = None
    tool_calls: Optional[List[dict]] = None
    tool_name: Optional[str] = None
    thinking: Optional[str] = None


class _Generation(_Body):
    model: Optional[str] = None
    stream: bool = True
    options: Optional[Options] = None
    format: Optional[Any] = None
    keep_alive: Union[int, float, str, None] = None
    think: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


class ChatBody(_Generation):
    messages: List[Message] = Field(default_factory=list)
    tools: Optional[List[dict]] = None


class GenerateBody(_Generation):
    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: bool = False
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[List[int]] = None
    images: Optional[List[Any]] = None


class ModelBody(_Body):
    model: Optional[str] = None
    name: Optional[str] = None  # older clients' name for ``model``


def _unsupported(req: _Generation, extra: dict) -> None:
    """A 400 naming the first field this server cannot honour yet."""
    asked = [k for k, v in extra.items() if v]
    if req.think not in (None, False):
        raise Failure(400, "'think' is not supported: the served model does not think; drop it.")
    if req.logprobs or req.top_logprobs:
        raise Failure(400, "'logprobs' is not supported yet; drop it.")
    if asked:
        raise Failure(400, f"'{asked[0]}' is not supported by this server; drop it.")
    options = req.options.model_extra if req.options is not None else {}
    for name, value in (options or {}).items():
        if name in RUNTIME_OPTIONS:
            log.warning("Ignoring the Ollama option %s=%r: it tunes Ollama's own runtime.", name, value)
        elif name not in NEUTRAL_OPTIONS or NEUTRAL_OPTIONS[name] not in (None, value):
            raise Failure(400, f"The option 'options.{name}' is not supported by this server; drop it.")


def _check_model(engine: Engine, facts: ModelFacts, model: Optional[str]) -> None:
    if model and model not in (*engine.names, facts.name):  # the served names (serve --served-model-name) too
        raise Failure(404, f"model '{model}' not found; this server serves '{facts.name}'.", NO_MODEL, "model")


def _format(fmt):
    """Ollama's ``format``: ``"json"``, a JSON Schema, or None without one;
    anything else is a 400."""
    if fmt in (None, ""):
        return None
    if not (fmt == "json" or isinstance(fmt, dict)):
        raise Failure(400, f"'format' must be \"json\" or a JSON Schema object (got {fmt!r}).", INVALID, "format")
    return fmt


def _params(engine: Engine, options: Optional[Options], grammar=None) -> GenParams:
    o = options or Options()
    sampled = sampling(engine, temp=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p)
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    if o.num_predict == 0:
        raise Failure(400, "options.num_predict must be positive, or -1 (until the context is full).")
    # -1 (no limit) and -2 (fill the context): the engine cuts it to the context's room.
    max_tokens = engine.max_tokens if o.num_predict is None else (o.num_predict if o.num_predict > 0 else 1 << 30)
    seed = o.seed if o.seed is None or o.seed >= 0 else None
    return GenParams(max_tokens, sampled, seed, stop, grammar)


def ollama_router(engine: Engine) -> APIRouter:
    """The Ollama routes over ``engine`` (include it in the app that runs the engine)."""
    router = APIRouter()
    facts: List[ModelFacts] = []

    def model_facts() -> ModelFacts:  # measured on first use, not at import
        if not facts:
            facts.append(ModelFacts.of(engine))
        return facts[0]

    @router.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @router.get("/api/tags")
    async def tags():
        return {"models": [model_facts().tag()]}

    @router.get("/api/ps")
    async def ps():
        return {"models": [model_facts().running()]}

    @router.post("/api/show")
    async def show(body: ModelBody):
        _check_model(engine, model_facts(), body.model or body.name)
        return model_facts().show(engine)

    @router.post("/api/chat")
    async def chat(body: ChatBody, request: Request):
        _unsupported(body, {"images": any(m.images for m in body.messages)})
        _check_model(engine, model_facts(), body.model)
        reply_only = not body.messages
        rendered = None if reply_only else await _render(engine, body)
        return await _answer(
            engine, body, request, rendered.ids if rendered else [], OllamaReply(engine, True, rendered), rendered
        )

    @router.post("/api/generate")
    async def generate(body: GenerateBody, request: Request):
        _unsupported(
            body, {"images": body.images, "suffix": body.suffix, "template": body.template, "context": body.context}
        )
        _check_model(engine, model_facts(), body.model)
        ids = await tokenized(_generate_ids, engine, body, param="prompt")
        return await _answer(engine, body, request, ids, OllamaReply(engine, False))

    return router


async def _render(engine: Engine, body: ChatBody):
    """The chat's prompt with its tools (Ollama has no tool_choice: auto) and
    the reply's grammar, ``format`` within."""
    messages = [m.model_dump(exclude_none=True, exclude={"images", "thinking"}) for m in body.messages]
    return await request_prompt(engine, messages, body.tools or None, None, "format", content=_format(body.format))


def _generate_ids(engine: Engine, body: GenerateBody) -> List[int]:
    if not body.prompt:
        return []
    if body.raw:
        return engine.text_ids(body.prompt)
    system = [{"role": "system", "content": body.system}] if body.system else []
    return engine.chat_ids(system + [{"role": "user", "content": body.prompt}])


async def _answer(
    engine: Engine, body: _Generation, request: Request, ids: List[int], reply: OllamaReply, rendered=None
):
    """Queue the request and answer it, as NDJSON lines or one object (a
    chat's grammar comes with its ``rendered`` prompt)."""
    if not ids:  # Ollama's way to load a model: nothing to generate
        return reply.loaded()
    spec = rendered.grammar if rendered is not None else _format(body.format)
    compiled = await request_grammar(engine, spec, "tools" if rendered is not None and rendered.tools else "format")
    queued = submit(
        engine, ids, _params(engine, body.options, compiled), "messages" if isinstance(body, ChatBody) else "prompt"
    )
    lines = _lines(reply, queued.events(request), body.stream)
    if body.stream:
        return queued.stream(lines, media_type="application/x-ndjson")
    try:
        out = [obj async for obj in lines]
    finally:
        queued.job.cancel()  # a no-op once it is done; stops it when this handler is cancelled
    if not out:  # the client left: nobody reads this
        return client_left()
    if "error" in out[-1]:
        raise Failure(500, out[-1]["error"], CRASH)
    return out[-1]


async def _lines(reply: OllamaReply, events, streamed: bool):
    """The reply's objects: NDJSON lines when ``streamed``, else the last one only."""
    async for kind, value in events:
        if kind == "text":
            for obj in reply.pieces(value.text):
                if streamed:
                    yield line(obj)
        elif kind == "error":
            error = generation_failure(value).message
            yield line({"error": error}) if streamed else {"error": error}
            return
        elif not value.cancelled:
            for obj in reply.pieces("", end=True):
                if streamed:
                    yield line(obj)
            final = reply.final(value, streamed)
            yield line(final) if streamed else final
