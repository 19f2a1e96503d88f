"""Tool-call parsing through the real ``/v1/chat/completions`` route, with the
official ``openai`` client, on scripted model output.

:class:`ScriptedEngine` is a TEST DOUBLE FOR PARSING ONLY: it replays a
scripted reply, in given text chunks, through the real queue, route,
:class:`~mlx_redrafter.serve.openai_reply.Reply` and tool parsers, so that
formats the default model never writes (Hermes, Qwen3-Coder, Mistral) are
checked exactly. Exactness of generation is tested on the real model
(tests/test_server.py, tests/test_server_tools.py).
"""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from mlx_redrafter.config import SamplingConfig
from mlx_redrafter.llm.prompt_cache import PromptCache
from mlx_redrafter.serve.app import create_app
from mlx_redrafter.serve.engine import Engine, JobQueue, Piece, Result
from mlx_redrafter.serve.tools import GENERIC_FORMAT, Rendered, check_tool_choice, parser_format

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# (format, content before, the call as the model writes it, content after); Mistral's call has no end marker.
FAMILIES = {
    "generic": (
        GENERIC_FORMAT,
        "Let me check. ",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        " Done.",
    ),
    "json_tools": (
        parser_format("json_tools"),
        "Checking.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "\nok",
    ),
    "qwen3_coder": (
        parser_format("qwen3_coder"),
        "Sure: ",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        " bye",
    ),
    "mistral": (parser_format("mistral"), "One moment.", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ""),
}
MARKERS = ("<tool_call>", "</tool_call>", "<function=", "[TOOL_CALLS]", "[ARGS]")


class ScriptedEngine(Engine):
    """Replays ``chunks`` as the model's reply (a test double for parsing)."""

    def __init__(self, fmt, chunks):
        self.model_id, self.max_tokens, self.sampling = "default", 64, SamplingConfig()
        self.names = [self.model_id]
        self.fmt, self.chunks = fmt, chunks
        self.cache = PromptCache(None)
        self.queue = JobQueue(self._run, 4)
        self.listeners = []

    def chat_prompt(self, messages, tools=None, tool_choice=None, **options):  # no grammar: the reply is scripted
        choice = check_tool_choice(tools, tool_choice)
        prefill = "" if choice in ("auto", "none") else self.fmt.prefill(None if choice == "required" else choice)
        return Rendered([1, 2, 3], "", prefill, self.fmt, list(tools) if tools and choice != "none" else None)

    def fit(self, ids, max_tokens):
        return max_tokens

    def card(self):
        return {"context_length": None, "tools": True, "tool_format": self.fmt.name}

    def stats(self, res):
        return {}

    def _run(self, job):
        res = Result(prompt_tokens=len(job.ids), finish_reason="stop")
        for chunk in self.chunks:
            res.text += chunk
            job.emit("text", Piece(chunk, ["llm"]))
        for listener in self.listeners:
            listener(res)
        job.emit("done", res)
        return res


def _client(fmt, text, size=3):
    chunks = [text[i : i + size] for i in range(0, len(text), size)]  # markers split across chunks
    http = TestClient(create_app(ScriptedEngine(fmt, chunks)), base_url="http://127.0.0.1")
    http.__enter__()  # runs the lifespan: the engine's worker
    return http, OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture
def served():
    opened = []

    def open_(fmt, text, size=3):
        http, client = _client(fmt, text, size)
        opened.append(http)
        return client

    yield open_
    for http in opened:
        http.__exit__(None, None, None)


def _streamed(client, **kw):
    chunks = list(client.chat.completions.create(model="default", messages=ASK, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    return chunks, content, calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("size", [1, 3, 7])
def test_scripted_call_whole_and_streamed(served, family, size):
    fmt, before, call, after = FAMILIES[family]
    client = served(fmt, before + call + after, size)
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == before + after
    [c] = msg.tool_calls
    assert (c.type, c.function.name, json.loads(c.function.arguments)) == ("function", "get_weather", {"city": "Paris"})

    chunks, content, calls = _streamed(client, tools=[WEATHER])
    assert content == before + after and not any(m in content for m in MARKERS)
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The content before the call streamed before it.
    at = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:at]) == before


def test_two_calls_get_two_indices(served):
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    client = served(GENERIC_FORMAT, one + "\n" + one.replace("Paris", "Rome"))
    _, content, calls = _streamed(client, tools=[WEATHER])
    assert [(t.index, json.loads(t.function.arguments)["city"]) for t in calls] == [(0, "Paris"), (1, "Rome")]
    assert content == "\n"


def test_malformed_arguments_come_back_as_content(served, caplog):
    text = 'Hm <tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    client = served(GENERIC_FORMAT, text)
    with caplog.at_level(logging.WARNING, logger="mlx_redrafter.serve.tools"):
        r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER])
        _, content, calls = _streamed(client, tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == 'Hm {"name": "get_weather", "arguments": {"city": Paris}}'
    assert content == r.choices[0].message.content and not calls
    assert sum("Could not parse" in rec.message for rec in caplog.records) == 2


def test_forced_call_continues_the_prefill(served):
    # The prefill wrote the call's opening through the name: the model writes the arguments.
    client = served(GENERIC_FORMAT, '{"city": "Paris"}}</tool_call>')
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [c] = r.choices[0].message.tool_calls
    assert c.function.name == "get_weather" and json.loads(c.function.arguments) == {"city": "Paris"}
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"


def test_without_tools_the_reply_is_not_parsed(served):
    text = 'As text: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    client = served(GENERIC_FORMAT, text)
    r = client.chat.completions.create(model="default", messages=ASK)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    _, content, calls = _streamed(client, tools=[WEATHER], tool_choice="none")
    assert content == text and not calls
