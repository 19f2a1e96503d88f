"""``mlx-redrafter chat``: a multi-turn chat that reuses its KV cache and shows why it is fast.

:class:`ChatSession` holds the conversation, the KV cache and the statistics,
and works without a terminal (the tests drive it directly); :func:`run_chat`
is the read-reply loop around it, with rich output on a terminal and plain
lines when stdin is a pipe.

The cache contract: ``ChatSession.cached`` lists the token ids whose KV the
cache holds. Before a turn the whole conversation is templated and
tokenized; the cache is trimmed to the common prefix of the two and only the
rest is prefilled. Re-tokenizing the history (rather than appending to the
cache) keeps the cache exactly equal to what a fresh session would compute,
whatever the template does to earlier replies.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from mlx_lm.models.cache import make_prompt_cache

from .errors import RedrafterError
from .generate import DEFAULT_LENGTH, DEFAULT_WIDTH, RedrafterResponse, Tally, context_limit, stream_generate, trim_cache
from .prompts import build_messages, chat_prompt_ids, render_messages

DRAFT_STYLE = "cyan"

# --------------------------------------------------------------------------- templating


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- settings


@dataclass
class ChatSettings:
    """What ``/set`` can change during a chat."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    beam_width: int = DEFAULT_WIDTH
    beam_length: int = DEFAULT_LENGTH
    show_drafts: bool = False


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


# key: (parse, is valid, what a valid value is)
SETTABLE: Dict[str, tuple] = {
    "max_tokens": (int, lambda v: v >= 1, "an integer >= 1"),
    "temp": (_parse_float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (_parse_float, lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = off)"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (_parse_float, lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = off)"),
    "beam_width": (int, lambda v: v >= 1, "an integer >= 1"),
    "beam_length": (int, lambda v: v >= 1, "an integer >= 1"),
    "show_drafts": (_parse_bool, lambda v: True, "on or off"),
}
DRAFT_KEYS = ("beam_width", "beam_length")


def check_setting(key: str, value, name: Optional[str] = None) -> None:
    """Refuse a value outside the range of setting ``key`` (``name``: how
    the message calls it, e.g. the flag)."""
    _, valid, what = SETTABLE[key]
    if not valid(value):
        raise RedrafterError(f"{name or key} must be {what} (got {value}).")


def parse_settings(args: str, has_drafter: bool) -> dict:
    """``"beam_width=3 temp=0.7"`` -> ``{"beam_width": 3, "temp": 0.7}``, all
    validated (nothing is applied when one is wrong)."""
    changes = {}
    for item in args.split():
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not raw:
            raise RedrafterError(f"'{item}' is not key=value.", "Example: /set beam_width=3 temp=0.7")
        if key not in SETTABLE:
            raise RedrafterError(f"'{key}' is not a setting.", f"Settable: {', '.join(SETTABLE)}.")
        parse, _, what = SETTABLE[key]
        try:
            value = parse(raw)
        except ValueError:
            raise RedrafterError(f"{key} must be {what} (got {raw}).") from None
        check_setting(key, value)
        if key in DRAFT_KEYS and not has_drafter:
            raise RedrafterError(
                f"{key} has no effect: this chat decodes without a drafter.",
                "Start the chat without --no-draft, or with --drafter PATH for a model that has no shipped drafter.",
            )
        changes[key] = value
    return changes


# --------------------------------------------------------------------------- turns and totals


@dataclass
class Turn:
    """One user message and the reply to it."""

    user: str
    reply: str = ""
    tally: Tally = field(default_factory=Tally)
    prefilled_tokens: int = 0  # prompt tokens computed this turn
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache
    finish_reason: Optional[str] = None  # "stop", "length", or None when interrupted
    interrupted: bool = False
    in_context: bool = True  # False once dropped to fit the model's context

    @property
    def generation_seconds(self) -> float:
        r = self.tally.last
        return self.tally.tokens / r.generation_tps if r is not None and r.generation_tps > 0 else 0.0

    def stats(self) -> dict:
        r = self.tally.last
        return {
            "tokens": self.tally.tokens,
            "tokens_per_second": round(r.generation_tps, 2) if r is not None else 0.0,
            "tokens_per_step": round(self.tally.tokens_per_step, 3),
            "from_drafts": round(self.tally.draft_share, 3),
            "prefilled_tokens": self.prefilled_tokens,
            "reused_tokens": self.reused_tokens,
            "finish_reason": self.finish_reason,
            "interrupted": self.interrupted,
        }


@dataclass
class Totals:
    """Session totals for ``/stats`` (they survive ``/reset``)."""

    turns: int = 0
    interrupted: int = 0
    tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    generation_seconds: float = 0.0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    dropped_turns: int = 0

    def add(self, turn: Turn) -> None:
        self.turns += 1
        self.interrupted += int(turn.interrupted)
        self.tokens += turn.tally.tokens
        self.steps += turn.tally.steps
        self.drafted_tokens += turn.tally.drafted_tokens
        self.generation_seconds += turn.generation_seconds
        self.prefilled_tokens += turn.prefilled_tokens
        self.reused_tokens += turn.reused_tokens


