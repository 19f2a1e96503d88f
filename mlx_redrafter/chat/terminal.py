"""``mlx-redrafter chat``: the terminal layer of the chat.

:func:`run_chat` is the read-reply loop around a
:class:`~mlx_redrafter.chat.conversation.ChatSession`, with rich output on a
terminal and plain lines when stdin is a pipe.
"""

from __future__ import annotations

import signal
import sys
from typing import Optional, Tuple

from ..errors import RedrafterError
from ..output import RedrafterResponse
from ..step.plan import asks, request_sources
from .commands import CommandResult, status_line
from .conversation import ChatSession, Turn

DRAFT_STYLE = "cyan"  # tokens from the drafter's accepted drafts
LOOKUP_STYLE = "magenta"  # tokens from accepted lookup drafts
DATASTORE_STYLE = "green"  # tokens from accepted datastore drafts (the model's past outputs)
# The stateful sources: a native MTP head, a draft model, an EAGLE-3 head, a DFlash drafter.
STYLES = {
    "lookup": LOOKUP_STYLE,
    "datastore": DATASTORE_STYLE,
    "mtp": "yellow",
    "draft-model": "bright_green",
    "eagle3": "bright_blue",
    "dflash": "bright_red",
}


NAMES = {"drafter": "drafter", "mtp": "MTP head", "draft-model": "draft model", "eagle3": "EAGLE-3 head"}
NAMES.update(dflash="DFlash drafter", lookup="lookup", datastore="datastore")


def legend(draft) -> str:
    """The colours of the sources ``draft`` drafts with, each in its colour:
    ``cyan (drafter), magenta (lookup) and ...``."""
    sources = list(dict.fromkeys(s.name for s in request_sources(draft)))  # each source's label, in the plan's order
    parts = [f"[{STYLES.get(s, DRAFT_STYLE)}]{STYLES.get(s, DRAFT_STYLE)}[/] ({NAMES.get(s, s)})" for s in sources]
    return " and ".join(filter(None, [", ".join(parts[:-1]), parts[-1] if parts else "colour"]))


# --------------------------------------------------------------------------- the terminal loop


class _Output:
    """Where the chat writes: rich on a terminal, plain lines for a pipe."""

    def __init__(self, interactive: bool):
        from rich.console import Console

        self.interactive = interactive
        self.console = Console(highlight=False)

    def token(self, r: RedrafterResponse, show_drafts: bool) -> None:
        if self.interactive:
            style = None
            if show_drafts and r.from_draft:
                style = STYLES.get(r.stats.source, DRAFT_STYLE)
            self.console.out(r.text, end="", style=style)
        else:
            sys.stdout.write(r.text)
            sys.stdout.flush()

    def end_reply(self, turn: Turn) -> None:
        if self.interactive:
            self.console.out("")
            if turn.interrupted:
                self.console.print("[yellow](interrupted)[/yellow]")
            self.console.print(f"[dim]{status_line(turn)}[/dim]", soft_wrap=True)
        else:
            print(flush=True)
            print(status_line(turn), file=sys.stderr, flush=True)

    def result(self, res: CommandResult) -> None:
        if not res.message:
            return
        if self.interactive:
            self.console.out(res.message, style="red" if res.error else None)
        elif res.error:
            print(res.message, file=sys.stderr, flush=True)
        else:
            print(res.message, flush=True)

    def notice(self, message: str) -> None:
        if self.interactive:
            self.console.out(message, style="yellow")
        else:
            print(message, file=sys.stderr, flush=True)


PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'  # opens and closes a multi-line message, as in Ollama's CLI


def _read_line(interactive: bool, prompt: str = PROMPT) -> str:
    """The next input line; ``EOFError`` at the end."""
    if interactive:
        return input(prompt)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def read_message(interactive: bool, notice) -> Tuple[str, bool]:
    """The next message and whether it can be a command: a line, a paste
    (on a terminal whose readline brackets pastes, a multi-line paste is one
    message), or a block: a line that starts with BLOCK (three double quotes)
    opens it, a line that ends with BLOCK closes it, and what lies between is
    one message, never a command. ``EOFError`` at the end; a block still open
    there is sent as it is, with a ``notice``."""
    line = _read_line(interactive)
    if not line.lstrip().startswith(BLOCK):
        return line, "\n" not in line
    first = line.lstrip()[len(BLOCK) :]
    if first.rstrip().endswith(BLOCK) and first.strip():  # opened and closed on one line
        return first.rstrip()[: -len(BLOCK)], False
    lines = [first]
    while True:
        try:
            line = _read_line(interactive, MORE)
        except EOFError:
            notice(f"(the {BLOCK} block was not closed: sent as it is)")
            break
        if line.rstrip().endswith(BLOCK):
            lines.append(line.rstrip()[: -len(BLOCK)])
            break
        lines.append(line)
    return "\n".join(lines), False


def _bracket_pastes() -> None:
    """Let a paste arrive whole: GNU readline (8.1 and later) inserts a
    bracketed paste, newlines and all, as one edit, sent by Enter (Python
    turns this off by default; libedit has no such setting)."""
    import readline

    if "libedit" not in (readline.__doc__ or ""):
        readline.parse_and_bind("set enable-bracketed-paste on")


def run_chat(chat: ChatSession, interactive: Optional[bool] = None) -> int:
    """The read-reply loop. ``interactive`` (default: stdin is a terminal)
    adds a prompt, colours and Ctrl-C handling; otherwise stdin is read line
    by line, replies go to stdout and status lines to stderr."""
    interactive = sys.stdin.isatty() if interactive is None else interactive
    out = _Output(interactive)
    chat.notify = out.notice
    if interactive:
        _bracket_pastes()  # importing readline also gives input() line editing and history
        # Ctrl-C must interrupt a reply even when started with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out.console.print(
            f"[dim]Type a message (several lines: paste them, or open and close them with {BLOCK}). "
            "/help lists commands; Ctrl-C stops a reply; Ctrl-D exits.[/dim]"
        )
        if chat.settings.show_drafts and asks(chat.draft()):
            out.console.print(f"[dim]Tokens from accepted drafts are shown in {legend(chat.draft())}.[/dim]")
    while True:
        try:
            line, may_command = read_message(interactive, out.notice)
        except EOFError:
            if interactive:
                out.console.out("")
            return 0
        except KeyboardInterrupt:
            if not interactive:
                raise
            out.console.out("\n(Ctrl-D or /quit exits)", style="dim")
            continue
        text = line.strip()
        if not text:
            continue
        try:
            if may_command and text.startswith("/") and not text.startswith("//"):
                res = chat.handle_command(text)
                out.result(res)
                if res.quit:
                    return 0
                continue
            text = text[1:] if may_command and text.startswith("//") else text
            turn = chat.reply(text, on_response=lambda r: out.token(r, chat.settings.show_drafts))
            out.end_reply(turn)
            if turn.interrupted and not interactive:
                raise KeyboardInterrupt  # a script's Ctrl-C ends it
        except RedrafterError as e:
            out.result(CommandResult(str(e), error=True))
        except KeyboardInterrupt:
            if not interactive:
                raise
            # A second Ctrl-C while a turn was being wrapped up: the cache
            # may be half-trimmed, so rebuild it next turn.
            chat.reset_cache()
            out.notice("(interrupted)")
