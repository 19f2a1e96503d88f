"""The grammar of a reply that may call tools (an llguidance Lark grammar).

A call's name must be one of the request's tools and its arguments must
validate against that tool's JSON Schema. Each tool format writes calls its
own way (:data:`SYNTAXES`, one per mlx-lm parser family that a grammar can
express, keyed like ``tools._OPENINGS``); the grammar spells exactly what
its parser reads:

- formats whose arguments are a JSON object (generic, ``json_tools``,
  ``mistral``, ``mistral_json``) take the tool's ``parameters`` whole as
  ``%json`` (any object for a tool without parameters);
- formats that write one argument at a time (``qwen3_coder``, ``glm47``,
  ``function_gemma``, ``pythonic``) spell each property in the schema's
  order, the required ones always, a value as JSON or, for string
  properties where the format writes raw text, as text that cannot end the
  argument early. What such a format cannot express (a name or key its
  parser would misread, a string ``pattern`` or ``format`` in raw text, a
  ``$ref``...) raises :class:`NotExpressible`, and the request's calls are
  only parsed, as before.

``choice`` ``"required"`` or ``{"name": ...}``: the reply is calls from its
first token. ``"auto"``: free text until the model writes the format's
opening marker, and from there on a call (a lazy lexeme, as llama.cpp's
server triggers its tool grammars); free text can end without a call. With
``content`` (a JSON Schema, ``"json"``), the text that is not a call is that
JSON instead. After the calls the reply ends; ``parallel`` False allows one
call, True one or more in a row. Markers that are special tokens of the
tokenizer are named as tokens (``<[id]>``).
"""

from __future__ import annotations

import json
import keyword
import logging
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import RedrafterError
from ..step.grammar import ANY_JSON, check_grammar, special_token

log = logging.getLogger(__name__)

FREE_TEXT = r"/(.|\n)*/"
_REGEX_META = set("\\.+*?()|[]{}^$/")


class ToolError(RedrafterError):
    """Tools, a tool choice or a content schema that cannot be honoured;
    ``param`` says which: ``"tools"``, ``"tool_choice"`` or ``"content"``
    (each API names its own field for the content's schema)."""

    def __init__(self, problem: str, fix: Optional[str] = None, param: str = "tools"):
        super().__init__(problem, fix)
        self.param = param


