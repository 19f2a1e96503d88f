"""What ``serve`` does with request fields it accepts but cannot act on, shared
by the agent APIs (Anthropic's Messages, OpenAI's Responses).

Coding agents send fields that carry bookkeeping (``metadata``,
``client_metadata``), hints for a hosted service (``cache_control``,
``prompt_cache_key``, ``output_config.effort``) or ask for features of models
that think (``thinking``, ``reasoning``). Refusing them would refuse the
agents; ignoring them silently would hide it. So each such field is accepted
and named once in the server's log with the reason it has no effect here
(:func:`note_once`), and docs/server.md lists every field of each API as
honoured, accepted with no effect, or refused.

Built-in tools the API's own servers run (``web_search``, ``code_execution``,
...) cannot run here: they are left out of the prompt, with a log line
(:func:`hosted_tool`), because such a tool is one the model may use, never
one the client relies on: the reply it gets is the model's answer without a
search, as from a model that chose not to search. A client that forces one
(``tool_choice`` naming it) is refused, as the choice names no tool left.

A ``system`` message inside the conversation is rendered in its place. A
chat template that refuses it there (some allow a system message only
first) gets it folded into the user turn beside it (:func:`fold_system`):
the words stay in their place in the conversation, and the log says so once.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Set, Tuple
from weakref import WeakKeyDictionary

log = logging.getLogger(__name__)

# Built-in tool types of each API that its own servers run (Anthropic's carry a date: web_search_20250305).
HOSTED_TOOLS = {
    "Anthropic Messages": ("web_search", "web_fetch", "code_execution", "tool_search_tool"),
    "Responses": (
        "web_search",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
    ),
}

_SEEN: "WeakKeyDictionary[object, Set[Tuple[str, ...]]]" = WeakKeyDictionary()


def log_once(server, key: Tuple[str, ...], message: str) -> None:
    """Log ``message`` the first time ``key`` comes up on ``server`` (the engine behind the app)."""
    seen = _SEEN.setdefault(server, set())
    if key not in seen:
        seen.add(key)
        log.warning("%s (Logged once.)", message)


def note_once(server, api: str, field: str, why: str) -> None:
    """Log, once per server, that ``api``'s ``field`` was accepted and has no effect here, and ``why``."""
    log_once(server, (api, field), f"{api}: '{field}' is accepted and has no effect here: {why}.")


def hosted_tool(server, api: str, kind: Optional[str], where: str) -> bool:
    """Whether a tool of type ``kind`` is one of ``api``'s hosted tools: then
    it is left out of the prompt, and the log says so (once per type)."""
    if not kind or not kind.startswith(HOSTED_TOOLS[api]):
        return False
    note_once(
        server,
        api,
        f"{where} ({kind})",
        "hosted tools run on the API's own servers; this one is left out of the prompt, "
        "so the model answers without it",
    )
    return True


def fold_system(messages: Sequence[dict]) -> Optional[List[dict]]:
    """``messages`` with each system message after the conversation began
    folded into the user turn before it (else the one after it, else made a
    user turn); None when there is none to fold."""
    start = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if not any(m.get("role") == "system" for m in messages[start:]):
        return None
    out: List[dict] = [dict(m) for m in messages[:start]]
    pending: List[str] = []  # system text waiting for the next user turn
    for m in messages[start:]:
        if m.get("role") == "system":
            if out and out[-1].get("role") == "user" and not pending:
                out[-1]["content"] = _joined(out[-1].get("content"), m.get("content"))
            else:
                pending.append(m.get("content") or "")
            continue
        m = dict(m)
        if m.get("role") == "user" and pending:
            m["content"] = _joined("\n\n".join(pending), m.get("content"))
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _joined(a: Optional[str], b: Optional[str]) -> str:
    return "\n\n".join(s for s in (a or "", b or "") if s)
