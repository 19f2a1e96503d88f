"""The APIs coding agents speak (issue 37): Anthropic's Messages
(``/v1/messages``, Claude Code) and OpenAI's Responses (``/v1/responses``,
Codex CLI), on one real server subprocess (the default model, its shipped
drafter), driven with the official ``anthropic`` and ``openai`` clients. At
temperature 0 each route's reply equals the OpenAI chat route's for the same
conversation: one engine, one chat template, greedy decoding."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema_rs
import pytest
from openai import BadRequestError, OpenAI
from ui_servers import Server

MAX_TOKENS = 12
PROMPT = "What is the capital of Italy?"
ASK = "What is the weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": SCHEMA}
FUNCTION = {"type": "function", "name": "get_weather", "description": WEATHER["description"], "parameters": SCHEMA}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": SCHEMA},
}
CALL_ARGS = {"city": "Paris"}
RESULT = "18 C and sunny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server's base URL; the process is always stopped."""
    server = Server(["--max-tokens", str(MAX_TOKENS), "--no-ui"], tmp_path_factory.mktemp("agents") / "serve.log")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served, api_key="not-needed", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def openai_client(served):
    return OpenAI(base_url=served + "/v1", api_key="not-needed", max_retries=0, timeout=300)


def _chat(client, messages, **kw):
    return client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=MAX_TOKENS, **kw
    )


@pytest.fixture(scope="module")
def reference(openai_client):
    """The OpenAI chat route's reply to PROMPT (system + user) at temperature 0."""
    return _chat(openai_client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPT}])


def _create(claude, **kw):
    kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
    return claude.messages.create(
        model="default", max_tokens=kw.pop("max_tokens", MAX_TOKENS), extra_body={"temperature": 0}, **kw
    )


def _sse(url: str, path: str, body: dict, headers=None) -> list:
    """``(event name, data)`` of a streamed reply, read raw (pings included)."""
    events, name = [], None
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


# --------------------------------------------------------------------------- Anthropic's Messages


def test_messages_create_equals_the_chat_route(claude, reference):
    for system in ("Answer briefly.", [{"type": "text", "text": "Answer briefly."}]):
        m = _create(claude, system=system)
        assert [b.type for b in m.content] == ["text"]
        assert m.content[0].text == reference.choices[0].message.content
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[reference.choices[0].finish_reason]
        u = m.usage
        assert u.input_tokens + u.cache_read_input_tokens == reference.usage.prompt_tokens
        assert u.output_tokens == reference.usage.completion_tokens
        assert m.model == "default" and m.id.startswith("msg_") and m.role == "assistant"
        assert m.model_extra["redrafter"]["steps"] >= 1
    assert u.cache_read_input_tokens > 0  # the second request reused the first's prompt from the cache


def test_messages_stream_equals_the_chat_route(served, claude, reference):
    with claude.messages.stream(
        model="default",
        max_tokens=MAX_TOKENS,
        system="Answer briefly.",
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"temperature": 0},
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == reference.choices[0].message.content
    assert final.usage.output_tokens == reference.usage.completion_tokens

    body = {
        "model": "default",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "temperature": 0,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": PROMPT}],
    }
    events = _sse(served, "/v1/messages", body, {"anthropic-version": "2023-06-01", "x-api-key": "k"})
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text
    end = events[-2][1]
    assert (
        end["delta"]["stop_reason"] == final.stop_reason and end["usage"]["output_tokens"] == final.usage.output_tokens
    )
    assert end["redrafter"]["steps"] >= 1


def test_stop_sequences(claude, reference):
    text = reference.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    m = _create(claude, system="Answer briefly.", stop_sequences=["@@never@@", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.find(stop)]


def test_tool_choice_any_and_tool_are_schema_valid_calls(claude):
    ask = [{"role": "user", "content": ASK}]
    # One call each (disable_parallel_tool_use): the grammar then ends the reply, so nothing is cut by max_tokens.
    tool = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, tool):
        m = _create(claude, messages=ask, tools=[WEATHER], tool_choice=choice, max_tokens=48)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use", m
        assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
        jsonschema_rs.validate(SCHEMA, uses[0].input)
    with claude.messages.stream(
        model="default", max_tokens=48, messages=ask, tools=[WEATHER], extra_body={"temperature": 0}, tool_choice=tool
    ) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.type, b.name, b.input) for b in m.content if b.type == "tool_use"
    ]
    assert streamed.stop_reason == "tool_use"


