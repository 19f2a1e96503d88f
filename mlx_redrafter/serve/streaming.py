"""What every API of ``serve`` shares between its request and the
:class:`~mlx_redrafter.serve.engine.Engine`: the model check, the sampling a
request asks for, its grammar, queueing a job, the bridge from the worker
thread's ``emit`` to the event loop, and streamed replies that stop their job
however the stream ends.

Each API answers errors in its own shape (OpenAI's error object, Ollama's
``{"error": ...}``, Anthropic's ``{"type": "error", ...}``), so this module
raises one neutral :class:`Failure` and each API turns it into its shape
(``kind`` says what went wrong in OpenAI's ``code`` vocabulary, which the
other shapes map from).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import AsyncIterator, Callable, Iterator, List, Optional, Sequence, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from ..config import SamplingConfig
from ..errors import RedrafterError
from .engine import Engine, GenParams, Job, PromptTooLong, QueueFull, Result
from .policy import fold_system, log_once
from .tool_calls import Event, ToolCallStream
from .tools import Rendered

# How often a request waiting for the model checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# A stream that asks for it hears from the server this often while nothing else comes (a long
# prefill): agents drop a stream that is silent for minutes (Claude Code, Codex CLI: 5 by default).
KEEPALIVE_S = 10.0
log = logging.getLogger(__name__)

# What a failure is, in OpenAI's ``code`` words; each API maps these to its own.
INVALID = "invalid_value"
MISSING = "missing_required_parameter"
UNSUPPORTED = "unsupported_parameter"
TOO_LONG = "context_length_exceeded"
TOO_LARGE = "request_too_large"
NO_MODEL = "model_not_found"
NOT_FOUND = "not_found"
BUSY = "queue_full"
CRASH = "server_error"
UNAUTHORIZED = "invalid_api_key"
FORBIDDEN = "forbidden"


class Failure(Exception):
    """A request that cannot be answered: an HTTP ``status``, a ``message``
    that says what to change, the ``kind`` of failure (the constants above)
    and the request field at fault (``param``, dotted); ``headers`` go on
    the answer whatever its shape (a 503's ``Retry-After``); ``sizes``: a
    prompt past the context's ``(tokens, most that fit)``, which an API may
    say in its own words (:func:`prompt_too_long`)."""

    sizes: Optional[Tuple[int, int]] = None

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = INVALID,
        param: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = dict(headers or {})


def prompt_too_long(e: PromptTooLong, param: str) -> Failure:
    """The 400 ``context_length_exceeded`` of a prompt past the context, with its sizes."""
    failure = Failure(400, e.problem, TOO_LONG, param)
    failure.sizes = (e.tokens, e.maximum)
    return failure


def generation_failure(e: BaseException) -> Failure:
    """The failure of a job that raised on the worker: a request the engine
    refused (a :class:`RedrafterError`) is the client's, anything else ours."""
    if isinstance(e, RedrafterError):
        return Failure(400, e.problem)
    log.error("Generation failed", exc_info=e)  # the server's own failure keeps its traceback
    return Failure(500, f"Generation failed: {type(e).__name__}: {e}", CRASH)


def extra_fields(model: BaseModel, path: str = "") -> Iterator[Tuple[str, object]]:
    """``(dotted path, value)`` of every field a request sent that its models
    do not declare, nested ones included (``tools.0.input_examples``): the request
    models keep them (``extra="allow"``) so that a check can name them."""
    for name, value in (model.model_extra or {}).items():
        yield path + name, value
    for name in type(model).model_fields:
        yield from _extras_in(getattr(model, name), f"{path}{name}.")


def refuse_nested_extras(req: BaseModel, skip: Sequence[str] = ()) -> None:
    """A 400 naming the first field sent inside the request's parts (a tool,
    a block, an item) that their models do not declare. Run after the parts'
    own checks, so that a part of a type this server refuses is named as
    such; the top level's fields are each API's ``check_supported``'s.
    ``skip``: parts left out of the prompt (``tools.3``), whose fields do not matter."""
    for name, _ in extra_fields(req):
        if "." in name and not any(name.startswith(s + ".") for s in skip):
            raise unsupported(name)


def _extras_in(value, path: str) -> Iterator[Tuple[str, object]]:
    if isinstance(value, BaseModel):
        yield from extra_fields(value, path)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _extras_in(v, f"{path}{i}.")


def unsupported(field: str, why: str = "drop it from the request") -> Failure:
    """The 400 of a field this server cannot honour (named, never silently ignored)."""
    return Failure(400, f"'{field}' is not supported by mlx-redrafter serve: {why}.", UNSUPPORTED, field)


def check_model(engine: Engine, model: Optional[str], also: Sequence[str] = ()) -> None:
    """A 404 for a request naming a model this server does not serve: it
    answers to :attr:`Engine.names` (the model as served, its short name,
    ``--served-model-name``) and ``also`` (such as Ollama's ``name:latest``)."""
    if model and model not in (*engine.names, *also):
        names = " or ".join(f"'{n}'" for n in engine.names)
        raise Failure(404, f"The model '{model}' does not exist here; this server serves {names}.", NO_MODEL, "model")


def sampling(engine: Engine, **asked) -> SamplingConfig:
    """The server's sampling with what the request set (``temp``, ``top_p``,
    ``top_k``, ``min_p``; None: not set)."""
    return replace(engine.sampling, **{k: v for k, v in asked.items() if v is not None})


async def request_prompt(
    engine: Engine,
    messages: List[dict],
    tools: Optional[list] = None,
    tool_choice=None,
    content_param: str = "content",
    prompt_param: str = "messages",
    **options,
) -> Rendered:
    """A chat request's prompt through the chat template, with its tools
    (OpenAI's function shape) and the reply's grammar spec
    (:func:`~mlx_redrafter.serve.tools.prompt_with_tools`, ``options`` included), on a
    worker thread (:func:`tokenized`). Tools, a tool choice or a content
    schema that cannot be honoured are a 400 naming the field (the content's
    is ``content_param``), and so are messages the model's chat template
    refuses; a prompt longer than the context is one at ``prompt_param``."""
    try:
        return await tokenized(chat_prompt, engine, messages, tools, tool_choice, param=prompt_param, **options)
    except Failure:
        raise
    except RedrafterError as e:
        param = getattr(e, "param", "tool_choice")
        raise Failure(400, e.problem, INVALID, content_param if param == "content" else param) from None
    except Exception as e:  # e.g. a template that refuses a role or an order of roles
        raise Failure(400, f"The model's chat template refused these messages: {e}", INVALID, "messages") from None


def chat_prompt(engine: Engine, messages: List[dict], tools, tool_choice, **options) -> Rendered:
    """:meth:`Engine.chat_prompt`; a template that refuses a system message
    inside the conversation gets it folded into the user turn beside it (logged once)."""
    try:
        return engine.chat_prompt(messages, tools, tool_choice, **options)
    except RedrafterError:
        raise
    except Exception as e:
        folded = fold_system(messages)
        if folded is None:
            raise
        rendered = engine.chat_prompt(folded, tools, tool_choice, **options)
        log_once(
            engine,
            ("system messages folded",),
            f"The chat template refused a system message inside the conversation ({e}); "
            "such messages are folded into the user turn beside them.",
        )
        return rendered


def shared_head(engine: Engine, messages: List[dict], ids: List[int], tools=None, tool_choice=None) -> int:
    """How many of ``ids`` (``messages`` rendered) are the system messages'
    and the tools' alone, which every turn and request of an agent repeats,
    for the prompt cache to keep (run it through :func:`tokenized`); 0 where
    the cache needs no checkpoints (its stored replies serve every prefix)
    or there is no system message."""
    n = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if not n or not engine.checkpoints:
        return 0
    try:
        probe = chat_prompt(engine, list(messages[:n]) + [{"role": "user", "content": ""}], tools, tool_choice).ids
    except Exception:  # a template that wants more than a system message: no checkpoint, nothing else lost
        return 0
    return next((i for i, (a, b) in enumerate(zip(probe, ids)) if a != b), min(len(probe), len(ids)))


async def tokenized(call: Callable, *args, param: str = "prompt", **kwargs):
    """``call(*args, **kwargs)``, which renders a chat template or tokenizes,
    on a worker thread, so that the event loop keeps answering ``/health``
    and other clients while a long prompt is encoded; a prompt longer than
    the model's context (:class:`~mlx_redrafter.serve.engine.PromptTooLong`)
    is a 400 ``context_length_exceeded`` at ``param``."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except PromptTooLong as e:
        raise prompt_too_long(e, param) from None


async def request_grammar(engine: Engine, spec, param: str):
    """``spec`` (a JSON Schema, ``"json"``, ...) compiled for the model, or
    None without one; a bad spec is a 400 at ``param`` naming the problem."""
    if spec is None:
        return None
    try:  # off the event loop: the first compile builds the tokenizer's index (about a second)
        return await asyncio.to_thread(engine.compile_grammar, spec)
    except RedrafterError as e:
        raise Failure(400, e.problem, INVALID, param) from None


class Queued:
    """A submitted job and the events its worker emits, on the event loop."""

    def __init__(self, job: Job, events: "asyncio.Queue[Tuple[str, object]]"):
        self.job, self._events = job, events

    async def events(self, request: Request, keepalive: Optional[float] = None) -> AsyncIterator[Tuple[str, object]]:
        """``("text", Piece)`` ... then ``("done", Result)`` or ``("error",
        exception)``, and ``("wait", None)`` after each ``keepalive`` seconds
        without any (for a stream to send its API's keep-alive event); cancels
        the job when the client leaves."""
        quiet = 0.0
        while True:
            try:
                kind, value = await asyncio.wait_for(self._events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                kind = None
            if await request.is_disconnected():
                self.job.cancel()
                return
            if kind is None:
                quiet += DISCONNECT_POLL_S
                if keepalive is not None and quiet >= keepalive:
                    quiet = 0.0
                    yield "wait", None
                continue
            quiet = 0.0
            yield kind, value
            if kind in ("done", "error"):
                return

    async def result(self, request: Request) -> Optional[Result]:
        """The finished job's :class:`Result` (None: its client left); a
        :class:`Failure` when the generation failed."""
        try:
            async for kind, value in self.events(request):
                if kind == "error":
                    raise generation_failure(value)
                if kind == "done":
                    return None if value.cancelled else value
        finally:
            self.job.cancel()  # a no-op once it is done; stops it when this handler is cancelled
        return None

    def stream(self, body: AsyncIterator[str], media_type: str = "text/event-stream") -> StreamingResponse:
        """``body`` streamed; the job stops however the stream ends."""
        return CancellingStream(self.job, body, media_type=media_type)


def submit(engine: Engine, ids: List[int], params: GenParams, param: str = "messages", head: int = 0) -> Queued:
    """Queue a job for ``ids`` (a 400 at ``param`` when the prompt is empty or
    does not fit the context, a 503 when the queue is full); ``head``: its
    first tokens every request of its kind repeats (:func:`shared_head`)."""
    if not ids:
        raise Failure(400, "The prompt is empty.", INVALID, param)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind, value):  # called on the worker thread
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    try:
        job = engine.job(ids, params, emit, head)
    except PromptTooLong as e:
        raise prompt_too_long(e, param) from None
    except RedrafterError as e:
        raise Failure(400, e.problem, TOO_LONG, param) from None
    try:
        engine.submit(job)
    except QueueFull as e:  # Retry-After: the engine's estimate from the measured time per request
        raise Failure(
            503,
            f"The server is busy: {e} Retry in {e.retry_after} s.",
            BUSY,
            headers={"Retry-After": str(e.retry_after)},
        ) from None
    return Queued(job, events)


def client_left() -> JSONResponse:
    """The answer nobody reads: the client went away before its reply was done."""
    return JSONResponse(status_code=499, content=None)


class CancellingStream(StreamingResponse):
    """A streamed reply that stops its job however the stream ends."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def reply_events(parser: Optional[ToolCallStream], text: str, last: bool = False) -> List[Event]:
    """The content strings and calls of a reply's next ``text`` (``last``: the
    reply ended after it: what the parser held back comes out too); with no
    parser (no tools) the text itself. Empty strings are dropped."""
    if parser is None:
        return [text] if text else []
    return [e for e in parser.feed(text) + (parser.finish() if last else []) if e != ""]
