"""What the real coding agents send (issue 48): Claude Code 2.1.328's and
Codex CLI 0.169.0's requests, recorded by a logging server
(tests/fixtures/agents/README.md says how), replayed against the app. Each
answer is read event by event and validated against the API's own types
(the ``anthropic`` and ``openai`` SDKs' models, generated from each API's
specification).

The model is a tiny random llama with a byte-level BPE trained on the
recordings and a ChatML template: its prompts are as long as the real ones
(about 12k tokens), and with one layer a prefill costs next to nothing (the
one layer's keys and values need no attention). A one-layer Gemma 3 (a
sliding window: its cache cannot be trimmed once long) checks the prompt
cache's checkpoints. The clients themselves run in tests/test_agents_e2e.py.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
import typing
from pathlib import Path

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from helpers import agent_model_folder
from openai.types.responses import Response, ResponseStreamEvent

from mlx_redrafter.serve import anthropic_api, responses_api
from mlx_redrafter.serve.app import create_app
from mlx_redrafter.serve.engine import Engine, short_name
from mlx_redrafter.serve.policy import fold_system

AGENTS = Path(__file__).parent / "fixtures" / "agents"
CAP = 48  # --max-tokens-cap: Claude Code asks for 32000
# A template that takes a system message only first, as many do (Gemma's, Mistral's).
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role only first') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def by_type(union) -> dict:
    """An SDK's event union as ``{type: model}`` (a failed check then names one event's fields)."""
    models = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in models}


ANTHROPIC_EVENTS = by_type(RawMessageStreamEvent)
RESPONSES_EVENTS = by_type(ResponseStreamEvent)


def recorded(name: str) -> dict:
    """A recorded request: method, path, query, headers, body."""
    return json.loads((AGENTS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny models with the agents' context (32k), and one of 64 tokens."""
    return {
        "llama": agent_model_folder(tmp_path_factory.mktemp("agents"), "llama", max_position_embeddings=32768),
        # a sliding layer (8 tokens: its attention costs little), then a global one
        "gemma": agent_model_folder(tmp_path_factory.mktemp("agents"), "gemma3_text", 2, max_position_embeddings=32768),
        "short": agent_model_folder(tmp_path_factory.mktemp("agents-short"), "llama", max_position_embeddings=64),
    }


def _engine(folder: Path, **kw) -> Engine:
    from mlx_redrafter.runtime import load_runtime

    kw.setdefault("max_tokens_cap", CAP)
    return Engine(load_runtime(str(folder), None, no_draft=True), max_tokens=8, **kw)


@pytest.fixture(scope="module")
def served(folders):
    """``(engine, http)`` on the tiny llama; the app runs for the module."""
    engine = _engine(folders["llama"], served_names=["agent-model"])
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as http:
        yield engine, http


def replay(http, request: dict, **changes) -> list:
    """POST a recorded request as it was sent (its query and headers); the
    events of its streamed answer as ``(name, data)``, checked to be 200 SSE."""
    body = {**request["body"], **changes}
    headers = {k: v for k, v in request["headers"].items() if k not in ("accept-encoding", "connection")}
    url = request["path"] + (f"?{request['query']}" if request["query"] else "")
    with http.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


def anthropic_message(events: list) -> dict:
    """The message the events build, every event validated against Anthropic's types."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    message, blocks = None, []
    for name, data in events:
        if name == "ping":
            continue
        assert data["type"] == name
        ANTHROPIC_EVENTS[name].model_validate(data)
        if name == "message_start":
            message = copy.deepcopy(data["message"])
        elif name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(data["content_block"])
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            blocks[data["index"]]["text"] += data["delta"]["text"]
        elif name == "message_delta":
            message.update(data["delta"], usage=data["usage"])
    message["content"] = blocks
    Message.model_validate(message)
    return message


def response_of(events: list) -> dict:
    """The final response of Responses events, every event validated against OpenAI's types."""
    for i, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == i
        RESPONSES_EVENTS[name].model_validate(data)
    name, final = events[-1]
    assert name in ("response.completed", "response.incomplete"), name
    Response.model_validate(final["response"])
    return final["response"]


def _prompt_tokens(message: dict) -> int:
    u = message["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"]


# --------------------------------------------------------------------------- the recordings, replayed