def status_line(turn: Turn) -> str:
    """The line printed after a reply: speed and why."""
    t, r = turn.tally, turn.tally.last
    tps = r.generation_tps if r is not None else 0.0
    head = "interrupted: " if turn.interrupted else ""
    return (
        f"{head}{t.tokens} tokens, {tps:.1f} tok/s, {t.tokens_per_step:.2f} tokens/step, "
        f"{t.draft_share:.0%} from drafts | prefill {turn.prefilled_tokens} tokens "
        f"({turn.reused_tokens} reused from the cache)"
    )


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
//TEXT                send a message that starts with '/'"""


# --------------------------------------------------------------------------- the session


class ChatSession:
    """A conversation with a model: history, KV cache, settings and totals.

    ``stream_reply(text)`` streams one turn; ``reply(text)`` runs it to the
    end; ``handle_command("/...")`` runs a slash command. Notices (dropped
    turns) go to ``notify``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter=None,
        settings: Optional[ChatSettings] = None,
        system: Optional[str] = None,
        history: Sequence[tuple] = (),
        max_context: Optional[int] = None,
        notify: Optional[Callable[[str], None]] = None,
        controller=None,
        info: Optional[dict] = None,
    ):
        """``history``: earlier ``(user, assistant)`` exchanges. ``max_context``:
        keep the conversation within this many tokens (default: the model's
        context)."""
        self.model, self.tokenizer, self.drafter, self.controller = model, tokenizer, drafter, controller
        self.settings = settings or ChatSettings()
        self.system = system
        self.turns: List[Turn] = [Turn(u, a) for u, a in history]
        self.max_context = max_context or context_limit(model)
        self.notify = notify or (lambda message: None)
        self.info = info or {}
        self.totals = Totals()
        self.last_turn: Optional[Turn] = None
        self.cache = None
        self.cached: List[int] = []  # the token ids whose KV self.cache holds

    @classmethod
    def from_session(cls, s, settings: Optional[ChatSettings] = None, **kwargs) -> "ChatSession":
        """A chat on a resolved :class:`~mlx_redrafter.session.Session`
        (its beam shape wins over ``settings``)."""
        settings = settings or ChatSettings()
        settings.beam_width, settings.beam_length = s.beam_width, s.beam_length
        info = {"model": s.model_spec, "drafter": str(s.drafter_path) if s.drafter_path else None}
        return cls(s.model, s.tokenizer, s.drafter, settings, controller=s.controller, info=info, **kwargs)

    # ------------------------------------------------------------------ conversation

    @property
    def history(self) -> List[tuple]:
        """The ``(user, assistant)`` exchanges the model sees."""
        return [(t.user, t.reply) for t in self.turns if t.in_context]

    def messages(self, user: Optional[str] = None) -> List[dict]:
        return build_messages(self.system, self.history, user)

    def prompt_text(self, user: str) -> str:
        """The templated conversation with ``user`` as the next message."""
        return render_messages(self.tokenizer, self.messages(user))

    def _encode(self, messages: List[dict]) -> List[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def reset(self) -> None:
        """Start a new conversation. The cache stays: its system-message
        prefix is still valid, and the next turn trims the rest."""
        self.turns = []

    def reset_cache(self) -> None:
        """Forget the cache (the next turn prefills the whole conversation)."""
        self.cache, self.cached = None, []

    # ------------------------------------------------------------------ context

    def _margin(self) -> int:
        # A verification briefly puts the drafted tokens behind the last one.
        return self.settings.beam_length + 1 if self.drafter is not None else 0

    def _fit_context(self, user: str) -> tuple:
        """``(prompt ids, max_tokens)`` for the next turn, dropping the oldest
        turns while the conversation and the reply would not fit."""
        ids = self._encode(self.messages(user))
        limit, want = self.max_context, self.settings.max_tokens
        if not limit:
            return ids, want
        alone = self._encode(build_messages(self.system, [], user))
        if limit - len(alone) - self._margin() < 1:
            raise RedrafterError(
                f"This message takes {len(alone)} tokens with the template, and the context holds {limit}.",
                "Send a shorter message.",
            )
        dropped = 0
        while len(ids) + want + self._margin() > limit and self.history:
            next(t for t in self.turns if t.in_context).in_context = False
            dropped += 1
            ids = self._encode(self.messages(user))
        if dropped:
            self.totals.dropped_turns += dropped
            self.notify(
                f"Dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} from the model's view: "
                f"the conversation outgrew the context ({limit} tokens, keeping room for a "
                f"{want}-token reply)."
            )
        return ids, min(want, limit - len(ids) - self._margin())

    # ------------------------------------------------------------------ the cache

    def _reuse_cache(self, ids: List[int]) -> int:
        """Trim the cache to its common prefix with ``ids``; return its length."""
        # stream_generate needs at least one prompt token to produce logits.
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)
        self.cached = []  # unknown until the turn ends
        if self.cache is None or not trim_cache(self.cache, keep):
            self.cache, keep = make_prompt_cache(self.model), 0
        return keep

    def _settle_cache(self, known: List[int]) -> None:
        """After a turn: the cache holds a prefix of ``known`` (prompt + reply
        tokens), sometimes missing the last token or holding a few accepted
        drafts past EOS (stream_generate's contract); trim it to what we know."""
        held = min(self.cache[0].offset, len(known))
        if trim_cache(self.cache, held):
            self.cached = known[:held]
        else:
            self.reset_cache()

    # ------------------------------------------------------------------ a turn

    def stream_reply(self, text: str) -> Iterator[RedrafterResponse]:
        """Stream the reply to ``text`` and add the turn to the conversation.

        Closing the stream early or a ``KeyboardInterrupt`` ends the turn as
        interrupted: the partial reply stays in the conversation (unless it
        is empty) and the cache is dropped, so the next turn continues
        exactly as a fresh session with the same history would.
        """
        ids, max_tokens = self._fit_context(text)
        turn = self.last_turn = Turn(text)
        s = self.settings
        generated: List[int] = []
        eos: List[int] = []  # the EOS that ended the reply: its KV may be in the cache
        try:
            reused = self._reuse_cache(ids)
            turn.reused_tokens, turn.prefilled_tokens = reused, len(ids) - reused
            for r in stream_generate(
                self.model, self.tokenizer, ids[reused:], drafter=self.drafter,
                beam_width=s.beam_width, beam_length=s.beam_length, max_tokens=max_tokens,
                temp=s.temp, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k,
                prompt_cache=self.cache, controller=self.controller,
            ):
                if r.generation_tokens > turn.tally.tokens:
                    generated.append(r.token)
                else:  # the EOS response emits no token
                    eos = [r.token]
                turn.tally.add(r)
                turn.reply += r.text
                turn.finish_reason = r.finish_reason
                yield r
        except (KeyboardInterrupt, GeneratorExit):
            if turn.finish_reason is not None:  # stopped after the last response: complete
                self._settle_cache(ids + generated + eos)
            else:
                turn.interrupted = True
                # The cache may hold part of a verification: rebuild it next turn.
                self.reset_cache()
            self._record(turn)
            raise
        except BaseException:
            self.reset_cache()
            raise
        self._settle_cache(ids + generated + eos)
        self._record(turn)

    def _record(self, turn: Turn) -> None:
        self.totals.add(turn)
        if turn.reply or not turn.interrupted:
            self.turns.append(turn)

    def reply(self, text: str, on_response: Optional[Callable[[RedrafterResponse], None]] = None) -> Turn:
        """Run one turn to the end (``on_response`` sees each response) and
        return it. Ctrl-C stops the reply and returns the interrupted turn."""
        self.last_turn = None
        stream = self.stream_reply(text)
        try:
            for r in stream:
                if on_response is not None:
                    on_response(r)
        except KeyboardInterrupt:
            # stream_reply recorded the turn as interrupted, unless it was
            # stopped before the turn began (while templating).
            if self.last_turn is None:
                self.last_turn = Turn(text, interrupted=True)
        finally:
            stream.close()
        return self.last_turn

    # ------------------------------------------------------------------ commands

    def handle_command(self, line: str) -> CommandResult:
        """Run a slash command (``line`` starts with ``/``)."""
        name, _, args = line.strip().partition(" ")
        handler = {
            "/help": self._cmd_help, "/reset": self._cmd_reset, "/stats": self._cmd_stats,
            "/set": self._cmd_set, "/system": self._cmd_system, "/save": self._cmd_save,
            "/quit": self._cmd_quit, "/exit": self._cmd_quit,
        }.get(name.lower())
        if handler is None:
            return CommandResult(f"Unknown command {name}. /help lists the commands.", error=True)
        try:
            return handler(args.strip())
        except RedrafterError as e:
            return CommandResult(str(e), error=True)

    def _cmd_help(self, args: str) -> CommandResult:
        return CommandResult(HELP.format(keys=", ".join(SETTABLE)))

    def _cmd_reset(self, args: str) -> CommandResult:
        self.reset()
        return CommandResult("New conversation.")

    def _cmd_quit(self, args: str) -> CommandResult:
        return CommandResult(quit=True)

    def _cmd_stats(self, args: str) -> CommandResult:
        return CommandResult(self.stats_text())

    def _cmd_set(self, args: str) -> CommandResult:
        if not args:
            return CommandResult(" ".join(f"{k}={v}" for k, v in asdict(self.settings).items()))
        changes = parse_settings(args, self.drafter is not None)
        for k, v in changes.items():
            setattr(self.settings, k, v)
        return CommandResult("set " + " ".join(f"{k}={v}" for k, v in changes.items()))

    def _cmd_system(self, args: str) -> CommandResult:
        if not args:
            shown = self.system if self.system else "(none: the model's template default)"
            return CommandResult(f"system: {shown}")
        self.system = None if args == "-" else args
        return CommandResult("System message removed." if self.system is None else "System message set.")

    def _cmd_save(self, args: str) -> CommandResult:
        if not args:
            raise RedrafterError("/save needs a file name.", "Example: /save chat.md or /save chat.json")
        path = Path(args).expanduser()
        if path.suffix.lower() not in (".md", ".markdown", ".json"):
            raise RedrafterError(f"Cannot tell the format of '{args}'.", "Use a .md (Markdown) or .json file name.")
        text = self.to_json() if path.suffix.lower() == ".json" else self.to_markdown()
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise RedrafterError(f"Cannot write {path}: {e.strerror}.", "Check the folder exists and is writable.")
        return CommandResult(f"Saved {len(self.turns)} turns to {path}.")

    # ------------------------------------------------------------------ reports

    def stats_text(self) -> str:
        t = self.totals
        tps = t.tokens / t.generation_seconds if t.generation_seconds > 0 else 0.0
        reuse = t.reused_tokens / max(t.reused_tokens + t.prefilled_tokens, 1)
        if self.drafter is None:
            how = "plain decoding (no drafter)"
        else:
            how = f"ReDrafter W={self.settings.beam_width} L={self.settings.beam_length}"
        lines = [
            f"turns: {t.turns} ({t.interrupted} interrupted, {t.dropped_turns} dropped to fit the context)",
            f"generated: {t.tokens} tokens in {t.steps} steps, {tps:.1f} tok/s",
            f"tokens/step: {t.tokens / max(t.steps, 1):.2f}, from accepted drafts: "
            f"{t.drafted_tokens / max(t.tokens, 1):.0%}",
            f"prefill: {t.prefilled_tokens} tokens computed, {t.reused_tokens} reused from the cache ({reuse:.0%})",
            f"decoding: {how}, temp {self.settings.temp:g}",
        ]
        return "\n".join(lines)

    def to_json(self) -> str:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            messages.append({"role": "user", "content": t.user})
            messages.append({"role": "assistant", "content": t.reply, "in_context": t.in_context, "stats": t.stats()})
        data = {**self.info, "settings": asdict(self.settings), "messages": messages, "totals": asdict(self.totals)}
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"

    def to_markdown(self) -> str:
        out = ["# Chat transcript", ""]
        for k, v in self.info.items():
            out.append(f"- {k}: {v if v is not None else 'none'}")
        if self.system:
            out += ["", f"**System:** {self.system}"]
        for t in self.turns:
            out += ["", "## User", "", t.user, "", "## Assistant", "", t.reply, "", f"*{status_line(t)}*"]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the terminal loop


class _Output:
    """Where the chat writes: rich on a terminal, plain lines for a pipe."""

    def __init__(self, interactive: bool):
        from rich.console import Console

        self.interactive = interactive
        self.console = Console(highlight=False)

    def token(self, r: RedrafterResponse, show_drafts: bool) -> None:
        if self.interactive:
            style = DRAFT_STYLE if show_drafts and r.from_draft else None
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


def _read_line(interactive: bool) -> str:
    """The next input line; ``EOFError`` at the end."""
    if interactive:
        return input(">>> ")
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def run_chat(chat: ChatSession, interactive: Optional[bool] = None) -> int:
    """The read-reply loop. ``interactive`` (default: stdin is a terminal)
    adds a prompt, colours and Ctrl-C handling; otherwise stdin is read line
    by line, replies go to stdout and status lines to stderr."""
    interactive = sys.stdin.isatty() if interactive is None else interactive
    out = _Output(interactive)
    chat.notify = out.notice
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        # Ctrl-C must interrupt a reply even when started with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out.console.print("[dim]Type a message. /help lists commands; Ctrl-C stops a reply; Ctrl-D exits.[/dim]")
        if chat.settings.show_drafts and chat.drafter is not None:
            out.console.print(f"[dim]Tokens from accepted drafts are shown in [{DRAFT_STYLE}]{DRAFT_STYLE}[/{DRAFT_STYLE}].[/dim]")
    while True:
        try:
            line = _read_line(interactive)
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
            if text.startswith("/") and not text.startswith("//"):
                res = chat.handle_command(text)
                out.result(res)
                if res.quit:
                    return 0
                continue
            text = text[1:] if text.startswith("//") else text
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