def test_auto_calls_name_a_tool_and_fit_its_schema(claude, openai_client):
    """With ``auto`` the text is free until the model opens a call; after a
    history of calls the default model calls again (greedy), and the call
    names the given tool and its arguments validate."""
    cities = ["Paris", "Rome"]
    history = []
    for i, city in enumerate(cities):
        history += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}],
            },
        ]
    m = _create(
        claude,
        messages=history + [{"role": "user", "content": "Weather in London?"}],
        tools=[WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        max_tokens=40,
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use", m
    assert uses[0].name == "get_weather"
    jsonschema_rs.validate(SCHEMA, uses[0].input)

    items = []
    for i, city in enumerate(cities):
        items += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "type": "function_call",
                "call_id": f"call_{i}",
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            },
        ]
    r = openai_client.responses.create(
        model="default",
        input=items + [{"role": "user", "content": "Weather in London?"}],
        tools=[FUNCTION],
        tool_choice="auto",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and r.status == "completed", r.output
    jsonschema_rs.validate(SCHEMA, json.loads(calls[0].arguments))
    assert calls[0].arguments == json.dumps(uses[0].input)  # one prompt, one greedy reply, through either API


def test_tool_use_round_trip_renders_like_the_chat_route(claude, openai_client):
    history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": CALL_ARGS}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]},
    ]
    m = _create(claude, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    chat = _chat(
        openai_client,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT},
        ],
        tools=[CHAT_TOOL],
        tool_choice="none",
    )
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    count = claude.messages.count_tokens(
        model="default", messages=history, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert count.input_tokens == chat.usage.prompt_tokens


def test_count_tokens(claude, reference):
    n = claude.messages.count_tokens(
        model="default", system="Answer briefly.", messages=[{"role": "user", "content": PROMPT}]
    )
    assert n.input_tokens == reference.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            },
            "image",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "text", "data": "x", "media_type": "text/plain"}}
                        ],
                    }
                ]
            },
            "document",
        ),
        ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]}, "mcp_servers"),
        # A client tool of Anthropic's own schema-less kind (a server tool is left out: test_agent_clients.py).
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
        # An edit that would change the prompt (one that clears thinking is a no-op, accepted).
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits.0"),
        # Unknown fields inside the request's parts are named too, never ignored.
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{}]}]},
            "tools.0.input_examples",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "shout": True}]}]},
            "messages.0.content.0.shout",
        ),
        ({"tool_choice": {"type": "auto", "hurry": True}}, "tool_choice.hurry"),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(claude, extra, named):
    body = {"messages": [{"role": "user", "content": PROMPT}], **extra}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="default", max_tokens=4, messages=body.pop("messages"), extra_body=body)
    assert e.value.status_code == 400 and named in e.value.message
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"


