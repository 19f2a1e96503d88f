"""Tool calls constrained by a grammar (mlx_redrafter.serve.tool_grammar).

For every format a grammar can express, scripted replies are fed through the
grammar's matcher and through the format's mlx-lm parser (no model): what
the format's template writes for valid calls is accepted and parses to
calls named after a tool, with arguments that validate against its schema;
invalid names and arguments, a second call when only one is allowed, and
text around forced calls are rejected. Each format is checked on a
tokenizer where its markers are special tokens and on one where they are
text. The default model then shows that greedy decoding under a tool
grammar with drafting equals plain constrained decoding.
"""

from __future__ import annotations

import json
import logging

import jsonschema_rs
import pytest

from mlx_redrafter.serve.tool_calls import parse
from mlx_redrafter.serve.tool_grammar import SYNTAXES, NotExpressible, ToolError, reply_grammar, tool_grammar
from mlx_redrafter.serve.tools import GENERIC_FORMAT, parser_format, prompt_with_tools
from mlx_redrafter.step.grammar import compile_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object (or none)
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object"}}
MARKERS = [
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<start_function_call>",
    "<end_function_call>",
    "<escape>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]


def _json(value):
    return json.dumps(value, ensure_ascii=False)  # as templates' tojson writes (llguidance takes no needless \u)


def _value(v):
    return v if isinstance(v, str) else _json(v)


# What each format's template writes for a list of (name, arguments) calls.
WRITE = {
    "generic": lambda calls: "\n".join(
        f'<tool_call>{{"name": {_json(n)}, "arguments": {_json(a)}}}</tool_call>' for n, a in calls
    ),
    "json_tools": lambda calls: "\n".join(
        f'<tool_call>\n{{"name": {_json(n)}, "arguments": {_json(a)}}}\n</tool_call>' for n, a in calls
    ),
    "qwen3_coder": lambda calls: "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    ),
    "glm47": lambda calls: "\n".join(
        f"<tool_call>{n}"
        + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>" for k, v in a.items())
        + "\n</tool_call>"
        for n, a in calls
    ),
    "function_gemma": lambda calls: "".join(
        f"<start_function_call>call:{n}{{"
        + ",".join(f"{k}:<escape>{v}<escape>" if isinstance(v, str) else f"{k}:{_json(v)}" for k, v in a.items())
        + "}<end_function_call>"
        for n, a in calls
    ),
    "pythonic": lambda calls: (
        "<|tool_call_start|>["
        + ", ".join(f"{n}(" + ", ".join(f"{k}={_json(v)}" for k, v in a.items()) + ")" for n, a in calls)
        + "]<|tool_call_end|>"
    ),
    "mistral": lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{_json(a)}" for n, a in calls),
    "mistral_json": lambda calls: "[TOOL_CALLS]" + _json([{"name": n, "arguments": a} for n, a in calls]),
}
assert set(WRITE) == set(SYNTAXES)

PARIS = ("get_weather", {"city": "Saint-Étienne, Loire", "unit": "celsius", "days": 3})
ROME = ("get_weather", {"city": "Rome"})  # the optional arguments left out
NOW = ("get_time", {})

# (tool_choice, parallel_tool_calls, text before, calls): what the grammar accepts.
VALID = [
    ("required", False, "", [PARIS]),
    ("required", False, "", [ROME]),
    ("get_weather", True, "", [PARIS, ROME]),
    ("required", True, "", [ROME, NOW]),
    ("auto", True, "No call is needed: 12 < 15 and <tool> is not a call.", []),
    ("auto", False, "Let me check.\n", [NOW]),
    ("auto", True, "", [ROME, NOW]),
]
# (tool_choice, parallel_tool_calls, text before, calls, text after): what it rejects.
INVALID = {
    "not a tool": ("required", True, "", [("get_paris", {})], ""),
    "the schema echoed": ("get_weather", True, "", [("get_weather", SCHEMAS["get_weather"])], ""),
    "required argument missing": ("required", True, "", [("get_weather", {"unit": "celsius"})], ""),
    "not in the enum": ("required", True, "", [("get_weather", {"city": "Oslo", "unit": "kelvin"})], ""),
    "a word for an integer": ("required", True, "", [("get_weather", {"city": "Oslo", "days": "three"})], ""),
    "below the minimum": ("required", True, "", [("get_weather", {"city": "Oslo", "days": 0})], ""),
    "another tool than the named one": ("get_time", True, "", [ROME], ""),
    "two calls, one allowed": ("required", False, "", [ROME, NOW], ""),
    "text before a forced call": ("required", True, "Sure. ", [ROME], ""),
    "text after the calls": ("auto", True, "", [ROME], " Done."),
}


@pytest.fixture(scope="module", params=[False, True], ids=["text markers", "special markers"])
def tokenizer(request, tmp_path_factory):
    """A byte-level tokenizer (mlx-lm's wrapper), with the formats' markers
    as special tokens or as plain text."""
    from helpers import byte_tokenizer

    return byte_tokenizer(tmp_path_factory.mktemp("tokenizer"), special_tokens=MARKERS if request.param else ())


def _format(syntax):
    if syntax == "generic":
        return GENERIC_FORMAT
    return parser_format("mistral", "mistral_json") if syntax == "mistral_json" else parser_format(syntax)


def accepts(tokenizer, lark: str, text: str) -> bool:
    """Whether the grammar takes every token of ``text`` and then the end of the reply."""
    matcher = compile_grammar(tokenizer, lark).matcher()
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.allows(t):
            return False
        matcher.consume(t)
    return matcher.allows(tokenizer.eos_token_id)


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_what_the_template_writes_is_accepted_and_parses_to_valid_calls(tokenizer, syntax):
    for choice, parallel, before, calls in VALID:
        text = before + (WRITE[syntax](calls) if calls else "")
        lark = tool_grammar(tokenizer, syntax, TOOLS, choice, parallel)
        assert accepts(tokenizer, lark, text), (choice, parallel, text, lark)
        content, parsed = parse(text, _format(syntax), TOOLS)
        assert content.strip() == before.strip(), text
        assert [(c.name, c.arguments_object()) for c in parsed] == calls, text
        for c in parsed:
            jsonschema_rs.validate(SCHEMAS[c.name], c.arguments_object())


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_names_arguments_and_extra_text_are_rejected(tokenizer, syntax, case):
    choice, parallel, before, calls, after = INVALID[case]
    text = before + WRITE[syntax](calls) + after
    assert not accepts(tokenizer, tool_grammar(tokenizer, syntax, TOOLS, choice, parallel), text), text


@pytest.mark.parametrize("syntax", ["generic", "mistral"])
def test_free_text_cannot_spell_an_opening_it_does_not_constrain(tokenizer, syntax):
    """In ``auto``, the opening marker starts a constrained call: free text
    can neither hold it as text nor end half-way through a call."""
    lark = tool_grammar(tokenizer, syntax, TOOLS, "auto")
    opening = _format(syntax).start
    assert not accepts(tokenizer, lark, f"Look: {opening} is how a call starts.")
    assert not accepts(tokenizer, lark, "Hi " + WRITE[syntax]([ROME])[:-3])
    assert accepts(tokenizer, lark, "")  # a reply may be empty


def test_content_schema_takes_the_place_of_free_text(tokenizer):
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    lark = tool_grammar(tokenizer, "generic", TOOLS, "auto", content=answer)
    assert accepts(tokenizer, lark, '{"answer": "18 C"}')
    assert accepts(tokenizer, lark, WRITE["generic"]([ROME]))
    assert not accepts(tokenizer, lark, "It is 18 C.")
    assert not accepts(tokenizer, lark, '{"reply": "18 C"}')


NOT_EXPRESSIBLE = [
    ("qwen3_coder", {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}}, "pattern"),
    ("glm47", {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {}}}, "$defs"),
    ("function_gemma", {"type": "object", "properties": {"tags": {"type": "array"}}}, "not a string or a scalar"),
    ("pythonic", {"type": "object", "properties": {"class": {"type": "string"}}}, "not a Python identifier"),
    (
        "qwen3_coder",
        {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
        "one JSON type",
    ),
]


