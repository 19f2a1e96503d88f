"""The response objects of OpenAI's API for one request: a whole
``chat.completion`` / ``text_completion``, or its server-sent events.

With tools rendered (``Rendered.tools is not None``) the reply's text goes
through a :class:`~mlx_redrafter.serve.tool_calls.ToolCallStream`: content
streams as ``content`` deltas, each call arrives as a ``tool_calls`` delta
(with its ``index``) once its end marker is seen, and a reply that stopped
after calls finishes with ``"tool_calls"``. Without tools the text is sent
as generated, exactly what ``generate`` prints. Each streamed chunk with text
also carries ``x_redrafter``: the sources of its tokens (drafter, lookup or
the LLM itself) and the reply's counts so far, which the chat page shows and
standard clients ignore.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Callable, List, Optional, Tuple

from .engine import Engine, Job, Piece, Result
from .streaming import reply_events
from .tool_calls import ToolCallStream, finish_reason, openai_delta, openai_message
from .tools import Rendered


class Reply:
    """Builds the response objects of one request (chat or completion).
    ``error(exception) -> dict``: the error object of a failed generation."""

    def __init__(
        self,
        engine: Engine,
        job: Job,
        chat: bool,
        include_usage: bool,
        rendered: Optional[Rendered],
        error: Callable[[BaseException], dict],
    ):
        self.engine, self.job, self.chat, self.error = engine, job, chat, error
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.include_usage = include_usage
        self._held_sources: List[str] = []  # of text no chunk has carried yet
        self.tools: Optional[ToolCallStream] = rendered.stream() if rendered and rendered.tools is not None else None

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.engine.model_id}

    def usage(self, res: Result) -> dict:
        return {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.reused_tokens},
        }

    def whole(self, res: Result) -> dict:
        if self.chat:
            message, reason = {"role": "assistant", "content": res.text}, res.finish_reason
            if self.tools is not None:
                content = "".join(e for e in reply_events(self.tools, res.text, last=True) if isinstance(e, str))
                message = openai_message(content, self.tools.calls)
                reason = finish_reason(res.finish_reason, self.tools.calls)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
        return {**self._head(False), "choices": [choice], "usage": self.usage(res), "redrafter": self.engine.stats(res)}

    def _chunk(self, delta: Optional[dict] = None, finish: Optional[str] = None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None, "finish_reason": finish}
        out = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries it
        return out

    def _deltas(self, text: str, last: bool = False) -> List[dict]:
        """The deltas of the next text (``last``: the reply ended after it)."""
        return [openai_delta(e) for e in reply_events(self.tools, text, last)]

    def _text_chunks(self, piece: Piece) -> List[dict]:
        """The chunks of a piece of text; the first carries ``x_redrafter``
        (each token's source, :class:`~mlx_redrafter.serve.engine.Piece`),
        with the sources of text a tool-call parser held back before it."""
        ext = piece.extension()
        ext["sources"] = self._held_sources + ext["sources"]
        chunks = [self._chunk(delta) for delta in self._deltas(piece.text)]
        self._held_sources = [] if chunks else ext["sources"]
        if chunks:
            chunks[0]["x_redrafter"] = ext
        return chunks

    async def sse(self, events: AsyncIterator[Tuple[str, object]]) -> AsyncIterator[str]:
        """Server-sent events: chunks, the usage chunk when asked, ``[DONE]``."""
        if self.chat:
            yield _data(self._chunk({"role": "assistant", "content": ""}))
        async for kind, value in events:
            if kind == "text":
                for chunk in self._text_chunks(value):
                    yield _data(chunk)
            elif kind == "error":
                yield _data(self.error(value))
                return
            elif not value.cancelled:
                for delta in self._deltas("", last=True):  # what the parser held back
                    yield _data(self._chunk(delta))
                reason = value.finish_reason
                if self.tools is not None:
                    reason = finish_reason(reason, self.tools.calls)
                yield _data({**self._chunk(finish=reason), "redrafter": self.engine.stats(value)})
                if self.include_usage:
                    yield _data({**self._head(True), "choices": [], "usage": self.usage(value)})
                yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
