"""How large a request ``serve`` reads: a bound on the body, checked before
anything parses it.

A request's body is read into memory, parsed as JSON, rendered through the
chat template and tokenized. Unbounded, one 40 MB chat request took a minute
of tokenizing and left the server 5.6 GB larger; so every request's body is
bounded (:class:`BodyLimit`), on every route, the chat page's included:

* a ``Content-Length`` over the bound is refused at once, the body unread;
* a body without one (``Transfer-Encoding: chunked``) is counted as it
  streams in and refused as soon as it passes the bound, the rest unread.

The refusal is a 413 in the error shape of the API the path belongs to,
naming the bound and ``--max-body-bytes``, with ``Connection: close`` (the
server does not read the rest, so the connection cannot carry another
request). The bound sits behind the Host, Origin and key checks
(:mod:`~mlx_redrafter.serve.security`): a request without the key is refused
before its body is read.

By default the bound follows the model's context: :data:`BYTES_PER_TOKEN`
bytes per token of it (:func:`default_body_bytes`), about 15 times what a
JSON body takes per token (measured with the default model's tokenizer: 4.3
bytes on MT-Bench's prompts, 3.7 on Python source, 3.5 on Chinese escaped as
``\\uXXXX``). The early refusal of a prompt the context provably cannot
hold, and tokenizing off the event loop, are the next guards
(:mod:`~mlx_redrafter.serve.streaming`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
from typing import Callable, Optional

from starlette.datastructures import Headers
from starlette.responses import Response

from .streaming import TOO_LARGE, Failure

# The default bound: this many bytes of body per token of the model's context...
BYTES_PER_TOKEN = 64
# ...and never less than this (a short context still takes a system prompt and tools in JSON);
FLOOR_BYTES = 10**6
# a model whose context is unknown gets the bound of a 128k-token one.
UNKNOWN_CONTEXT = 131072
# After a body this large, the C heap's free pages go back to the system (give_back_memory).
TRIM_BYTES = 1 << 16

Refuse = Callable[[str, Failure], Response]


def default_body_bytes(context: Optional[int]) -> int:
    """The body bound for a model with a ``context`` of that many tokens (None or 0: unknown)."""
    return max(FLOOR_BYTES, BYTES_PER_TOKEN * (context or UNKNOWN_CONTEXT))


class BodyLimit:
    """ASGI middleware: a request's body is read here, at most ``max_bytes``
    of it, and handed on whole; past the bound the request is answered 413
    (by ``refuse(path, failure)``, in the path's API's shape) and the rest of
    the body is never read. ``app.add_middleware(BodyLimit, max_bytes=...,
    refuse=...)``, inside the security guards. ``trim`` runs after a body
    of TRIM_BYTES or more has been answered (give_back_memory)."""

    def __init__(self, app, max_bytes: int, refuse: Refuse, trim: Callable[[], None] | None = None):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse
        self.trim = trim or give_back_memory

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _has_body(scope):
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send, f"has {int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:  # stop reading here: the rest never comes into memory
                return await self._too_large(scope, receive, send, f"passed {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            await self.app(scope, _replay(b"".join(chunks), receive), send)
        finally:
            if size >= TRIM_BYTES:  # its parse, template and tokens were megabytes of garbage
                del chunks
                await asyncio.to_thread(self.trim)

    async def _too_large(self, scope, receive, send, what: str) -> None:
        message = (
            f"The request body {what}; this server reads at most {self.max_bytes} bytes (--max-body-bytes). "
            "Send a shorter request, or start the server with a larger --max-body-bytes."
        )
        response = self.refuse(scope["path"], Failure(413, message, TOO_LARGE))
        response.headers["Connection"] = "close"  # the rest of the body stays unread
        await response(scope, receive, send)


def give_back_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's
    ``malloc_trim``, about a millisecond): a large request's body, its JSON,
    its rendered prompt and the tokenizer's work are freed into malloc's
    arenas, which glibc keeps otherwise (tens of MB after a 1 MB prompt). Not
    needed where malloc returns them itself (macOS); MLX's buffer cache is
    not the C heap's and is left alone."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def _has_body(scope) -> bool:
    """Whether the request says a body follows (a length over 0, or chunks)."""
    headers = Headers(scope=scope)
    return headers.get("content-length", "0") != "0" or "chunked" in headers.get("transfer-encoding", "").lower()


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` whole once, then what ``receive``
    gives (a disconnect, which streamed replies listen for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