class NotExpressible(ValueError):
    """A tool the format's grammar cannot spell (the message says why)."""


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` (Rust regex syntax)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _without(text: str) -> str:
    """A terminal term: no occurrence of ``text``."""
    return f"~/(?s:.*){_regex(text)}(?s:.*)/"


class Lark:
    """Builds one grammar: its rules, and literals that are special tokens named as tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.rules: List[str] = []
        self.tool = ""  # whose schemas are being spelled (for the warnings)

    def lit(self, text: str) -> str:
        """``text`` as the grammar spells it: ``<[id]>`` for a special token, else a string."""
        if not text:
            return ""
        token = special_token(self.tokenizer, text) if self.tokenizer is not None else None
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    def is_token(self, text: str) -> bool:
        return self.lit(text).startswith("<[")

    def rule(self, body: str, terminal: bool = False, lazy: bool = False) -> str:
        """A new rule (a terminal: UPPER case; lazy: matching as little as it
        can, its body all terminals) for ``body``; returns its name."""
        name = f"{'T' if terminal else 'r'}{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def json(self, schema) -> str:
        """A ``%json`` rule for a tool's ``schema``. Keywords llguidance does
        not implement (a ``format`` it lacks, ``dependentSchemas``...) are
        left unenforced, with a warning, rather than refusing every request
        that sends the tool; a schema that is wrong raises RedrafterError."""
        schema = ANY_JSON if schema is None else schema
        if not isinstance(schema, dict):
            raise RedrafterError(f"{str(schema)[:80]!r} is not a JSON Schema object.")
        try:
            check_grammar(schema)
        except RedrafterError as strict:
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": True}}
            check_grammar(schema)  # still wrong: raises
            log.warning(
                "The tool %r's schema asks for what the grammar cannot enforce (%s); the rest is enforced.",
                self.tool,
                strict.problem,
            )
        return self.rule("%json " + json.dumps(schema, ensure_ascii=False))

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}"] + self.rules) + "\n"


# --------------------------------------------------------------------------- arguments


def _object(params) -> Tuple[dict, List[str]]:
    """The properties of a parameters schema (in order) and the required ones,
    for formats that write one argument at a time."""
    params = params or {}
    extra = set(params) - {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "title",
        "$schema",
        "strict",
    }
    if extra or params.get("type", "object") != "object":
        raise NotExpressible(f"its parameters use {sorted(extra) or params.get('type')}")
    props, required = params.get("properties") or {}, list(params.get("required") or [])
    if any(r not in props for r in required):
        raise NotExpressible("a required parameter has no schema")
    return props, required


_STRING_KEYS = {"type", "description", "title", "default", "examples", "enum", "const", "minLength", "maxLength"}


def _raw_string(lark: Lark, schema: dict, banned: Sequence[str], closing: str, extra_terms: Sequence[str] = ()) -> str:
    """A string value written as raw text, then ``closing``: the schema's
    enum or length, never ``banned`` (which holds what ends the value)."""
    if set(schema) - _STRING_KEYS:
        raise NotExpressible(f"a string parameter uses {sorted(set(schema) - _STRING_KEYS)} (raw text here)")
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if choices is not None:
        if not all(isinstance(c, str) and not any(b in c for b in banned) for c in choices):
            raise NotExpressible("a string enum holds a value this format cannot write")
        return "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + f") {lark.lit(closing)}"
    terms = ["/(?s:.*)/"] + [_without(b) for b in banned] + list(extra_terms)
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None or high is not None:
        terms.append(f"/(?s:.){{{int(low or 0)},{'' if high is None else int(high)}}}/")
    value = lark.rule(" & ".join(terms), terminal=True)
    if lark.is_token(closing):
        return f"{value} {lark.lit(closing)}"
    # One lazy lexeme for the value and its closing: a greedy value lexeme would
    # run into the closing's first bytes and, on meeting its last, die.
    return lark.rule(f"{value} {lark.lit(closing)}", lazy=True)


def _arguments(lark: Lark, params, item: Callable[[str, dict], str], sep: str = "") -> Tuple[Optional[str], bool]:
    """The properties' Lark in schema order, the optional ones may be left
    out, separated by ``sep``: ``(expression or None for no properties, may_be_empty)``."""
    props, required = _object(params)
    items = [(item(k, s if isinstance(s, dict) else {}), k in required) for k, s in props.items()]
    if not items:
        return None, True
    empty = not any(req for _, req in items)
    if not sep:  # self-delimited arguments: a plain sequence
        return " ".join(b if req else f"({b})?" for b, req in items), empty
    sep = lark.lit(sep)

    def head(i):  # items i.., the first one present without a separator, the others after one
        body, req = items[i]
        tail = " ".join(f"({sep} {b})" + ("" if r else "?") for b, r in items[i + 1 :])
        alt = f"{body} {tail}".strip()
        if req or i + 1 == len(items):
            return alt
        return f"({alt}) | ({head(i + 1)})"

    return head(0), empty


def _typed(schema: dict) -> Optional[str]:
    kind = schema.get("type")
    return kind if isinstance(kind, str) else None


def _qwen3_value(lark, schema, banned, closing):
    kind = _typed(schema)
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return _raw_string(lark, schema, banned, closing, ["~/(?i:null)/"])  # the parser reads "null" as None
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        # The parser converts by the declared type; JSON text converts back exactly.
        return f"{lark.json(schema)} {lark.lit(closing)}"
    raise NotExpressible("a parameter without one JSON type (the parser converts by type)")


# --------------------------------------------------------------------------- one call per format

NL = "\n"
_WORD = re.compile(r"^[\w-]+$")  # mistral's parser reads a name as [\w-]+
_NAME = re.compile(r"^[^\s<>]+$")  # qwen3_coder's and glm47's parsers: no spaces, no brackets
_GEMMA_NAME = re.compile(r"^\w+$")
_GEMMA_KEY = re.compile(r"^[^:,{}<\s]+$")
_PYTHON_NAME = re.compile(r"^[A-Za-z_][\w.]*$")


def _check(pattern, name: str, what: str) -> str:
    if not pattern.match(name or ""):
        raise NotExpressible(f"its {what} {name!r} cannot be written in this format")
    return name


def _json_call(newline: str) -> Callable:
    """``{"name": NAME, "arguments": ARGS}`` (generic, json_tools, mistral_json)."""

    def call(lark, name, params):
        head = newline + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return f"{lark.lit(head)} {lark.json(params)} {lark.lit('}' + newline)}"

    return call


def _mistral_call(lark, name, params):
    return f"{lark.lit(_check(_WORD, name, 'name'))} {lark.lit('[ARGS]')} {lark.json(params)}"


def _qwen3_call(lark, name, params):
    banned = ["</parameter>", "</function>", "</tool_call>"]

    def item(key, schema):
        opening = lark.lit(f"<parameter={_check(_NAME, key, 'parameter')}>{NL}")
        return f"{opening} {_qwen3_value(lark, schema, banned, NL + '</parameter>' + NL)}"

    args, _ = _arguments(lark, params, item)
    head = lark.lit(f"{NL}<function={_check(_NAME, name, 'name')}>{NL}")
    return f"{head} {args or ''} {lark.lit('</function>' + NL)}"


def _glm_call(lark, name, params):
    banned = ["</arg_value>", "</tool_call>"]
    newline = '"\\n"?'  # GLM 4.5-4.6 templates put each argument on its own line, 4.7's do not

    def item(key, schema):
        if schema.get("type") == "string":  # the parser keeps these raw, stripped
            value = _raw_string(lark, schema, banned, "</arg_value>", [r"~/\s(?s:.*)/", r"~/(?s:.*)\s/"])
        else:
            value = f"{lark.json(schema)} {lark.lit('</arg_value>')}"  # the parser reads the others as JSON
        key = json.dumps(_check(_NAME, key, "parameter"), ensure_ascii=False)
        return (
            f"{newline} {lark.lit('<arg_key>')} {key} {lark.lit('</arg_key>')} {newline} "
            f"{lark.lit('<arg_value>')} {value}"
        )

    args, _ = _arguments(lark, params, item)
    return f"{lark.lit(_check(_NAME, name, 'name'))} {args or ''} {newline}"


def _gemma_call(lark, name, params):
    escape = lark.lit("<escape>")

    def item(key, schema):
        kind = _typed(schema)
        if kind == "string":  # the parser reads <escape>...<escape>; its call ends at the first "}"
            value = f"{escape} {_raw_string(lark, schema, ['<escape>', '}'], '<escape>')}"
        elif kind in ("integer", "number", "boolean", "null"):  # read up to the next ",": scalars only
            value = lark.json(schema)
        else:
            raise NotExpressible(f"its parameter {key!r} is not a string or a scalar")
        return f"{json.dumps(_check(_GEMMA_KEY, key, 'parameter') + ':', ensure_ascii=False)} {value}"

    return _bracketed(lark, f"call:{_check(_GEMMA_NAME, name, 'name')}{{", "}", _arguments(lark, params, item, ","))


def _pythonic_call(lark, name, params):
    def item(key, schema):
        if not key.isidentifier() or keyword.iskeyword(key):
            raise NotExpressible(f"its parameter {key!r} is not a Python identifier")
        return f"{json.dumps(key + '=')} {lark.json(schema)}"  # JSON values are Python literals to the parser

    return _bracketed(lark, _check(_PYTHON_NAME, name, "name") + "(", ")", _arguments(lark, params, item, ", "))


def _bracketed(lark, left: str, right: str, arguments) -> str:
    args, empty = arguments
    inner = "" if args is None else f"({args})" + ("?" if empty else "")
    return f"{lark.lit(left)} {inner} {lark.lit(right)}"


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls: blocks ``opening ... closing`` joined by
    ``block_sep``; a block holds one call, or (``call_sep`` set) several
    calls joined by it, inside ``inner``'s brackets."""

    call: Callable  # (lark, name, parameters schema) -> the call's Lark
    opening: str
    closing: str
    block_sep: str = "\n"
    call_sep: Optional[str] = None
    inner: Tuple[str, str] = ("", "")


SYNTAXES: Dict[str, CallSyntax] = {
    "generic": CallSyntax(_json_call(""), "<tool_call>", "</tool_call>"),
    "json_tools": CallSyntax(_json_call("\n"), "<tool_call>", "</tool_call>"),
    "qwen3_coder": CallSyntax(_qwen3_call, "<tool_call>", "</tool_call>"),
    "glm47": CallSyntax(_glm_call, "<tool_call>", "</tool_call>"),
    "function_gemma": CallSyntax(_gemma_call, "<start_function_call>", "<end_function_call>", block_sep=""),
    "pythonic": CallSyntax(_pythonic_call, "<|tool_call_start|>", "<|tool_call_end|>", call_sep=", ", inner=("[", "]")),
    "mistral": CallSyntax(_mistral_call, "[TOOL_CALLS]", "", block_sep=""),
    "mistral_json": CallSyntax(_json_call(""), "[TOOL_CALLS]", "", call_sep=", ", inner=("[", "]")),
}


# --------------------------------------------------------------------------- the reply


def _name(tool: dict) -> str:
    return (tool.get("function") or {}).get("name")


def tool_grammar(tokenizer, syntax: str, tools: Sequence[dict], choice, parallel: bool = True, content=None) -> str:
    """The Lark grammar of a reply to ``tools`` in format ``syntax`` (a
    :data:`SYNTAXES` key) under ``choice`` (``"auto"``, ``"required"`` or a
    tool's name). :class:`NotExpressible` when the format cannot spell a tool."""
    s, lark = SYNTAXES[syntax], Lark(tokenizer)
    chosen = [t for t in tools if choice in ("auto", "required") or _name(t) == choice]
    calls = []
    for t in chosen:
        lark.tool = _name(t)
        if s.opening in lark.tool or (s.closing and s.closing in lark.tool):
            raise NotExpressible(f"The tool {lark.tool!r} holds the {syntax} format's markers.")
        try:
            calls.append(s.call(lark, lark.tool, (t.get("function") or {}).get("parameters")))
        except NotExpressible as e:
            raise NotExpressible(f"The tool {lark.tool!r} cannot be constrained in the {syntax} format: {e}.") from None
        except RedrafterError as e:  # a schema llguidance refuses even leniently
            raise ToolError(f"The parameters of the tool {lark.tool!r}: {e.problem}", e.fix, "tools") from None
    call = lark.rule(" | ".join(f"({c})" for c in calls))
    body = call
    if s.call_sep is not None:
        more = f"({lark.lit(s.call_sep)} {call})*" if parallel else ""
        body = f"{lark.lit(s.inner[0])} {call} {more} {lark.lit(s.inner[1])}"
    block_rest = lark.rule(f"{body} {lark.lit(s.closing)}")  # a block after its opening
    opening = lark.lit(s.opening)
    more = f"({lark.lit(s.block_sep)} {opening} {block_rest})*" if parallel and s.call_sep is None else ""
    calls_rest = lark.rule(f"{block_rest} {more}")
    if choice != "auto":
        return lark.text(f"{opening} {calls_rest}")
    if content is not None:  # no free text: the content is the JSON asked for, or calls
        return lark.text(f"{lark.json(ANY_JSON if content == 'json' else content)} | {opening} {calls_rest}")
    if lark.is_token(s.opening):  # free text cannot hold the special token; nor may it spell its text
        text = lark.rule(f"/(?s:.*)/ & {_without(s.opening)}", terminal=True)
        return lark.text(f"{text} | {text} {opening} {calls_rest}")
    text = lark.rule(FREE_TEXT, terminal=True)
    trigger = f"trigger{len(lark.rules)}"
    lark.rules.append(f"{trigger}[lazy]: {text} {opening}")  # free text ends at the first opening
    return lark.text(f"{text} | {trigger} {calls_rest}")


def _checked(spec, param: str) -> None:
    """A :class:`ToolError` at ``param`` for a schema llguidance refuses."""
    try:
        check_grammar(spec)
    except RedrafterError as e:
        raise ToolError(e.problem, e.fix, param) from None


def reply_grammar(tokenizer, fmt, tools: Optional[list], choice: str, parallel: bool = True, content=None):
    """The grammar spec of a reply (see :func:`~mlx_redrafter.serve.tools.prompt_with_tools`): the content's
    schema alone without tools; None in a format (or for a tool) that a
    grammar cannot express, where the calls are parsed only (logged), unless
    a content schema was asked for too (a :class:`ToolError`)."""
    if content is not None:
        _checked(content, "content")
    if not tools:
        return content
    try:
        if fmt.syntax is None:
            raise NotExpressible(f"The {fmt.name} tool format cannot be constrained by a grammar.")
        return tool_grammar(tokenizer, fmt.syntax, tools, choice, parallel, content)
    except NotExpressible as e:
        if content is not None:
            raise ToolError(
                f"{e} So the reply cannot be held to both the tools and the content's schema.",
                "Drop the schema (response_format) or the tools.",
                "content",
            ) from None
        log.warning("%s Its calls are parsed, not constrained.", e)
        return None
