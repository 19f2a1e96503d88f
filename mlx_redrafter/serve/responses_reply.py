"""The response objects of OpenAI's Responses API for one request: a whole
``response``, or its server-sent events.

A reply's text goes through the rendered tools' parser (when tools were
rendered): content becomes a ``message`` output item (one ``output_text``
part) and each call a ``function_call`` item. Streamed, the events are the
API's, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, then for a message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for a call ``response.output_item.added``,
one ``response.function_call_arguments.delta`` (the whole arguments, sent
once the call is parsed), ``response.function_call_arguments.done``,
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut the reply, as the API
does). A failure is an ``error`` event and ``response.failed``. While
nothing comes (a long prefill) ``response.in_progress`` is sent again every
:data:`~.streaming.KEEPALIVE_S` seconds: the API has no ping, and Codex
drops a stream that stays silent for minutes. The
response carries ``redrafter``, the drafting stats the other routes carry.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Tuple, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .engine import Engine, Result
from .streaming import generation_failure, reply_events
from .tool_calls import ToolCall
from .tools import Rendered

# --------------------------------------------------------------------------- response models (the docs)


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: List[Any]


class MessageItem(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: str
    content: List[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: str
    namespace: Optional[str] = None


class TokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int  # required by OpenAI's published Response type


class OutputDetails(BaseModel):
    reasoning_tokens: int


class UsageOut(BaseModel):
    input_tokens: int
    input_tokens_details: TokensDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class ResponseOut(BaseModel):
    """A whole response (``stream`` false)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: List[Union[MessageItem, FunctionCallItem]]
    usage: Optional[UsageOut]
    error: Optional[Dict[str, Any]]
    incomplete_details: Optional[Dict[str, Any]]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: List[Dict[str, Any]]
    redrafter: Optional[Dict[str, Any]] = None


# --------------------------------------------------------------------------- the reply


def usage(res: Result) -> dict:
    return {
        "input_tokens": res.prompt_tokens,
        # No cache write a client asked for (as Anthropic's cache_creation_input_tokens: 0).
        "input_tokens_details": {"cached_tokens": res.reused_tokens, "cache_write_tokens": 0},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


class ResponsesReply:
    """Builds the response objects of one request; ``echo`` holds the
    request's fields a response repeats (instructions, tools, tool_choice,
    text, temperature, ...); ``namespaces``: the namespace of each namespaced
    function, which its calls carry."""

    def __init__(self, engine: Engine, rendered: Rendered, echo: dict, namespaces: Optional[Dict[str, str]] = None):
        self.engine, self.echo = engine, echo
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tools = rendered.stream() if rendered.tools is not None else None
        self.items = _Items(namespaces or {})

    def _events(self, text: str, last: bool = False) -> List[Union[str, ToolCall]]:
        return reply_events(self.tools, text, last)

    def response(self, status: str, res: Optional[Result] = None, error: Optional[dict] = None) -> dict:
        """The response object in ``status`` (with ``res``: its output, usage and stats)."""
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.engine.model_id,
            "output": self.items.output,
            "usage": None,
            "error": error,
            "incomplete_details": None,
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            **self.echo,
        }
        if res is not None:
            out.update(usage=usage(res), redrafter=self.engine.stats(res))
            if res.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def _finished(self, res: Result) -> Tuple[List[Tuple[str, dict]], str, dict]:
        """The events that close every item, then the final event's type and response."""
        events = [out for e in self._events("", last=True) for out in self.items.add(e)]
        events += self.items.close(empty_text=True)
        status = "incomplete" if res.finish_reason == "length" else "completed"
        return events, f"response.{status}", self.response(status, res)

    def whole(self, res: Result) -> JSONResponse:
        for e in self._events(res.text):
            self.items.add(e)
        return JSONResponse(self._finished(res)[2])

    async def sse(self, events: AsyncIterator[Tuple[str, object]]) -> AsyncIterator[str]:
        """The response's server-sent events (see the module)."""
        seq = _Sequence()
        yield seq.event("response.created", {"response": self.response("in_progress")})
        yield seq.event("response.in_progress", {"response": self.response("in_progress")})
        async for kind, value in events:
            if kind == "wait":  # a long prefill: the API has no ping; the response is in progress, again
                yield seq.event("response.in_progress", {"response": self.response("in_progress")})
            elif kind == "text":
                for e in self._events(value.text):
                    for name, data in self.items.add(e):
                        yield seq.event(name, data)
            elif kind == "error":
                failure = generation_failure(value)
                yield seq.event("error", {"code": failure.kind, "message": failure.message, "param": None})
                error = {"code": "server_error", "message": failure.message}
                yield seq.event("response.failed", {"response": self.response("failed", error=error)})
                return
            elif not value.cancelled:
                closing, name, final = self._finished(value)
                for event in closing:
                    yield seq.event(*event)
                yield seq.event(name, {"response": final})


class _Sequence:
    """Numbers a stream's events (``sequence_number``, from 0)."""

    def __init__(self):
        self.n = 0

    def event(self, kind: str, data: dict) -> str:
        body = {"type": kind, **data, "sequence_number": self.n}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Items:
    """The output items of a reply and the events that build them; a message
    item stays open while text comes."""

    def __init__(self, namespaces: Dict[str, str]):
        self.output: List[dict] = []
        self.text: Optional[dict] = None  # the open message item
        self.namespaces = namespaces

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def add(self, event: Union[str, ToolCall]) -> List[Tuple[str, dict]]:
        if isinstance(event, str):
            out = [] if self.text is not None else self._open_text()
            self.text["content"][0]["text"] += event
            return out + [
                ("response.output_text.delta", {**self._where(), "content_index": 0, "delta": event, "logprobs": []})
            ]
        out = self.close()
        item = {
            "id": "fc_" + uuid.uuid4().hex[:24],
            "type": "function_call",
            "call_id": event.id,
            "name": event.name,
            "arguments": "",
            "status": "in_progress",
        }
        if event.name in self.namespaces:
            item["namespace"] = self.namespaces[event.name]
        self.output.append(item)
        out.append(("response.output_item.added", {"output_index": len(self.output) - 1, "item": dict(item)}))
        item.update(arguments=event.arguments, status="completed")
        out += [
            ("response.function_call_arguments.delta", {**self._where(), "delta": event.arguments}),
            (
                "response.function_call_arguments.done",
                {**self._where(), "arguments": event.arguments, "name": event.name},
            ),
            ("response.output_item.done", {"output_index": len(self.output) - 1, "item": item}),
        ]
        return out

    def _open_text(self) -> List[Tuple[str, dict]]:
        self.text = {
            "id": "msg_" + uuid.uuid4().hex[:24],
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": []}],
        }
        self.output.append(self.text)
        added = {**self.text, "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            ("response.output_item.added", {"output_index": len(self.output) - 1, "item": added}),
            ("response.content_part.added", {**self._where(), "content_index": 0, "part": part}),
        ]

    def close(self, empty_text: bool = False) -> List[Tuple[str, dict]]:
        """Close the open message item (``empty_text``: open an empty one first if the reply has no item)."""
        out = self._open_text() if empty_text and not self.output else []
        if self.text is not None:
            self.text["status"] = "completed"
            part = self.text["content"][0]
            where = {"item_id": self.text["id"], "output_index": self.output.index(self.text)}
            out += [
                ("response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {**where, "content_index": 0, "part": dict(part)}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": self.text}),
            ]
            self.text = None
        return out