def test_errors_are_anthropic_shaped(served, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in e.value.message
    r = httpx.post(
        served + "/v1/messages", json={"model": "default", "messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )  # max_tokens is required
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        served + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_replies_are_what_openapi_documents(served):
    """Each route's whole reply validates against the 200 schema /openapi.json gives it."""
    doc = httpx.get(served + "/openapi.json", timeout=30).json()
    bodies = {
        "/v1/messages": {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]},
        "/v1/messages/count_tokens": {"model": "default", "messages": [{"role": "user", "content": PROMPT}]},
        "/v1/responses": {"model": "default", "max_output_tokens": 4, "input": PROMPT},
    }
    for path, body in bodies.items():
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        r = httpx.post(served + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        jsonschema_rs.validate({**schema, "components": doc["components"]}, r.json())


def _strict(kind, data):
    """``data`` (the server's JSON) validated strictly (no coercion; every field
    the type requires present) against a type the provider's SDK publishes."""
    import pydantic

    return pydantic.TypeAdapter(kind).validate_python(data, strict=True)


def _chat_chunks(url: str, body: dict) -> list:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_replies_are_the_providers_own_types(served):
    """Every reply and stream event validates against Anthropic's and OpenAI's
    own SDK types (their published schemas), not against our response models."""
    from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    ask = [{"role": "user", "content": ASK}]
    # A text reply that max_tokens cuts (as 48 tokens do: the same types, fewer tokens), and a
    # tool call given room to end (its grammar ends the reply: nothing cut).
    message = {"model": "default", "max_tokens": 8, "messages": ask, "temperature": 0}
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    for body in (message, {**message, "max_tokens": 48, "tools": [WEATHER], "tool_choice": one_call}):
        m = _strict(Message, httpx.post(served + "/v1/messages", json=body, timeout=300).json())
        events = [data for name, data in _sse(served, "/v1/messages", {**body, "stream": True}) if name != "ping"]
        assert [_strict(RawMessageStreamEvent, e).type for e in events][-1] == "message_stop"
    assert "tool_use" in [b.type for b in m.content]  # the tool call's shape too
    count = {"model": "default", "messages": ask}
    _strict(MessageTokensCount, httpx.post(served + "/v1/messages/count_tokens", json=count, timeout=300).json())
    bad = httpx.post(served + "/v1/messages", json={"model": "default", "messages": ask}, timeout=30)
    assert bad.status_code == 400 and _strict(ErrorResponse, bad.json()).type == "error"

    respond = {"model": "default", "max_output_tokens": 8, "input": ASK, "temperature": 0}
    call = {"max_output_tokens": 48, "tools": [FUNCTION], "tool_choice": "required", "parallel_tool_calls": False}
    for body in (respond, {**respond, **call}):
        r = _strict(Response, httpx.post(served + "/v1/responses", json=body, timeout=300).json())
        events = _sse(served, "/v1/responses", {**body, "stream": True})
        assert [_strict(ResponseStreamEvent, data).type for _, data in events][-1] == f"response.{r.status}"
    assert "function_call" in [o.type for o in r.output]

    chat = {"model": "default", "max_tokens": 8, "messages": ask, "temperature": 0}
    _strict(ChatCompletion, httpx.post(served + "/v1/chat/completions", json=chat, timeout=300).json())
    for chunk in _chat_chunks(served, {**chat, "stream": True, "stream_options": {"include_usage": True}}):
        _strict(ChatCompletionChunk, chunk)


# --------------------------------------------------------------------------- OpenAI's Responses


def _respond(client, **kw):
    kw.setdefault("input", PROMPT)
    return client.responses.create(
        model="default",
        instructions="Answer briefly.",
        temperature=0,
        max_output_tokens=kw.pop("max_output_tokens", MAX_TOKENS),
        **kw,
    )


def test_responses_create_equals_the_chat_route(openai_client, reference):
    r = _respond(openai_client)
    assert r.output_text == reference.choices[0].message.content
    assert r.status == {"stop": "completed", "length": "incomplete"}[reference.choices[0].finish_reason]
    assert r.usage.input_tokens == reference.usage.prompt_tokens
    assert r.usage.output_tokens == reference.usage.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the reference's prompt, from the cache
    assert r.model_extra["redrafter"]["steps"] >= 1
    items = [{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]
    assert _respond(openai_client, input=items).output_text == r.output_text


def test_responses_stream(openai_client, reference):
    whole = _respond(openai_client)
    events = list(_respond(openai_client, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ] + ["response.output_text.delta"] * n + [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text == reference.choices[0].message.content
    assert events[-1].response.id == events[0].response.id


def test_function_call_round_trip(openai_client):
    forced = dict(tools=[FUNCTION], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    r = _respond(openai_client, input=ASK, max_output_tokens=48, **forced)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and r.status == "completed"
    jsonschema_rs.validate(SCHEMA, json.loads(calls[0].arguments))
    events = list(_respond(openai_client, input=ASK, stream=True, max_output_tokens=48, **forced))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments and events[-1].type == "response.completed"

    follow = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": RESULT},
    ]
    answer = _respond(openai_client, input=follow, tools=[FUNCTION], tool_choice="none")
    chat = _chat(
        openai_client,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": calls[0].arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": RESULT},
        ],
        tools=[CHAT_TOOL],
        tool_choice="none",
    )
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_json_schema(openai_client):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "enum": ["Rome", "Milan"]}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    r = _respond(
        openai_client,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema_rs.validate(schema, json.loads(r.output_text))
    assert r.model_extra["redrafter"]["structured"] == {"complete": True}


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_123"}, "conversation"),
    ],
)
def test_state_is_refused_as_stateless(openai_client, extra, named):
    with pytest.raises(BadRequestError) as e:
        _respond(openai_client, **extra)
    assert e.value.body["param"] == named and "stateless" in e.value.body["message"]


def test_responses_unsupported_items_are_named(openai_client):
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]
    with pytest.raises(BadRequestError) as e:
        _respond(openai_client, input=image)
    assert e.value.body["param"] == "input.0.content.0" and "input_image" in e.value.body["message"]
    with pytest.raises(BadRequestError) as e:  # a tool the client runs in its own format (hosted ones are left out)
        _respond(openai_client, tools=[{"type": "local_shell"}])
    assert e.value.body["param"] == "tools.0" and "local_shell" in e.value.body["message"]
    # Unknown fields inside the request's parts are named too, never ignored.
    with pytest.raises(BadRequestError) as e:
        _respond(
            openai_client,
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "defer_loading": True}],
        )
    assert e.value.body["param"] == "tools.0.defer_loading"
    with pytest.raises(BadRequestError) as e:
        _respond(openai_client, text={"format": {"type": "text", "shout": True}})
    assert e.value.body["param"] == "text.format.shout"
