"""Tool calls out of a reply, for ``serve``: parsed by mlx-lm's tool parsers
(:attr:`~mlx_redrafter.serve.tools.ToolFormat.parser`), and shaped as each
API's replies carry them (OpenAI's ``tool_calls`` and stream deltas, Ollama's
message). The tools go into the prompt in :mod:`~mlx_redrafter.serve.tools`.

:class:`ToolCallStream` splits streamed text into content and calls with
mlx-lm's ``TextStateMachine``: text that may be the start of a marker is held
back, so markers never reach the content. A call the parser cannot read
(e.g. arguments that are not JSON, possible only unconstrained) comes back
as content, without its markers, and a warning is logged.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from mlx_lm.generate import TextStateMachine

log = logging.getLogger(__name__)


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object as a string (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    index: int = 0  # its place among the reply's calls

    def arguments_object(self) -> dict:
        return json.loads(self.arguments)


def _calls(parsed) -> List[ToolCall]:
    """ToolCalls of a parser's result; ValueError when it is not a call."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for p in items:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not p["name"]:
            raise ValueError(f"not a tool call: {p!r}")
        args = p.get("arguments", p.get("parameters", {}))  # Llama-style JSON says "parameters"
        if isinstance(args, str):
            args = json.loads(args)  # some models write the arguments as a JSON string
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of {p['name']!r} are not a JSON object: {args!r}")
        extra = {"id": p["id"]} if isinstance(p.get("id"), str) else {}  # Mistral's templates check its ids
        calls.append(ToolCall(p["name"], json.dumps(args, ensure_ascii=False), **extra))
    if not calls:
        raise ValueError("no tool call")
    return calls


Event = Union[str, ToolCall]


class ToolCallStream:
    """Splits a reply's text deltas into content and tool calls.

    :meth:`feed` and :meth:`finish` return events in order: ``str`` content
    deltas and completed :class:`ToolCall` s. A call is emitted once its end
    marker is seen (for formats without one, such as Mistral's, at
    :meth:`finish`). ``fmt``: the call's :class:`~mlx_redrafter.serve.tools.ToolFormat`.
    """

    def __init__(self, fmt, tools: Optional[list] = None, prefill: str = ""):
        self.format, self.tools = fmt, tools
        edges = {"normal": [(fmt.start, "tool")], "tool": [(fmt.end, "normal")] if fmt.end else []}
        self._sm = TextStateMachine(edges)
        self._state = self._sm.make_state("normal")
        self._body = ""  # the text of the call being read
        self.calls: List[ToolCall] = []
        if self.feed(prefill):
            raise ValueError(f"A prefill must open a call, but {prefill!r} holds content.")

    def feed(self, text: str) -> List[Event]:
        """Events for the next ``text`` of the reply."""
        prev = self._state[0]
        self._state, segments = TextStateMachine.split(self._state, text)
        events: List[Event] = []
        for state, chunk in segments:
            if state == "normal" and prev == "tool":  # the end marker closed a call
                events += self._close()
            if state == "tool":
                self._body += chunk
            elif chunk:
                events.append(chunk)
            prev = state
        return _merged(events)

    def finish(self) -> List[Event]:
        """Events for the end of the reply: held-back text that turned out
        not to be a marker, and a call the reply ended in."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        if state == "tool":
            self._body += rest
            return self._close() if self._body.strip() else []
        return [rest] if rest else []

    def _close(self) -> List[Event]:
        body, self._body = self._body, ""
        try:
            calls = _calls(self.format.parser(body, self.tools))
        except Exception as e:  # mlx-lm's parsers raise ValueError, JSONDecodeError, IndexError, ...
            log.warning(
                "Could not parse a %s tool call (%s: %s); returning it as content: %r",
                self.format.name,
                type(e).__name__,
                e,
                body,
            )
            return [body] if body else []
        for c in calls:
            c.index = len(self.calls)
            self.calls.append(c)
        return calls


def _merged(events: List[Event]) -> List[Event]:
    out: List[Event] = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out


def parse(text: str, fmt, tools: Optional[list] = None, prefill: str = ""):
    """``(content, calls)`` of a whole reply (``prefill``: the forced opening it continues)."""
    stream = ToolCallStream(fmt, tools, prefill)
    events = stream.feed(text) + stream.finish()
    return "".join(e for e in events if isinstance(e, str)), stream.calls


# --------------------------------------------------------------------------- response shapes


def finish_reason(reason: Optional[str], calls: Sequence[ToolCall]) -> Optional[str]:
    """OpenAI's finish_reason: ``"tool_calls"`` for a reply that stopped after calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def openai_tool_call(call: ToolCall, streaming: bool = False) -> dict:
    """One entry of OpenAI's ``tool_calls`` (with ``index`` when streaming)."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **out} if streaming else out


def openai_message(content: str, calls: Sequence[ToolCall]) -> dict:
    """OpenAI's assistant ``message``: content is null when the reply is only
    calls (and the whitespace between them)."""
    msg = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if calls:
        msg["tool_calls"] = [openai_tool_call(c) for c in calls]
    return msg


def openai_delta(event: Event) -> dict:
    """The ``delta`` of a streamed chunk for one event."""
    if isinstance(event, ToolCall):
        return {"tool_calls": [openai_tool_call(event, streaming=True)]}
    return {"content": event}


def ollama_tool_call(call: ToolCall) -> dict:
    """One entry of Ollama's ``message.tool_calls`` (arguments as an object)."""
    return {"function": {"name": call.name, "arguments": call.arguments_object()}}


def ollama_message(content: str, calls: Sequence[ToolCall]) -> dict:
    """Ollama's assistant ``message``."""
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [ollama_tool_call(c) for c in calls]
    return msg
