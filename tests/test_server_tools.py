"""``mlx-redrafter serve`` as a drop-in for assistants (issue 29): tool calls,
``/metrics``, unsupported fields, unknown routes and alternating
conversations, on a real server subprocess (the default model, its shipped
drafter) driven with the official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_server import _chat, _health
from ui_servers import GenerateCommand, Server

MAX_TOKENS = 8
CACHE_SIZE = 3
PROMPT = "What is the capital of Italy?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}},
    },
}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
MARKERS = ("<tool_call", "</tool_call", "<tool_response", "<tools>")
# The reference command runs in-process (ui_servers.GenerateCommand): the session's default model, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")


@pytest.fixture(scope="module")
def generate_cli():
    return GenerateCommand(PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def served(tmp_path_factory, generate_cli):
    """``(base URL, log file)``; the process is always stopped."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = Server(
        ["--max-tokens", str(MAX_TOKENS), "--prompt-cache-size", str(CACHE_SIZE), "--prompt-cache-bytes", "1GB"], log
    )
    try:
        yield server.url, log
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0] + "/v1", api_key="not-needed", max_retries=0, timeout=300)


def _metrics(url) -> dict:
    """``{(name, labels): value}`` of every sample of ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _no_markers(text):
    assert not any(m in (text or "") for m in MARKERS), text


# --------------------------------------------------------------------------- tools


def test_models_card(client):
    [m] = client.models.list().data
    assert m.model_extra["context_length"] == 8192
    assert m.model_extra["tools"] is True and m.model_extra["tool_format"] == "generic"
    assert m.model_extra["tool_calls_constrained"] is True


def _valid_calls(message, tools=(WEATHER,)):
    """The message's calls as ``(name, arguments)``, each named after one of
    ``tools`` and validating against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for c in message.tool_calls or []:
        assert c.function.name in schemas, c.function.name
        arguments = json.loads(c.function.arguments)
        jsonschema_rs.validate(schemas[c.function.name], arguments)
        out.append((c.function.name, arguments))
    return out


def test_the_measured_failures_are_impossible_now(client):
    """Measured before tool calls were constrained (docs/tuning.md), on these exact requests: a named
    function echoed its schema as content; "required" called a function
    named "Paris". Now the call names a tool and its arguments validate; with
    parallel_tool_calls left out, the generic format (a template that knows
    no tools) makes one call and ends, as the default model would otherwise
    repeat it until max_tokens."""
    for choice in (FORCED, "required"):
        r = _chat(client, ASK, tools=[WEATHER], tool_choice=choice, max_tokens=48)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        calls = _valid_calls(msg)
        assert [name for name, _ in calls] == ["get_weather"], msg
        assert reason == "tool_calls"
        _no_markers(msg.content)


def test_one_call_whole_and_streamed(client):
    """parallel_tool_calls false: exactly one call, and the reply ends after it."""
    kw = dict(tools=[WEATHER], tool_choice=FORCED, max_tokens=48, parallel_tool_calls=False)
    r = _chat(client, ASK, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    [(name, arguments)] = _valid_calls(msg)
    chunks = list(_chat(client, ASK, stream=True, **kw))
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in deltas] == [(0, name, arguments)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_in_a_row(client):
    r = _chat(client, ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64, parallel_tool_calls=True)
    assert len(_valid_calls(r.choices[0].message, (WEATHER, TIME))) >= 2  # the default model repeats its call


def _call(i, city):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
        ],
    }


# Two earlier calls in the history: the default model then answers the third question with a call too.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    _call(1, "Paris"),
    {"role": "user", "content": "Weather in Rome?"},
    _call(2, "Rome"),
    {"role": "user", "content": "Weather in London?"},
]


