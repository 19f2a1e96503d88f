"""Tool calling for ``serve``: tools into the prompt, tool calls out of the reply.

Models whose chat template supports tools (mlx-lm's tokenizer wrapper then
names a parser from ``mlx_lm.tool_parsers``) get the tools through
``apply_chat_template(..., tools=...)`` and their replies are parsed by that
parser. Every other model (the default SmolLM2 among them) gets the
**generic format**: the tools go into the system message as JSON schemas,
with the instruction to answer a call as one line

    <tool_call>{"name": "<function name>", "arguments": {<JSON object>}}</tool_call>

which is the format of mlx-lm's ``json_tools`` parser, so that parser reads
it. In that format, earlier calls are rendered into the assistant message as
the same lines, and tool results as a user message of
``<tool_response>{"name": ..., "content": ...}</tool_response>`` lines.

The reply is constrained by a grammar (:attr:`Rendered.grammar`, see
:mod:`~mlx_redrafter.serve.tool_grammar`) in every format a grammar can
express (:attr:`ToolFormat.constrained`): a call names one of the tools and
its arguments validate against that tool's schema. ``tool_choice``
``"required"`` or a named function: calls from the reply's first token;
``"auto"``: free text until the model opens a call. In a format that cannot
be constrained, a forced call is prefilled with the call's opening (for a
named function, up to and including the name) and the reply only parsed.

The reply's calls are parsed and shaped in :mod:`~mlx_redrafter.serve.tool_calls`.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from mlx_lm.tool_parsers import json_tools

from ..llm.text import encode_prompt
from ..prompts import render_messages
from .tool_calls import ToolCallStream
from .tool_grammar import SYNTAXES, ToolError, reply_grammar

GENERIC = "generic"
GENERIC_INSTRUCTIONS = (
    "You can call functions. Their JSON schemas are listed in <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one line per call, the arguments as a JSON object:\n"
    '<tool_call>{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}</tool_call>\n'
    "The results come back in <tool_response></tool_response>."
)

# The opening of a call to {name}, as each format's template writes a call;
# a forced call is prefilled up to the name (required) or through it (named).
_OPENINGS = {
    GENERIC: '<tool_call>{{"name": "{name}", "arguments": ',
    "json_tools": '<tool_call>\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "<tool_call>\n<function={name}>\n",
    "glm47": "<tool_call>{name}",
    "function_gemma": "<start_function_call>call:{name}{{",
    "pythonic": "<|tool_call_start|>[{name}(",
    "mistral": "[TOOL_CALLS]{name}[ARGS]",
    "mistral_json": '[TOOL_CALLS][{{"name": "{name}", "arguments": ',
}

Message = Dict[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    """How one model writes tool calls.

    ``name`` is ``"generic"`` or the mlx-lm parser module's name; ``native``
    says whether the chat template renders the tools itself.
    """

    name: str
    start: str
    end: str
    parser: Callable[[str, Optional[list]], Any]
    native: bool
    opening: Optional[str] = None  # the _OPENINGS entry; None: forced calls prefill only ``start``
    syntax: Optional[str] = None  # its tool_grammar.SYNTAXES key; None: calls cannot be constrained

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains this format's calls (``/v1/models`` says it)."""
        return self.syntax is not None

    def prefill(self, function: Optional[str] = None) -> str:
        """The reply's forced opening: a call (``function=None``) or a call to ``function``."""
        if self.opening is None:
            return self.start
        if function is None:
            return self.opening.split("{name}")[0].format()
        return self.opening.format(name=function)


GENERIC_FORMAT = ToolFormat(
    GENERIC,
    json_tools.tool_call_start,
    json_tools.tool_call_end,
    json_tools.parse_tool_call,
    native=False,
    opening=_OPENINGS[GENERIC],
    syntax=GENERIC,
)


def parser_format(name: str, opening: Optional[str] = None) -> ToolFormat:
    """The format of the mlx-lm parser ``mlx_lm.tool_parsers.<name>``
    (``opening``: the _OPENINGS key, when it is not ``name``)."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    key = opening or name
    return ToolFormat(
        name,
        module.tool_call_start,
        module.tool_call_end or "",
        module.parse_tool_call,
        native=True,
        opening=_OPENINGS.get(key),
        syntax=key if key in SYNTAXES else None,
    )


def tool_format(tokenizer) -> ToolFormat:
    """The tool format of ``tokenizer``: its template's (the parser mlx-lm's
    wrapper chose from it) or the generic one."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return GENERIC_FORMAT
    name = tokenizer.tool_parser.__module__.rsplit(".", 1)[-1]
    opening = None
    if name == "mistral" and "[ARGS]" not in str(tokenizer.chat_template):
        opening = "mistral_json"  # older Mistral templates write a JSON list of calls
    return parser_format(name, opening)


# --------------------------------------------------------------------------- rendering


@dataclass
class Rendered:
    """A chat prompt with its tools: the ids to generate from (prefill
    included), and what generating and parsing the reply need.

    Parse the reply only when ``tools`` is not None (tools were rendered):
    without tools it is plain text, exactly as ``generate`` returns it.
    ``grammar``: the spec to compile (``Engine.compile_grammar``) and generate under
    (the calls' grammar, the content's schema alone, or None: free text).
    """

    ids: List[int]
    text: str
    prefill: str
    format: ToolFormat
    tools: Optional[list]  # the tools rendered; None when none
    grammar: Any = None
    parallel: bool = True  # several calls may come (prompt_with_tools's parallel_tool_calls, resolved)

    def stream(self) -> ToolCallStream:
        """A parser for the reply that follows ``ids`` (it has read the prefill)."""
        return ToolCallStream(self.format, self.tools, self.prefill)


