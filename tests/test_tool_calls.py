"""Tool calling (mlx_redrafter.serve.tools): rendering tools into prompts and
parsing calls out of scripted model replies, whole and streamed."""

import json
import logging

import pytest

from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.llm.text import encode_prompt
from mlx_redrafter.prompts import chat_prompt_ids
from mlx_redrafter.serve.tool_calls import (
    ToolCall,
    ToolCallStream,
    finish_reason,
    ollama_message,
    openai_delta,
    openai_message,
    parse,
)
from mlx_redrafter.serve.tools import GENERIC_FORMAT, parser_format, prompt_with_tools, tool_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris"}

# One reply per format: (format, text before, the call as the model writes it, text after).
# Mistral's format has no end marker: its call runs to the end of the reply.
REPLIES = {
    "generic": (
        GENERIC_FORMAT,
        "Let me check. ",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        " Done.",
    ),
    "json_tools": (
        parser_format("json_tools"),
        "Let me check.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "\nDone.",
    ),
    "qwen3_coder": (
        parser_format("qwen3_coder"),
        "Checking: ",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        " ok",
    ),
    "function_gemma": (
        parser_format("function_gemma"),
        "Sure. ",
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
        " Bye.",
    ),
    "pythonic": (
        parser_format("pythonic"),
        "One moment <",
        '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
        "> after",
    ),
    "glm47": (
        parser_format("glm47"),
        "Hm ",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        " end",
    ),
    "mistral": (parser_format("mistral"), "Let me check.", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ""),
}


def _run(fmt, chunks, tools=None, prefill=""):
    """Events of a streamed reply, the content joined, and the calls."""
    stream = ToolCallStream(fmt, tools, prefill)
    events = [e for c in chunks for e in stream.feed(c)] + stream.finish()
    return events, "".join(e for e in events if isinstance(e, str)), stream.calls


def _summary(calls):
    return [(c.name, json.loads(c.arguments), c.index) for c in calls]


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_whole_reply_splits_content_and_call(family):
    fmt, before, call, after = REPLIES[family]
    content, calls = parse(before + call + after, fmt, [WEATHER])
    assert content == before + after
    assert _summary(calls) == [("get_weather", PARIS, 0)]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_call_split_at_every_point(family):
    fmt, before, call, after = REPLIES[family]
    text = before + call + after
    for i in range(len(text) + 1):
        events, content, calls = _run(fmt, [text[:i], text[i:]], [WEATHER])
        assert content == before + after, f"split at {i}"
        assert _summary(calls) == [("get_weather", PARIS, 0)], f"split at {i}"


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_char_by_char_stream_holds_markers_back(family):
    fmt, before, call, after = REPLIES[family]
    stream = ToolCallStream(fmt, [WEATHER])
    streamed, call_at = "", None
    for ch in before + call + after:
        for e in stream.feed(ch):
            if isinstance(e, ToolCall):
                call_at = len(streamed)
            else:
                streamed += e
                assert fmt.start not in streamed and (not fmt.end or fmt.end not in streamed)
    for e in stream.finish():
        call_at = len(streamed) if isinstance(e, ToolCall) else call_at
        streamed += e if isinstance(e, str) else ""
    assert streamed == before + after
    # The call comes as soon as its end marker is read: after the text before it, before the text after it.
    assert call_at == len(before)