def test_auto_calls_are_constrained_from_their_opening(client):
    r = _chat(client, HISTORY, tools=[WEATHER], max_tokens=48)
    assert r.choices[0].finish_reason == "tool_calls" and _valid_calls(r.choices[0].message)
    # Without a reason to call, free text ends normally, without a call.
    r = _chat(client, ASK, tools=[WEATHER], tool_choice="auto", max_tokens=48)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    _no_markers(r.choices[0].message.content)


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_tools_with_a_response_format(client):
    """With tools and response_format, the reply is a valid call, or content
    that validates against the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for messages in (HISTORY, [{"role": "user", "content": "Answer in JSON: what is 2 + 2?"}]):
        r = _chat(client, messages, tools=[WEATHER], response_format=fmt, max_tokens=40, parallel_tool_calls=False)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason in ("tool_calls", "stop")
        if not _valid_calls(msg):
            jsonschema_rs.validate(ANSWER, json.loads(msg.content))
    with pytest.raises(BadRequestError) as e:
        _chat(
            client,
            ASK,
            tools=[WEATHER],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}},
        )
    assert e.value.body["param"] == "response_format"


def test_tool_result_round_trip(client, default_model):
    from mlx_redrafter.serve.tools import prompt_with_tools

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    r = _chat(client, history, tools=[WEATHER])
    _no_markers(r.choices[0].message.content)
    # The history went through the generic format: the call and its result are in the prompt.
    rendered = prompt_with_tools(default_model[1], history, [WEATHER])
    assert '<tool_response>{"name": "get_weather", "content": "18 C and sunny"}</tool_response>' in rendered.text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered.text
    assert r.usage.prompt_tokens == len(rendered.ids)


def test_temperature_0_equals_generate(client, generate_cli):
    """Tool-less requests, and tools with tool_choice "none", are not parsed:
    the reply is what ``generate --temp 0`` prints."""
    plain = _chat(client, PROMPT).choices[0].message.content
    none = _chat(client, PROMPT, tools=[WEATHER], tool_choice="none")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(client, PROMPT, tools=[WEATHER], tool_choice="none", stream=True)
    )
    stdout, stderr = generate_cli.communicate(timeout=600)
    assert generate_cli.returncode == 0, stderr
    assert stdout == plain + "\n"
    assert none.choices[0].message.content == plain == streamed and not none.choices[0].message.tool_calls


# --------------------------------------------------------------------------- the prompt cache


def test_alternating_conversations_reuse_their_own_prefix(served, client):
    turns = {}
    for name, first in (("a", "Name a colour."), ("b", "Name a planet.")):
        turns[name] = [{"role": "user", "content": first}]
        r = _chat(client, turns[name])
        turns[name] += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "And another one?"},
        ]
        turns[name + "_prompt"] = r.usage.prompt_tokens
    before = _metrics(served[0])
    reused = []
    for name in ("a", "b"):  # b came in between: a's first turn is still cached, then b's
        r = _chat(client, turns[name])
        reused.append(r.usage.prompt_tokens_details.cached_tokens)
        assert reused[-1] >= turns[name + "_prompt"] + 1  # its whole first turn, reply included
        assert r.model_extra["redrafter"]["prompt_tokens_reused"] == reused[-1]
    after = _metrics(served[0])
    assert after[("redrafter_prompt_cache_hits_total", ())] == before[("redrafter_prompt_cache_hits_total", ())] + 2
    key = ("redrafter_prompt_cache_reused_tokens_total", ())
    assert after[key] == before[key] + sum(reused)
    cache = _health(served[0])["prompt_cache"]
    assert 1 <= cache["entries"] <= CACHE_SIZE and 0 < cache["bytes"] <= 10**9


# --------------------------------------------------------------------------- metrics, 400s, 404s


def test_metrics_move_with_traffic(served, client):
    url = served[0]
    before = _metrics(url)
    r = _chat(client, "Say hello.", max_tokens=6)
    with pytest.raises(BadRequestError):
        _chat(client, "Say hello.", n=2)
    after = _metrics(url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("redrafter_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved("redrafter_requests_total", route="/v1/chat/completions", status="400") == 1
    assert moved("redrafter_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("redrafter_generated_tokens_total") == r.usage.completion_tokens
    stats = r.model_extra["redrafter"]
    assert moved("redrafter_tokens_per_step_count") == stats["steps"]
    assert moved("redrafter_tokens_per_step_sum") == r.usage.completion_tokens
    accepted = sum(moved("redrafter_draft_tokens_accepted_total", source=s) for s in ("drafter", "lookup"))
    assert accepted == round(stats["from_drafts"] * r.usage.completion_tokens)
    assert after[("redrafter_queue_waiting", ())] == 0


UNSUPPORTED = [
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
]


@pytest.mark.parametrize("field,extra", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_fields_get_a_400_naming_them(client, field, extra):
    with pytest.raises(BadRequestError) as e:
        _chat(client, "hi", **extra)
    error = e.value.body
    assert error["param"] == ("logprobs" if field == "top_logprobs" else field)
    assert error["code"] == "unsupported_parameter" and error["param"] in error["message"]


def test_supported_spellings_pass_and_bad_tool_choice_is_a_400(client):
    r = _chat(client, "hi", n=1, logprobs=False, response_format={"type": "text"}, max_tokens=2)
    assert r.choices[0].message.content
    with pytest.raises(BadRequestError) as e:
        _chat(client, "hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="default", prompt="hi", logprobs=2)
    assert e.value.body["param"] == "logprobs"


def test_unknown_routes_name_themselves_and_the_supported_ones(served, client):
    url = served[0]
    with pytest.raises(NotFoundError) as e:
        client.embeddings.create(model="default", input="hi")
    message = e.value.body["message"]
    assert message.startswith("/v1/embeddings is not supported by mlx-redrafter serve; supported: ")
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health"):
        assert route in message
    r = httpx.get(url + "/v2/anything", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("/v2/anything is not supported")
    r = httpx.get(url + "/", timeout=30)  # the chat page (a 404 like the others with --no-ui)
    assert r.status_code == 200 and "<html" in r.text.lower()


def test_prompt_cache_flags_fail_before_loading(capsys):
    from mlx_redrafter.cli import main

    assert main(["serve", "--prompt-cache-size", "0"]) == 1
    assert "--prompt-cache-size" in capsys.readouterr().err
    assert main(["serve", "--prompt-cache-bytes", "lots"]) == 1
    err = capsys.readouterr().err
    assert "--prompt-cache-bytes 'lots' is not a size" in err and "Traceback" not in err
