"""Ollama's native API on ``mlx-redrafter serve``: one server (the default
model and its shipped drafter) in a subprocess on 127.0.0.1 and a free port,
driven with the official ``ollama`` client (and raw HTTP where the client
has no call, e.g. ``/api/version``)."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import ollama
import pytest
from ui_servers import GenerateCommand, Server

MAX_TOKENS = 8
PROMPT = "Write a short poem about the sea."
GREEDY = {"temperature": 0}
# The reference command runs in-process (ui_servers.GenerateCommand): the session's default model, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(city: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}],
    }


# Two earlier calls in the history: the default model (no tool template,
# the generic format) then answers the third question with a call too.
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    _call("Paris"),
    {"role": "user", "content": "Weather in Rome?"},
    _call("Rome"),
    {"role": "user", "content": "Weather in London?"},
]


@pytest.fixture(scope="module")
def generate_cli():
    """``mlx-redrafter generate --temp 0 --no-draft`` (plain decoding) on PROMPT."""
    return GenerateCommand(PROMPT, MAX_TOKENS, "--no-draft")


@pytest.fixture(scope="module")
def server(tmp_path_factory, generate_cli):
    s = Server(["--max-tokens", str(MAX_TOKENS), "--no-ui"], tmp_path_factory.mktemp("ollama") / "serve.log")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def cli_reply(generate_cli) -> str:
    stdout, stderr = generate_cli.communicate(timeout=600)
    assert generate_cli.returncode == 0, stderr
    return stdout[:-1]  # the command line ends the reply with a newline


def _user(text: str):
    return [{"role": "user", "content": text}]


def test_model_routes(server, client):
    assert httpx.get(server.url + "/api/version", timeout=10).json()["version"]
    (tag,) = client.list().models
    assert tag.model == "default:latest" and tag.size > 0 and tag.details.family == "llama"
    assert tag.details.parameter_size.endswith("M")
    show = client.show("default")
    assert "tools" in show.capabilities and "completion" in show.capabilities
    assert show.modelinfo["llama.context_length"] == 8192  # SmolLM2's max_position_embeddings
    assert show.modelinfo["redrafter.tool_format"] == "generic"
    assert client.show("default:latest").details == show.details
    (running,) = client.ps().models
    assert running.model == tag.model and running.context_length == 8192
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404 and "no-such-model" in e.value.error


def test_greedy_chat_and_generate_equal_the_command_line(server, client, cli_reply):
    """The server drafts (its drafts accepted) and equals plain decoding on the command line."""
    raw = httpx.post(
        server.url + "/api/chat",
        json={"model": "default", "messages": _user(PROMPT), "options": GREEDY, "stream": False},
        timeout=300,
    ).json()
    assert raw["message"]["content"] == cli_reply and raw["redrafter"]["from_drafts"] > 0
    whole = client.chat("default", messages=_user(PROMPT), options=GREEDY)
    assert whole.message.content == cli_reply and whole.message.role == "assistant"
    assert whole.done and whole.done_reason == "length" and whole.eval_count == MAX_TOKENS
    assert whole.prompt_eval_count > 0 and whole.eval_duration > 0 and whole.load_duration == 0
    assert whole.total_duration >= whole.eval_duration
    parts = list(client.chat("default", messages=_user(PROMPT), options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == cli_reply
    assert parts[-1].eval_count == MAX_TOKENS and parts[-1].prompt_eval_count == whole.prompt_eval_count

    gen = client.generate("default", prompt=PROMPT, options=GREEDY)
    assert gen.response == cli_reply and gen.eval_count == MAX_TOKENS
    streamed = list(client.generate("default", prompt=PROMPT, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == cli_reply and streamed[-1].done


def test_options(client, cli_reply):
    short = client.chat("default", messages=_user(PROMPT), options={**GREEDY, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length" and cli_reply.startswith(short.message.content)
    word = cli_reply.split()[2]
    stopped = client.generate("default", prompt=PROMPT, options={**GREEDY, "stop": [word]})
    assert stopped.response == cli_reply[: cli_reply.index(word)] and stopped.done_reason == "stop"
    # top_k=1 keeps only the most likely token: greedy whatever the temperature.
    top1 = client.chat("default", messages=_user(PROMPT), options={"temperature": 1.0, "top_k": 1})
    assert top1.message.content == cli_reply
    seeded = [
        client.chat(
            "default", messages=_user(PROMPT), options={"temperature": 1.0, "top_p": 0.9, "seed": 7}
        ).message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    raw = client.generate("default", prompt=PROMPT, raw=True, options=GREEDY)
    assert raw.done and raw.prompt_eval_count < short.prompt_eval_count  # no chat template around it


def test_tool_call_whole_and_streamed(client):
    """The call is constrained (a grammar: the name is a tool's, the
    arguments validate against its schema) from the moment the model opens it."""
    r = client.chat("default", messages=TOOL_HISTORY, tools=[WEATHER], options={**GREEDY, "num_predict": 40})
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == [
        ("get_weather", {"city": "London"})
    ]
    jsonschema_rs.validate(WEATHER["function"]["parameters"], dict(r.message.tool_calls[0].function.arguments))
    assert "<tool_call>" not in r.message.content and r.done_reason == "stop"
    parts = list(
        client.chat(
            "default", messages=TOOL_HISTORY, tools=[WEATHER], options={**GREEDY, "num_predict": 40}, stream=True
        )
    )
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "London"})]
    assert not any("tool_call" in p.message.content for p in parts)
    # The result goes back as a tool message; the reply is an answer, not a 500.
    history = TOOL_HISTORY + [
        r.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_name": "get_weather", "content": "rain, 12 C"},
    ]
    answer = client.chat("default", messages=history, tools=[WEATHER], options=GREEDY)
    assert answer.done and isinstance(answer.message.content, str)


def test_tools_with_a_format(client):
    """With tools and ``format``, the reply is a valid call or JSON that validates."""
    answer = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 40}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    for messages in (TOOL_HISTORY, _user("Answer in JSON: what is 2 + 2?")):
        r = client.chat(
            "default", messages=messages, tools=[WEATHER], format=answer, options={**GREEDY, "num_predict": 40}
        )
        assert r.done_reason == "stop"
        for c in r.message.tool_calls or []:
            assert c.function.name == "get_weather"
            jsonschema_rs.validate(WEATHER["function"]["parameters"], dict(c.function.arguments))
        if not r.message.tool_calls:
            jsonschema_rs.validate(answer, json.loads(r.message.content))


def test_format_is_structured_output(server, client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat(
        "default", messages=_user("Invent a person, as JSON."), format=schema, options={**GREEDY, "num_predict": 60}
    )
    assert r.done_reason == "stop"
    jsonschema_rs.validate(schema, json.loads(r.message.content))
    r = client.generate(
        "default", prompt="A JSON object about the sea.", format="json", options={**GREEDY, "num_predict": 60}
    )
    if r.done_reason == "stop":  # complete: it parses
        assert isinstance(json.loads(r.response), dict)
    bad = httpx.post(
        server.url + "/api/chat", json={"model": "default", "messages": _user("hi"), "format": "yaml"}, timeout=60
    )  # the ollama client refuses it before sending
    assert bad.status_code == 400 and "'format'" in bad.json()["error"]


@pytest.mark.parametrize(
    "field, kw, named",
    [
        ("format schema", {"format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "format"),
        ("option", {"options": {"mirostat": 2}}, "options.mirostat"),
        ("think", {"think": True}, "'think'"),
        ("num_predict", {"options": {"num_predict": 0}}, "num_predict"),
    ],
)
def test_unsupported_fields_are_400s_that_name_them(client, field, kw, named):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("default", messages=_user("hi"), **kw)
    assert e.value.status_code == 400 and named in e.value.error


def test_loading_errors_and_runtime_options(server, client):
    loaded = client.chat("default", messages=[])  # Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load"
    for bad in ({"model": "default", "messages": "hi"}, {"model": "default", "options": {"temperature": -1}}):
        r = httpx.post(server.url + "/api/chat", json=bad, timeout=10)
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("other", messages=_user("hi"))
    assert e.value.status_code == 404
    # num_ctx only tunes Ollama's runtime: accepted (and logged), the reply unchanged.
    r = client.chat("default", messages=_user(PROMPT), options={**GREEDY, "num_ctx": 2048, "num_predict": 2})
    assert r.eval_count == 2
    # The NDJSON stream is one JSON object per line.
    with httpx.stream("POST", server.url + "/api/generate", json={"model": "default", "prompt": "Hi"}, timeout=60) as s:
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in s.iter_lines() if x]
    assert lines[-1]["done"] and not any(x["done"] for x in lines[:-1])
