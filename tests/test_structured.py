"""Structured output through the public doors: ``stream_generate(grammar=)``,
``generate --json/--json-schema`` and the server's ``response_format`` (the
official ``openai`` client against a real server subprocess, the default
model and its shipped drafter). The loop itself is tested against mlx-lm
in test_grammar.py; here every reply must parse and validate, equal plain
constrained decoding, and say when ``max_tokens`` cut it."""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from ui_servers import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    },
    "required": ["name", "year"],
    "additionalProperties": False,
}
ASK = "Give the name and birth year of Ada Lovelace as JSON."
MAX_TOKENS = 40  # the schema's replies take about 15 tokens
# The runtime and generate load the default model in-process: the session's, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")


def _valid(text: str, schema=SCHEMA):
    value = json.loads(text)
    jsonschema_rs.validate(schema, value)
    return value


@pytest.fixture(scope="module")
def runtime():
    from mlx_redrafter.runtime import load_runtime

    return load_runtime("default", None)


def _stream(rt, max_tokens=MAX_TOKENS, **kw):
    from mlx_redrafter.generate import stream_generate
    from mlx_redrafter.prompts import chat_prompt_ids

    ids = chat_prompt_ids(rt.tokenizer, [{"role": "user", "content": ASK}])
    return list(stream_generate(rt.model, rt.tokenizer, ids, max_tokens=max_tokens, **kw))


def test_stream_generate_with_a_schema_equals_plain_constrained_decoding(runtime):
    from helpers import assert_exact_under_drafting

    from mlx_redrafter.prompts import chat_prompt_ids

    assert runtime.draft.drafter is not None and runtime.draft.lookup
    ids = chat_prompt_ids(runtime.tokenizer, [{"role": "user", "content": ASK}])
    drafted = assert_exact_under_drafting(  # against plain constrained decoding: no drafter, no lookup
        runtime.model,
        runtime.tokenizer,
        ids,
        max_tokens=MAX_TOKENS,
        grammar=SCHEMA,
        draft=runtime.draft,
        min_accepted=2,
    )
    text = "".join(r.text for r in drafted)
    _valid(text)
    last = drafted[-1]
    assert last.finish_reason == "stop" and not last.incomplete


def test_max_tokens_cut_says_incomplete(runtime):
    from mlx_redrafter.generate import generate

    rs = _stream(runtime, grammar=SCHEMA, draft=runtime.draft, max_tokens=3)
    assert rs[-1].finish_reason == "length" and rs[-1].incomplete
    assert not any(r.incomplete for r in rs[:-1])
    with pytest.raises(json.JSONDecodeError):
        json.loads("".join(r.text for r in rs))
    with pytest.warns(UserWarning, match="JSON is incomplete"):
        generate(runtime.model, runtime.tokenizer, ASK, grammar=SCHEMA, max_tokens=3)


def test_free_text_is_never_incomplete(runtime):
    rs = _stream(runtime, max_tokens=3)
    assert rs[-1].finish_reason == "length" and not rs[-1].incomplete


# --------------------------------------------------------------------------- the command line


def _cli(capsys, *args):
    from helpers import cli

    code = cli(["generate", "--temp", "0", *args])
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())  # rich wraps long lines


def test_cli_json_schema_and_json(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = _cli(capsys, "-n", str(MAX_TOKENS), "--json-schema", str(schema), "-p", ASK)
    assert code == 0, err
    _valid(out.strip())
    code, out, err = _cli(capsys, "-n", "2", "--json", "-p", ASK)
    assert code == 1 and "Error:" in err and "not parse" in err and "Raise --max-tokens (now 2)" in err
    with pytest.raises(json.JSONDecodeError):  # what the exit status warns a script of
        json.loads(out)
    code, out, err = _cli(capsys, "-n", "3", "--json-schema", str(schema), "-p", ASK)
    assert code == 1 and "before the JSON was complete" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "Cannot read the JSON Schema file"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "is not an object"),
        (json.dumps({"type": "strin"}), "Invalid JSON Schema: Invalid type: strin"),
    ],
)
def test_cli_bad_schema_is_a_clear_error(capsys, tmp_path, content, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    code, out, err = _cli(capsys, "--json-schema", str(path), "-p", ASK)
    assert code == 1 and message in err and "Traceback" not in err
    assert "Error:" in err and "Fix:" in err


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = Server(["--max-tokens", str(MAX_TOKENS)], tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=300)
    finally:
        server.stop()


def _chat(client, **kw):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], temperature=0, **kw
    )


def test_server_json_schema_equals_plain_constrained_decoding(client, runtime):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = _chat(client, response_format=fmt)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.model_extra["redrafter"]["structured"] == {"complete": True}
    _valid(text)
    assert text == "".join(x.text for x in _stream(runtime, grammar=SCHEMA))
    stream = _chat(client, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_server_json_object_and_text(client):
    r = _chat(client, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = _chat(client, response_format={"type": "text"}, max_tokens=4)
    assert r.model_extra["redrafter"]["structured"] is None


def test_server_length_cut_says_incomplete(client):
    r = _chat(
        client, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, max_tokens=3
    )
    assert r.choices[0].finish_reason == "length"
    assert r.model_extra["redrafter"]["structured"] == {"complete": False}


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}, "Invalid type: strin"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "integer", "minimum": 5, "maximum": 2}},
            },
            "minimum",
        ),
        ({"type": "json_schema"}, "needs a 'json_schema' object"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_server_bad_response_format_is_a_400(client, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, response_format=fmt)
    assert e.value.status_code == 400 and message in e.value.body["message"]
    assert e.value.body["param"].startswith("response_format")
