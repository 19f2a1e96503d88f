"""The chat's slash commands (``/set``, ``/save``, ...) and its transcripts.

Each command is a function of the :class:`~mlx_redrafter.chat.conversation.ChatSession`
it acts on, and returns a :class:`CommandResult` for the terminal layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import RedrafterError
from ..step.plan import asks
from .settings import SETTABLE, parse_settings


@dataclass
class CommandResult:
    """What a slash command has to say; ``quit`` ends the chat."""

    message: str = ""
    error: bool = False
    quit: bool = False


HELP = """\
/help                 this list
/reset                start a new conversation (keeps the system message and /stats totals)
/stats                session totals: speed, tokens/step, share from drafts, cache reuse
/set KEY=VALUE ...    change settings, e.g. /set beam_width=3 beam_length=4 temp=0.7
                      (keys: {keys}; /set alone shows them)
/system TEXT          set the system message (/system alone shows it, /system - removes it)
/save FILE            save the conversation as Markdown (.md) or JSON (.json)
/quit                 leave (Ctrl-D too); Ctrl-C stops a reply
//TEXT                send a message that starts with '/'
\"\"\"                   open a message of several lines; a line ending in \"\"\" sends it
                      (on a terminal a multi-line paste is one message too)"""


def status_line(turn) -> str:
    """The line printed after a reply: speed and why."""
    t, r = turn.tally, turn.tally.last
    tps = r.generation_tps if r is not None else 0.0
    head = "interrupted: " if turn.interrupted else ""
    speed = t.vs_plain()  # how much faster (or slower) than plain decoding, where this run measured plain steps
    return (
        f"{head}{t.tokens} tokens, {tps:.1f} tok/s, {t.tokens_per_step:.2f} tokens/step, "
        f"{t.draft_summary()}{', ' + speed if speed else ''} | prefill {turn.prefilled_tokens} tokens "
        f"({turn.reused_tokens} reused from the cache)"
    )


def handle_command(chat, line: str) -> CommandResult:
    """Run a slash command (``line`` starts with ``/``)."""
    name, _, args = line.strip().partition(" ")
    handler = {
        "/help": _cmd_help,
        "/reset": _cmd_reset,
        "/stats": _cmd_stats,
        "/set": _cmd_set,
        "/system": _cmd_system,
        "/save": _cmd_save,
        "/quit": _cmd_quit,
        "/exit": _cmd_quit,
    }.get(name.lower())
    if handler is None:
        return CommandResult(f"Unknown command {name}. /help lists the commands.", error=True)
    try:
        return handler(chat, args.strip())
    except RedrafterError as e:
        return CommandResult(str(e), error=True)


def _cmd_help(chat, args: str) -> CommandResult:
    return CommandResult(HELP.format(keys=", ".join(SETTABLE)))


def _cmd_reset(chat, args: str) -> CommandResult:
    chat.reset()
    return CommandResult("New conversation.")


def _cmd_quit(chat, args: str) -> CommandResult:
    return CommandResult(quit=True)


def _cmd_stats(chat, args: str) -> CommandResult:
    return CommandResult(stats_text(chat))


def _cmd_set(chat, args: str) -> CommandResult:
    if not args:
        return CommandResult(" ".join(f"{k}={v}" for k, v in chat.settings.as_dict().items()))
    changes = parse_settings(args, chat.drafter is not None)
    chat.settings.update(changes)
    return CommandResult("set " + " ".join(f"{k}={v}" for k, v in changes.items()))


def _cmd_system(chat, args: str) -> CommandResult:
    if not args:
        shown = chat.system if chat.system else "(none: the model's template default)"
        return CommandResult(f"system: {shown}")
    chat.system = None if args == "-" else args
    return CommandResult("System message removed." if chat.system is None else "System message set.")


def _cmd_save(chat, args: str) -> CommandResult:
    if not args:
        raise RedrafterError("/save needs a file name.", "Example: /save chat.md or /save chat.json")
    path = Path(args).expanduser()
    if path.suffix.lower() not in (".md", ".markdown", ".json"):
        raise RedrafterError(f"Cannot tell the format of '{args}'.", "Use a .md (Markdown) or .json file name.")
    text = to_json(chat) if path.suffix.lower() == ".json" else to_markdown(chat)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise RedrafterError(f"Cannot write {path}: {e.strerror}.", "Check the folder exists and is writable.")
    return CommandResult(f"Saved {len(chat.turns)} turns to {path}.")


# --------------------------------------------------------------------------- transcripts and totals


def stats_text(chat) -> str:
    """The ``/stats`` report: session totals and how they were decoded."""
    t, g = chat.totals, chat.totals.generated
    tps = g.tokens / t.generation_seconds if t.generation_seconds > 0 else 0.0
    reuse = t.reused_tokens / max(t.reused_tokens + t.prefilled_tokens, 1)
    lookup = chat.settings.lookup
    if chat.drafter is None:
        how = "lookup drafts only (no drafter)" if lookup else "plain decoding (no drafter)"
    else:
        how = f"ReDrafter W={chat.settings.beam_width} L={chat.settings.beam_length}"
        how += f" + {lookup} lookup beam{'s' if lookup > 1 else ''}" if lookup else ""
    if asks(chat.base_draft):
        how += f", tree {chat.base_draft.tree}"
    lines = [
        f"turns: {t.turns} ({t.interrupted} interrupted, {t.dropped_turns} dropped to fit the context)",
        f"generated: {g.tokens} tokens in {g.steps} steps, {tps:.1f} tok/s",
        f"tokens/step: {g.tokens_per_step:.2f}, {g.draft_summary()} (accepted), "
        f"mean tree {g.mean_tree_size:.2f} tokens verified per step",
        f"prefill: {t.prefilled_tokens} tokens computed, {t.reused_tokens} reused from the cache ({reuse:.0%})",
        f"decoding: {how}, temp {chat.settings.sampling.temp:g}",
    ]
    governed = g.governor_summary()
    lines.append(f"drafting: {governed}" if governed else "drafting: every step as asked (no live choice)")
    return "\n".join(lines)


def to_json(chat) -> str:
    """The conversation, settings and totals as JSON (``/save FILE.json``)."""
    messages = [{"role": "system", "content": chat.system}] if chat.system else []
    for t in chat.turns:
        messages.append({"role": "user", "content": t.user})
        messages.append({"role": "assistant", "content": t.reply, "in_context": t.in_context, "stats": t.stats()})
    data = {**chat.info, "settings": chat.settings.as_dict(), "messages": messages, "totals": chat.totals.as_dict()}
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def to_markdown(chat) -> str:
    """The conversation as Markdown, with the speed of each reply (``/save FILE.md``)."""
    out = ["# Chat transcript", ""]
    for k, v in chat.info.items():
        out.append(f"- {k}: {v if v is not None else 'none'}")
    if chat.system:
        out += ["", f"**System:** {chat.system}"]
    for t in chat.turns:
        out += ["", "## User", "", t.user, "", "## Assistant", "", t.reply, "", f"*{status_line(t)}*"]
    return "\n".join(out) + "\n"