@pytest.mark.parametrize("syntax,params,why", NOT_EXPRESSIBLE, ids=[n[2] for n in NOT_EXPRESSIBLE])
def test_what_a_format_cannot_spell_falls_back_to_parsing(tokenizer, syntax, params, why, caplog):
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(NotExpressible, match=why.replace("$", r"\$")):
        tool_grammar(tokenizer, syntax, [tool], "required")
    fmt = _format(syntax)
    with caplog.at_level(logging.WARNING, logger="mlx_redrafter.serve.tool_grammar"):
        assert reply_grammar(tokenizer, fmt, [tool], "required") is None
    assert "parsed, not constrained" in caplog.text and why in caplog.text
    with pytest.raises(ToolError) as e:  # a content schema cannot be kept without the grammar
        reply_grammar(tokenizer, fmt, [tool], "auto", content="json")
    assert e.value.param == "content"
    # JSON-argument formats take any schema llguidance compiles
    assert reply_grammar(tokenizer, GENERIC_FORMAT, [tool], "required").startswith("start:")


def test_what_llguidance_does_not_implement_is_left_unenforced(tokenizer, caplog):
    """A tool whose schema uses a keyword llguidance lacks still gets its
    calls constrained (the rest of the schema), with a warning, instead of a
    400 on every request that sends it."""
    link = {
        "type": "function",
        "function": {
            "name": "open_link",
            "parameters": {
                "type": "object",
                "properties": {"url": {"type": "string", "format": "uri-reference"}},
                "required": ["url"],
            },
        },
    }
    with caplog.at_level(logging.WARNING, logger="mlx_redrafter.serve.tool_grammar"):
        lark = tool_grammar(tokenizer, "generic", [link], "required")
    assert "'open_link'" in caplog.text and "uri-reference" in caplog.text
    assert accepts(tokenizer, lark, WRITE["generic"]([("open_link", {"url": "a b/c?d"})]))
    assert not accepts(tokenizer, lark, WRITE["generic"]([("open_link", {"link": "x"})]))