def tool_names(tools: Optional[list]) -> List[str]:
    """The function names of OpenAI-shaped ``tools``; a :class:`ToolError` for one that is not a function."""
    names = []
    for t in tools or []:
        name = (t.get("function") or {}).get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolError(
                f"The tool {str(t)[:80]!r} is not a function with a name.",
                'Send tools as {"type": "function", "function": {"name": ..., "parameters": {...}}}.',
            )
        names.append(name)
    return names


def check_tool_choice(tools: Optional[list], tool_choice) -> Optional[str]:
    """The tool choice as ``"auto"``, ``"none"``, ``"required"`` or a function
    name; a :class:`ToolError` for one that cannot be honoured. A named
    function may come as OpenAI's chat form ``{"type": "function",
    "function": {"name": ...}}`` or with its ``name`` on top (the Responses
    API's form and the neutral ``{"name": ...}``)."""
    names = tool_names(tools)
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolError(
                f"tool_choice {tool_choice!r} is not a function choice.",
                'Use {"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        if name not in names:
            raise ToolError(
                f"tool_choice names the function {name!r}, which is not among the tools {names}.",
                "Name one of the functions sent in 'tools'.",
                "tool_choice",
            )
        return name
    if tool_choice not in ("auto", "none", "required"):
        raise ToolError(
            f"tool_choice {tool_choice!r} is not supported.",
            'Use "auto", "none", "required" or a named function.',
            "tool_choice",
        )
    if tool_choice == "required" and not names:
        raise ToolError(
            'tool_choice is "required" but no tools were sent.', "Send 'tools', or drop tool_choice.", "tool_choice"
        )
    return tool_choice


def prompt_with_tools(
    tokenizer,
    messages: Sequence[Message],
    tools: Optional[list] = None,
    tool_choice=None,
    parallel_tool_calls: Optional[bool] = None,
    content=None,
    encode: Optional[Callable[[str], List[int]]] = None,
) -> Rendered:
    """The prompt for ``messages`` and ``tools`` under ``tool_choice``
    (``"auto"``, ``"none"``, ``"required"`` or a named function, see
    :func:`check_tool_choice`), with the grammar of the reply: one call
    unless ``parallel_tool_calls`` (None: several in a model's own format,
    one in the generic format, whose models repeat a call until
    ``max_tokens``); ``content`` (a JSON Schema or
    ``"json"``, e.g. OpenAI's ``response_format``): what the reply is when
    it is not a call. ``encode``: the prompt text into ids (by default as
    ``generate`` encodes it).

    Without tools (or with ``"none"``) and without tool history, the ids are
    exactly :func:`~mlx_redrafter.prompts.chat_prompt_ids`'.
    """
    choice = check_tool_choice(tools, tool_choice)
    fmt = tool_format(tokenizer)
    shown = list(tools) if tools and choice != "none" else None
    if fmt.native:
        msgs = [_native_message(m) for m in messages]
        if shown:
            text = tokenizer.apply_chat_template(msgs, tools=shown, add_generation_prompt=True, tokenize=False)
        else:
            text = render_messages(tokenizer, msgs)
    else:
        text = render_messages(tokenizer, generic_messages(messages, shown))
    parallel = fmt.native if parallel_tool_calls is None else parallel_tool_calls
    grammar = reply_grammar(tokenizer, fmt, shown, choice, parallel, content)
    forced = choice not in ("auto", "none") and grammar is None  # unconstrained: prefill the opening
    prefill = fmt.prefill(None if choice == "required" else choice) if forced else ""
    text += prefill
    ids = encode(text) if encode is not None else list(encode_prompt(tokenizer, text))
    return Rendered(ids, text, prefill, fmt, shown, grammar, parallel)


def _arguments(args) -> Any:
    """Arguments as an object: OpenAI sends a JSON string, Ollama an object."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args  # the template shows it as it came
    return {} if args is None else args


def _history_calls(message: Message) -> List[dict]:
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function") or {}
        calls.append({**c, "function": {**f, "arguments": _arguments(f.get("arguments"))}})
    return calls


def _native_message(m: Message) -> Message:
    """A message as tool-aware templates read it (mlx-lm's conversion):
    string content, call arguments as objects."""
    out = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = _history_calls(m)
    return out


def generic_messages(messages: Sequence[Message], tools: Optional[list]) -> List[Message]:
    """``messages`` for a template without tool support: the tool schemas
    appended to the system message, calls and results written as text."""
    out: List[Message] = []
    names: Dict[str, str] = {}  # tool_call_id -> function name, for the results
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            name = m.get("tool_name") or m.get("name") or names.get(m.get("tool_call_id"), "")
            line = (
                "<tool_response>"
                + json.dumps({"name": name, "content": content}, ensure_ascii=False)
                + "</tool_response>"
            )
            if out and out[-1].get("tool_results"):  # consecutive results share one turn
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            lines = [content] if content else []
            for c in _history_calls(m):
                f = c["function"]
                names[c.get("id", "")] = f.get("name", "")
                call = {"name": f.get("name", ""), "arguments": f["arguments"]}
                lines.append(GENERIC_FORMAT.start + json.dumps(call, ensure_ascii=False) + GENERIC_FORMAT.end)
            content = "\n".join(lines)
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = GENERIC_INSTRUCTIONS.format(tools=schemas)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