@pytest.mark.parametrize(
    "family,call",
    [
        ("generic", '<tool_call>{"name": "get_weather", "arguments": {city: Paris}}</tool_call>'),
        ("json_tools", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call>'),
        ("generic", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),
        ("function_gemma", "<start_function_call>call:get_weather{city}<end_function_call>"),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ],
)
def test_malformed_call_comes_back_as_content(family, call, caplog):
    fmt = REPLIES[family][0]
    body = call[len(fmt.start) : len(call) - len(fmt.end)] if call.endswith(fmt.end) else call[len(fmt.start) :]
    for chunks in ([f"Hi {call} bye"], list(f"Hi {call} bye")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mlx_redrafter.serve.tool_calls"):
            _, content, calls = _run(fmt, chunks)
        assert calls == []
        assert content == "Hi " + body + " bye"  # no end marker in Mistral's format: " bye" is in its body
        assert fmt.start not in content
        assert any("Could not parse" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "family,text,content",
    [
        (
            "generic",
            'A <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and '
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> B',
            "A  and  B",
        ),
        (
            "json_tools",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "\n",
        ),
        ("mistral", 'A [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}get_time[ARGS]{}', "A "),
        ("pythonic", '<|tool_call_start|>[get_weather(city="Paris"), get_time()]<|tool_call_end|>', ""),
    ],
)
def test_two_calls_in_one_reply(family, text, content):
    fmt = REPLIES[family][0]
    for chunks in ([text], list(text)):
        _, got, calls = _run(fmt, chunks, [WEATHER, TIME])
        assert _summary(calls) == [("get_weather", PARIS, 0), ("get_time", {}, 1)]
        assert got == content
        assert len({c.id for c in calls}) == 2


def test_reply_ending_in_an_unclosed_call_or_a_marker_prefix():
    _, content, calls = _run(GENERIC_FORMAT, list('ok <tool_call>{"name": "get_time", "arguments": {}}'))
    assert (content, _summary(calls)) == ("ok ", [("get_time", {}, 0)])
    stream = ToolCallStream(GENERIC_FORMAT)
    assert "".join(stream.feed("x <tool")) == "x "  # "<tool" may start a marker: held back
    assert stream.finish() == ["<tool"]  # the reply ended: it was text


# --------------------------------------------------------------------------- response shapes


def test_openai_and_ollama_shapes_validate_in_the_official_clients():
    from ollama import Message as OllamaMessage
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

    _, calls = parse(REPLIES["generic"][2], GENERIC_FORMAT)
    msg = ChatCompletionMessage.model_validate(openai_message("", calls))
    assert msg.content is None and msg.tool_calls[0].type == "function"
    assert (msg.tool_calls[0].function.name, json.loads(msg.tool_calls[0].function.arguments)) == ("get_weather", PARIS)
    delta = ChoiceDelta.model_validate(openai_delta(calls[0]))
    assert delta.tool_calls[0].index == 0 and delta.tool_calls[0].id == calls[0].id
    assert ChoiceDelta.model_validate(openai_delta("text")).content == "text"
    assert OllamaMessage.model_validate(ollama_message("", calls)).tool_calls[0].function.arguments == PARIS
    assert openai_message("hi", [])["content"] == "hi" and "tool_calls" not in openai_message("hi", [])
    assert (finish_reason("stop", calls), finish_reason("length", calls), finish_reason("stop", [])) == (
        "tool_calls",
        "length",
        "stop",
    )


# --------------------------------------------------------------------------- the default model (generic format)


def test_default_model_gets_the_generic_format(default_model):
    _, tok = default_model
    assert tool_format(tok) is GENERIC_FORMAT
    r = prompt_with_tools(tok, ASK, [WEATHER])
    assert r.ids == encode_prompt(tok, r.text)
    system = r.text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    assert json.dumps(WEATHER) in system and '<tool_call>{"name": ' in system
    assert r.prefill == "" and r.text.endswith("<|im_start|>assistant\n")


def test_default_model_no_tools_is_the_plain_prompt(default_model):
    _, tok = default_model
    plain = chat_prompt_ids(tok, ASK)
    assert prompt_with_tools(tok, ASK).ids == plain
    assert prompt_with_tools(tok, ASK, [WEATHER], "none").ids == plain
    system = [{"role": "system", "content": "Be brief."}] + ASK
    r = prompt_with_tools(tok, system, [WEATHER])
    assert r.text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")


def _forced(tok, rendered) -> str:
    """The text the reply's grammar forces from its first token."""
    from mlx_redrafter.step.grammar import compile_grammar

    return tok.decode(compile_grammar(tok, rendered.grammar).matcher().forced_tokens())


def test_default_model_forced_calls_are_constrained_from_the_first_token(default_model):
    _, tok = default_model
    named = prompt_with_tools(tok, ASK, [TIME, WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.prefill == "" and named.text.endswith("<|im_start|>assistant\n")
    assert named.ids == encode_prompt(tok, named.text)
    # The grammar writes the call's opening; the model writes only the arguments.
    assert _forced(tok, named).startswith('<tool_call>{"name": "get_weather", "arguments":')
    neutral = prompt_with_tools(tok, ASK, [TIME, WEATHER], {"name": "get_weather"})  # the neutral form
    assert neutral.grammar == named.grammar
    required = prompt_with_tools(tok, ASK, [WEATHER, TIME], "required")
    assert required.prefill == "" and _forced(tok, required) == '<tool_call>{"name": "get_'
    assert prompt_with_tools(tok, ASK, [WEATHER], "none").grammar is None


def test_parallel_calls_left_unsaid_follow_the_format(default_model, tmp_path):
    """A client that does not say parallel_tool_calls gets several calls in a
    model's own tool format and one in the generic one (whose models repeat a
    call until max_tokens); a client that says so gets what it asked for."""
    _, tok = default_model
    assert prompt_with_tools(tok, ASK, [WEATHER], "required").parallel is False
    assert prompt_with_tools(tok, ASK, [WEATHER], "required", parallel_tool_calls=True).parallel is True
    assert (
        prompt_with_tools(tok, ASK, [WEATHER], "required").grammar
        == prompt_with_tools(tok, ASK, [WEATHER], "required", parallel_tool_calls=False).grammar
    )
    hermes = _template_tokenizer(tmp_path, HERMES_TEMPLATE)
    assert prompt_with_tools(hermes, ASK, [WEATHER]).parallel is True
    assert prompt_with_tools(hermes, ASK, [WEATHER], parallel_tool_calls=False).parallel is False


# MiniMax's layout, cut down: a format whose calls no grammar here constrains.
MINIMAX_TEMPLATE = """{%- for message in messages %}<{{ message.role }}>{{ message.content }}
{%- endfor %}{% if tools %}<minimax:tool_call>{% endif %}<assistant>"""


def test_unconstrained_format_prefills_a_forced_call(tmp_path, caplog):
    tok = _template_tokenizer(tmp_path, MINIMAX_TEMPLATE)
    fmt = tool_format(tok)
    assert (fmt.name, fmt.constrained) == ("minimax_m2", False)
    with caplog.at_level(logging.WARNING, logger="mlx_redrafter.serve.tool_grammar"):
        r = prompt_with_tools(tok, ASK, [WEATHER], "required")
    assert "minimax_m2 tool format cannot be constrained" in caplog.text
    assert r.grammar is None and r.prefill == "<minimax:tool_call>" and r.text.endswith(r.prefill)
    assert prompt_with_tools(tok, ASK, [WEATHER], "auto").prefill == ""
    with pytest.raises(RedrafterError, match="cannot be held to both") as e:
        prompt_with_tools(tok, ASK, [WEATHER], content={"type": "object"})
    assert e.value.param == "content"


def test_default_model_tool_history_renders_as_text(default_model):
    _, tok = default_model
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = prompt_with_tools(tok, history, [WEATHER]).text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>"
    ) in text
    assert (
        '<|im_start|>user\n<tool_response>{"name": "get_weather", "content": "22 C"}</tool_response>\n'
        '<tool_response>{"name": "get_weather", "content": "sunny"}</tool_response><|im_end|>'
    ) in text
    # Ollama's history: arguments as an object, the tool named by tool_name.
    ollama = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "22 C"},
    ]
    assert prompt_with_tools(tok, ollama, None).text == prompt_with_tools(tok, history[:3], None).text


@pytest.mark.parametrize(
    "choice,problem",
    [
        ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ("always", "not supported"),
        ({"type": "other"}, "not a function choice"),
    ],
)
def test_bad_tool_choice_is_a_redrafter_error(choice, problem):
    from mlx_redrafter.serve.tools import check_tool_choice

    with pytest.raises(RedrafterError, match=problem):
        check_tool_choice([WEATHER], choice)
    with pytest.raises(RedrafterError, match="no tools"):
        check_tool_choice(None, "required")


# --------------------------------------------------------------------------- templates with tool support

# Qwen2.5's layout, cut down: the tools in the system turn, calls in <tool_call>, results in <tool_response>.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls %}{% set tool_call = tc.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }} }
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Mistral's newer layout (name[ARGS]{...}), cut down.
MISTRAL_TEMPLATE = """
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST]{{ message.content }}[/INST]
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.role == "assistant" %}{{ message.content }}
{%- for tc in message.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}
{%- endfor %}</s>
{%- endif %}
{%- endfor %}"""


def _template_tokenizer(tmp_path, template: str):
    """A byte-level tokenizer (tests/helpers.py) with ``template`` as its chat template."""
    from helpers import byte_tokenizer

    return byte_tokenizer(tmp_path, template)


def test_hermes_template_renders_tools_and_history_itself(tmp_path):
    tok = _template_tokenizer(tmp_path, HERMES_TEMPLATE)
    fmt = tool_format(tok)
    assert (fmt.name, fmt.native) == ("json_tools", True)
    r = prompt_with_tools(tok, ASK, [WEATHER])
    assert r.text.startswith("<|im_start|>system\n# Tools\n<tools>" + json.dumps(WEATHER) + "</tools>")
    assert "You can call functions" not in r.text  # the template's words, not the generic ones
    assert r.ids == encode_prompt(tok, r.text)
    assert prompt_with_tools(tok, ASK, [WEATHER], "none").ids == chat_prompt_ids(tok, ASK)
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = prompt_with_tools(tok, history, [WEATHER]).text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"} }\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>" in text


def test_hermes_template_forced_call_and_parse(tmp_path):
    tok = _template_tokenizer(tmp_path, HERMES_TEMPLATE)
    r = prompt_with_tools(tok, ASK, [TIME, WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert r.prefill == "" and r.text.endswith("<|im_start|>assistant\n") and r.ids == encode_prompt(tok, r.text)
    assert _forced(tok, r).startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = r.stream()
    events = [e for i in range(0, len(reply), 3) for e in stream.feed(reply[i : i + 3])] + stream.finish()
    assert events == stream.calls and _summary(stream.calls) == [("get_weather", PARIS, 0)]


def test_mistral_template_forced_call_and_history(tmp_path):
    tok = _template_tokenizer(tmp_path, MISTRAL_TEMPLATE)
    fmt = tool_format(tok)
    assert (fmt.name, fmt.start, fmt.end) == ("mistral", "[TOOL_CALLS]", "")
    r = prompt_with_tools(tok, ASK, [WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert (
        r.text
        == "[AVAILABLE_TOOLS]" + json.dumps([WEATHER]) + "[/AVAILABLE_TOOLS][INST]" + ASK[0]["content"] + "[/INST]"
    )
    assert _forced(tok, r) == "[TOOL_CALLS]get_weather[ARGS]{"
    content, calls = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', r.format, r.tools, r.prefill)
    assert (content, _summary(calls)) == ("", [("get_weather", PARIS, 0)])
    history = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "abcdefghi", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "22 C"},
    ]
    assert prompt_with_tools(tok, history, None).text.endswith(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>[TOOL_RESULTS]22 C[/TOOL_RESULTS]'
    )