def test_bad_tool_schemas_and_choices_are_tool_errors(tokenizer):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    with pytest.raises(ToolError, match="parameters of the tool 'f'") as e:
        reply_grammar(tokenizer, GENERIC_FORMAT, [bad], "auto")
    assert e.value.param == "tools"
    with pytest.raises(ToolError) as e:
        reply_grammar(tokenizer, GENERIC_FORMAT, None, "none", content={"type": "strin"})
    assert e.value.param == "content"
    assert reply_grammar(tokenizer, GENERIC_FORMAT, None, "none", content="json") == "json"
    with pytest.raises(ToolError, match="is not a JSON Schema object"):
        reply_grammar(
            tokenizer, GENERIC_FORMAT, [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto"
        )
    # A name holding the format's end marker would end the call early: parsed only.
    marked = {"type": "function", "function": {"name": "f</tool_call>"}}
    assert reply_grammar(tokenizer, GENERIC_FORMAT, [marked], "auto") is None


# --------------------------------------------------------------------------- the default model


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize("choice,parallel", [("required", False), ({"name": "get_weather"}, True), ("auto", True)])
def test_default_model_greedy_under_drafting_equals_constrained_plain_decoding(default_model, choice, parallel):
    from helpers import assert_exact_under_drafting

    from mlx_redrafter.config import DraftConfig
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.runtime import shipped_drafter_path

    llm, tok = default_model
    r = prompt_with_tools(tok, ASK, [CITY, TIME], choice, parallel)
    assert r.prefill == "" and r.grammar.startswith("start:")
    grammar = compile_grammar(tok, r.grammar, llm.args.vocab_size)
    draft = DraftConfig(load_drafter(shipped_drafter_path("default")), 2, 2, lookup=1)
    # Plain constrained decoding (no drafter, no lookup) against the drafted run, drafts accepted.
    drafted = assert_exact_under_drafting(llm, tok, r.ids, max_tokens=40, grammar=grammar, draft=draft, min_accepted=4)
    content, calls = parse("".join(x.text for x in drafted), r.format, r.tools)
    if choice != "auto":  # a call (calls in a row: the last may be cut by max_tokens)
        assert calls and all(c.name == "get_weather" for c in calls)
        for c in calls:
            jsonschema_rs.validate(CITY["function"]["parameters"], c.arguments_object())
        assert drafted[-1].finish_reason == "length" or not content.strip()
        if not parallel:
            assert len(calls) == 1 and drafted[-1].finish_reason == "stop"