def test_claude_code_requests_are_answered_in_anthropics_types(served, caplog):
    engine, http = served
    caplog.set_level(logging.WARNING)
    first = anthropic_message(replay(http, recorded("claude_code_turn1"), model="agent-model"))
    second = anthropic_message(replay(http, recorded("claude_code_turn2"), model="agent-model"))
    tool = anthropic_message(replay(http, recorded("claude_code_tool_result"), model="agent-model"))
    for m in (first, second, tool):
        assert m["model"] == "agent-model" and m["usage"]["output_tokens"] <= CAP
        # max_tokens 32000 is a cap: the reply ends at --max-tokens-cap, as Anthropic ends one at max_tokens
        assert (m["stop_reason"] == "max_tokens") == (m["usage"]["output_tokens"] == CAP)
    assert _prompt_tokens(first) > 10_000  # the real prompt: system, 12 tools, the environment as a system message
    # The next turn (the same system prompt and tools, the conversation grown) prefills only what is new.
    assert second["usage"]["cache_read_input_tokens"] >= _prompt_tokens(first) - 1
    assert second["usage"]["input_tokens"] < 100
    logged = " ".join(r.getMessage() for r in caplog.records)
    for field in ("metadata", "thinking", "context_management", "output_config.effort"):
        assert len(re.findall(f"'{re.escape(field)}' is accepted and has no effect here", logged)) == 1, field


def test_codex_requests_are_answered_in_the_responses_types(served, caplog):
    engine, http = served
    caplog.set_level(logging.WARNING)
    first = response_of(replay(http, recorded("codex_turn1"), model="agent-model"))
    second = response_of(replay(http, recorded("codex_turn2"), model="agent-model"))
    tool = response_of(replay(http, recorded("codex_tool_result"), model="agent-model"))
    for r in (first, second, tool):
        assert r["model"] == "agent-model" and r["usage"]["output_tokens"] <= 8  # the server's default max_tokens
        assert (r["status"] == "incomplete") == (r["usage"]["output_tokens"] == 8)
    assert first["usage"]["input_tokens"] > 8_000
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    for field in ("client_metadata", "prompt_cache_key", "reasoning", "include", "tools (web_search)"):
        assert len(re.findall(f"'{re.escape(field)}' is accepted and has no effect here", logged)) == 1, field


# --------------------------------------------------------------------------- the field policy


def _count(http, body: dict) -> int:
    r = http.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_deferred_and_server_tools_are_left_out_of_the_prompt(served):
    _, http = served
    body = {k: v for k, v in recorded("claude_code_turn1")["body"].items() if k in ("messages", "system")}
    body["model"] = "agent-model"
    tools = recorded("claude_code_turn1")["body"]["tools"]
    deferred = [t for t in tools if t.get("defer_loading")]
    assert deferred  # Claude Code's placeholder
    plain = [t for t in tools if not t.get("defer_loading")]
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    assert _count(http, {**body, "tools": tools + [search]}) == _count(http, {**body, "tools": plain})
    assert _count(http, {**body, "tools": plain}) > _count(http, {**body, "tools": plain[1:]})

    ask = {"model": "agent-model", "input": "hi", "max_output_tokens": 1}
    function = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    sizes = [
        http.post("/v1/responses", json={**ask, "tools": sent}).json()["usage"]["input_tokens"]
        for sent in ([function], [function, {"type": "web_search", "external_web_access": False}])
    ]
    assert sizes[0] == sizes[1]


