"""The response objects of Anthropic's Messages API for one request: a whole
``message``, or its server-sent events.

A reply's text goes through the rendered tools' parser (when tools were
rendered): content becomes ``text`` blocks and each call a ``tool_use``
block. Streamed, the events are Anthropic's: ``message_start`` (usage so far:
the prompt), ``ping``, for each block ``content_block_start``, its deltas
(``text_delta``; a call's whole input as one ``input_json_delta``, sent once
the call is parsed) and ``content_block_stop``, then ``message_delta`` (the
``stop_reason``, the final usage) and ``message_stop``; a failure is an
``error`` event. While nothing comes (a long prefill) a ``ping`` goes out
every :data:`~.streaming.KEEPALIVE_S` seconds, as Anthropic's API sends
them. ``usage.cache_read_input_tokens`` counts the prompt tokens whose KV
came from the prompt cache, and ``input_tokens`` the rest, as Anthropic
counts them. Both forms carry ``redrafter``, the drafting stats
the other routes carry.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Literal, Optional, Tuple, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .engine import Engine, Result
from .streaming import generation_failure, reply_events
from .tool_calls import ToolCall
from .tools import Rendered

# --------------------------------------------------------------------------- response models (the docs)


class TextOut(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Dict[str, Any]


class UsageOut(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageOut(BaseModel):
    """A whole reply (``stream`` false)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: List[Union[TextOut, ToolUseOut]]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: UsageOut
    redrafter: Optional[Dict[str, Any]] = None


class CountOut(BaseModel):
    input_tokens: int


# --------------------------------------------------------------------------- the reply


def stop_reason(res: Result, calls: List[ToolCall]) -> str:
    """Anthropic's stop_reason of a finished reply."""
    if res.finish_reason == "length":
        return "max_tokens"
    if res.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": call.arguments_object(),
    }


class MessageReply:
    """Builds the response objects of one request. ``error(failure) -> dict``: Anthropic's error object."""

    def __init__(self, engine: Engine, rendered: Rendered, error: Callable):
        self.engine, self.prompt_tokens, self.error = engine, len(rendered.ids), error
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.tools = rendered.stream() if rendered.tools is not None else None

    def _events(self, text: str, last: bool = False) -> List[Union[str, ToolCall]]:
        """Content strings and calls of the next text (``last``: the reply ended after it)."""
        return reply_events(self.tools, text, last)

    def _calls(self) -> List[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def usage(self, res: Optional[Result]) -> dict:
        reused = res.reused_tokens if res is not None else 0
        prompt = res.prompt_tokens if res is not None else self.prompt_tokens
        return {
            "input_tokens": prompt - reused,
            "output_tokens": res.completion_tokens if res is not None else 0,
            "cache_read_input_tokens": reused,
            "cache_creation_input_tokens": 0,
        }

    def _message(self, content: list, res: Optional[Result]) -> dict:
        done = res is not None
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.engine.model_id,
            "content": content,
            "stop_reason": stop_reason(res, self._calls()) if done else None,
            "stop_sequence": res.stop_sequence if done else None,
            "usage": self.usage(res),
        }

    def whole(self, res: Result) -> JSONResponse:
        content: List[dict] = []
        for e in self._events(res.text, last=True):
            if isinstance(e, ToolCall):
                content.append(tool_use(e))
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += e
            else:
                content.append({"type": "text", "text": e})
        return JSONResponse(
            {**self._message(content or [{"type": "text", "text": ""}], res), "redrafter": self.engine.stats(res)}
        )

    async def sse(self, events: AsyncIterator[Tuple[str, object]]) -> AsyncIterator[str]:
        """The reply's server-sent events (see the module)."""
        yield _event("message_start", {"message": self._message([], None)})
        yield _event("ping", {})
        blocks = _Blocks()
        async for kind, value in events:
            if kind == "wait":  # a long prefill: Anthropic's keep-alive, which clients read and skip
                yield _event("ping", {})
            elif kind == "text":
                for e in self._events(value.text):
                    for out in blocks.add(e):
                        yield out
            elif kind == "error":
                yield _event("error", self.error(generation_failure(value)))
                return
            elif not value.cancelled:
                for e in self._events("", last=True):
                    for out in blocks.add(e):
                        yield out
                for out in blocks.close(empty_text=True):
                    yield out
                delta = {"stop_reason": stop_reason(value, self._calls()), "stop_sequence": value.stop_sequence}
                yield _event(
                    "message_delta", {"delta": delta, "usage": self.usage(value), "redrafter": self.engine.stats(value)}
                )
                yield _event("message_stop", {})


class _Blocks:
    """The content blocks of a streamed reply: a text block stays open while text comes."""

    def __init__(self):
        self.count = 0
        self.open_text = False

    def add(self, event: Union[str, ToolCall]) -> List[str]:
        if isinstance(event, str):
            out = [] if self.open_text else self._start({"type": "text", "text": ""})
            self.open_text = True
            return out + [
                _event("content_block_delta", {"index": self.count - 1, "delta": {"type": "text_delta", "text": event}})
            ]
        block = {**tool_use(event), "input": {}}
        delta = {"type": "input_json_delta", "partial_json": event.arguments}
        return (
            self.close()
            + self._start(block)
            + [_event("content_block_delta", {"index": self.count - 1, "delta": delta}), self._stop()]
        )

    def close(self, empty_text: bool = False) -> List[str]:
        """Close the open text block (``empty_text``: send an empty one if the reply had no block)."""
        if empty_text and self.count == 0:
            return self._start({"type": "text", "text": ""}) + [self._stop()]
        if not self.open_text:
            return []
        self.open_text = False
        return [self._stop()]

    def _start(self, block: dict) -> List[str]:
        self.count += 1
        return [_event("content_block_start", {"index": self.count - 1, "content_block": block})]

    def _stop(self) -> str:
        return _event("content_block_stop", {"index": self.count - 1})


def _event(kind: str, data: dict) -> str:
    """One server-sent event, named as Anthropic names them (the SDK reads the name)."""
    body = data if kind == "error" else {"type": kind, **data}
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