def test_a_system_message_inside_the_conversation_stays_in_its_place(served, folders, caplog):
    _, http = served
    messages = [
        {"role": "user", "content": "one"},
        {"role": "system", "content": "NOTE"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    body = {"model": "agent-model", "system": "S", "messages": messages}
    with_note = _count(http, body)
    assert with_note > _count(http, {**body, "messages": [m for m in messages if m["role"] != "system"]})
    # A template that refuses it there gets it folded into the user turn before it, logged once.
    assert fold_system([{"role": "system", "content": "S"}] + messages) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one\n\nNOTE"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    engine = _engine(folders["llama"])
    engine.rt.tokenizer._tokenizer.chat_template = STRICT
    caplog.set_level(logging.WARNING)
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as strict:
        for _ in range(2):
            r = strict.post("/v1/messages", json={**body, "model": engine.model_id, "max_tokens": 2})
            assert r.status_code == 200, r.text
    assert sum("folded into the user turn" in r.getMessage() for r in caplog.records) == 1


def test_claude_codes_billing_header_is_not_part_of_the_prompt(served):
    """The first system block Claude Code sends is billing metadata whose hash
    changes with each conversation: it is left out of the prompt (a new
    conversation then reuses the cached system prompt and tools), the other
    blocks stay."""
    _, http = served
    turn1 = recorded("claude_code_turn1")["body"]
    system = turn1["system"]
    assert system[0]["text"].startswith(anthropic_api.BILLING_HEADER)
    request = anthropic_api.CountRequest(**{**turn1, "model": "agent-model"})
    rendered = anthropic_api.chat_messages(request)[0]
    assert rendered["role"] == "system" and rendered["content"] == "".join(b["text"] for b in system[1:])
    body = {"model": "agent-model", "system": system, "messages": [{"role": "user", "content": "hi"}]}
    other = copy.deepcopy(body)
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.328.f07; cc_entrypoint=cli; cch=3b2c1;"
    assert _count(http, body) == _count(http, other) == _count(http, {**body, "system": system[1:]})


def test_edits_that_change_the_prompt_are_refused(served):
    _, http = served
    body = {"model": "agent-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = http.post(
        "/v1/messages", json={**body, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    )
    assert r.status_code == 400 and "'context_management.edits.0'" in r.json()["error"]["message"]
    r = http.post("/v1/messages", json={**body, "tools": [{"type": "bash_20250124", "name": "bash"}]})
    assert r.status_code == 400 and "'tools.0'" in r.json()["error"]["message"]


def test_namespaced_functions_are_called_with_their_namespace(served):
    _, http = served
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    namespace = {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for sub-agents.",
        "tools": [{"type": "function", "name": "spawn_agent", "strict": False, "parameters": empty}],
    }
    r = http.post(
        "/v1/responses",
        json={
            "model": "agent-model",
            "input": "spawn one",
            "tools": [namespace],
            "tool_choice": {"type": "function", "name": "spawn_agent"},
            "max_output_tokens": CAP,
            "parallel_tool_calls": False,
        },
    )
    assert r.status_code == 200, r.text
    call = r.json()["output"][0]
    assert call["type"] == "function_call" and call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1"
    assert json.loads(call["arguments"]) == {}


def test_a_long_prefill_keeps_the_stream_alive(served, monkeypatch):
    """Claude Code and Codex drop a stream silent for minutes (a 12k-token
    prefill on a slow CPU takes that long): while nothing comes, Anthropic's
    stream sends ``ping`` and the Responses stream ``response.in_progress``."""
    engine, http = served
    monkeypatch.setattr(anthropic_api, "KEEPALIVE_S", 0.25)
    monkeypatch.setattr(responses_api, "KEEPALIVE_S", 0.25)
    cache_for = engine.cache_for

    def slow(job):  # the prefill, on the worker thread, takes a while
        time.sleep(2)
        return cache_for(job)

    monkeypatch.setattr(engine, "cache_for", slow)
    ask = {"path": "/v1/messages", "query": "", "headers": {}}
    body = {"model": "agent-model", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    events = replay(http, {**ask, "body": body})
    first = next(i for i, (name, _) in enumerate(events) if name == "content_block_start")
    assert [n for n, _ in events[:first]].count("ping") >= 3  # the usual one, then one every 0.25 s of silence
    anthropic_message(events)
    body = {"model": "agent-model", "input": "hi", "max_output_tokens": 4, "stream": True}
    events = replay(http, {**ask, "path": "/v1/responses", "body": body})
    first = next(i for i, (name, _) in enumerate(events) if name == "response.output_item.added")
    assert [n for n, _ in events[:first]].count("response.in_progress") >= 3
    response_of(events)


# --------------------------------------------------------------------------- context, names


def test_past_the_context_the_clients_words(folders):
    engine = _engine(folders["short"], max_tokens_cap=None)  # a 64-token context
    limit = 64
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as http:
        ask = {"model": engine.model_id, "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
        m = http.post("/v1/messages", json=ask).json()
        prompt = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]
        # max_tokens past the room left is a cap: the reply ends where the context does
        assert m["stop_reason"] == "max_tokens" or m["usage"]["output_tokens"] < limit - prompt
        assert m["usage"]["output_tokens"] <= limit - prompt

        long = {"model": engine.model_id, "messages": [{"role": "user", "content": "hi there " * 40}]}
        tokens = _count(http, long)
        r = http.post("/v1/messages", json={**long, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        words = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", r.json()["error"]["message"])
        n, maximum = map(int, words.groups())
        assert n == tokens > maximum and maximum == limit - engine.rt.plan().margin - 1

        r = http.post("/v1/responses", json={"input": "hi there " * 40})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_reply_cut_at_the_cap_may_end_the_turn(folders):
    """A base model never ends a turn, and agents take a cut reply for an
    error: with --cap-ends-turn the server's cap ends the turn (the stats
    say it was cut); a request's own max_tokens is still reported as hit."""
    engine = _engine(folders["llama"], max_tokens_cap=4, cap_ends_turn=True)
    ask = {"model": engine.model_id, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as http:
        m = http.post("/v1/messages", json={**ask, "max_tokens": 32000}).json()
        assert m["usage"]["output_tokens"] == 4 and m["stop_reason"] == "end_turn"
        assert m["redrafter"]["cut_at_cap"] is True
        m = http.post("/v1/messages", json={**ask, "max_tokens": 2}).json()
        assert m["stop_reason"] == "max_tokens" and m["redrafter"]["cut_at_cap"] is False
        r = http.post("/v1/responses", json={"model": engine.model_id, "input": "hi"}).json()  # asks 8 (-n)
        assert r["status"] == "completed" and r["usage"]["output_tokens"] == 4


def test_a_model_answers_to_its_short_name_and_aliases(served, folders):
    engine, http = served
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    spec = str(folders["llama"])
    assert engine.names == ["agent-model", spec, "llama"]
    for name in engine.names:
        assert http.post("/v1/messages/count_tokens", json={**ask, "model": name}).status_code == 200
    r = http.post("/v1/messages/count_tokens", json={**ask, "model": "claude-sonnet-4-5"})
    assert r.status_code == 404 and "'agent-model'" in r.json()["error"]["message"]
    assert http.get("/v1/models").json()["data"][0]["id"] == "agent-model"
    assert short_name("/models/gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m-q4_k_m"
    assert short_name("mlx-community/Qwen3-0.6B-4bit") == "Qwen3-0.6B-4bit"
    assert short_name("./my-model/") == "my-model" and short_name("default") == "default"


# --------------------------------------------------------------------------- a cache that cannot be trimmed


def _whole(http, engine: Engine, request: dict) -> dict:
    r = http.post(request["path"], json={**request["body"], "stream": False, "model": engine.model_id})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_sliding_window_model_keeps_the_agents_prompt_cached(folders):
    """Gemma 3's sliding-window cache cannot be trimmed once past its window,
    so a stored reply only serves prompts that extend it exactly. The
    server keeps copies at the end of the shared head (system prompt and
    tools) and of each prompt: the next turn and a new conversation reuse
    them, and the replies are those of a server that reused nothing."""
    engine = _engine(folders["gemma"])
    assert engine.checkpoints
    turn1, turn2 = recorded("claude_code_turn1"), recorded("claude_code_turn2")
    other = copy.deepcopy(turn1)
    other["body"]["messages"][0]["content"][-1]["text"] = "A different question."
    # Claude Code's billing header changes with the conversation (its version suffix, a hash): left out
    header = other["body"]["system"][0]
    assert header["text"].startswith(anthropic_api.BILLING_HEADER)
    header["text"] = header["text"].replace("2.1.328.ea9", "2.1.328.f07") + " cch=3b2c1;"
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as http:
        first = _whole(http, engine, turn1)
        second = _whole(http, engine, turn2)
        new = _whole(http, engine, other)
        shared = {k: turn1["body"][k] for k in ("system", "tools")}
        alone = _count(http, {**shared, "model": engine.model_id, "messages": [{"role": "user", "content": ""}]})
    assert second["usage"]["cache_read_input_tokens"] >= _prompt_tokens(first) - 1
    # a new conversation: the system prompt and tools (all but an empty user turn's few tokens), not the question
    assert alone - 20 < new["usage"]["cache_read_input_tokens"] < alone < _prompt_tokens(new)
    fresh = _engine(folders["gemma"])
    with TestClient(create_app(fresh), base_url="http://127.0.0.1") as http:
        for request, reply in ((turn2, second), (other, new)):
            fresh.cache.reset()
            alone = _whole(http, fresh, request)
            assert alone["usage"]["cache_read_input_tokens"] == 0
            assert alone["content"] == reply["content"]
