"""The chat's core: a conversation with a model, its KV cache and its totals.

:class:`ChatSession` works without a terminal (the tests drive it
directly); :func:`~mlx_redrafter.chat.terminal.run_chat` is the read-reply
loop around it and :mod:`~mlx_redrafter.chat.commands` its slash commands
and transcripts. Each turn hands the engine one
:class:`~mlx_redrafter.config.DraftConfig` (the runtime's, with ``/set``'s
beam shape and lookup beams) and the settings' :class:`SamplingConfig`.

The cache contract: ``ChatSession.cached`` lists the token ids whose KV the
cache holds. Before a turn the whole conversation is templated and
tokenized; the cache is trimmed to the common prefix of the two and only the
rest is prefilled. Re-tokenizing the history (rather than appending to the
cache) keeps the cache exactly equal to what a fresh session would compute,
whatever the template does to earlier replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

from ..config import DraftConfig, resolve
from ..errors import RedrafterError
from ..generate import stream_generate
from ..llm.parts import context_limit
from ..llm.prompt_cache import PromptCache
from ..output import RedrafterResponse, Tally
from ..prompts import build_messages, chat_prompt_ids, render_messages
from .commands import CommandResult, handle_command
from .settings import ChatSettings


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
            "from_lookup": round(self.tally.lookup_share, 3),
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
    generated: Tally = field(default_factory=Tally)  # tokens, steps and drafted tokens of every turn
    generation_seconds: float = 0.0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    dropped_turns: int = 0

    @property
    def tokens(self) -> int:
        return self.generated.tokens

    def add(self, turn: Turn) -> None:
        self.turns += 1
        self.interrupted += int(turn.interrupted)
        self.generated.merge(turn.tally)
        self.generation_seconds += turn.generation_seconds
        self.prefilled_tokens += turn.prefilled_tokens
        self.reused_tokens += turn.reused_tokens

    def as_dict(self) -> dict:
        g = self.generated
        return {
            "turns": self.turns,
            "interrupted": self.interrupted,
            "tokens": g.tokens,
            "steps": g.steps,
            "drafted_tokens": g.drafted_tokens,
            "generation_seconds": self.generation_seconds,
            "prefilled_tokens": self.prefilled_tokens,
            "reused_tokens": self.reused_tokens,
            "dropped_turns": self.dropped_turns,
        }


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
        draft: Optional[DraftConfig] = None,
        history_store=None,
    ):
        """``history``: earlier ``(user, assistant)`` exchanges. ``max_context``:
        keep the conversation within this many tokens (default: the model's
        context). ``draft``: a resolved draft (its beam shape and lookup beams
        are the settings'); else ``drafter`` and ``controller``.
        ``history_store``: a :class:`~mlx_redrafter.draft.datastore.use.History`
        that each finished reply is appended to."""
        self.model, self.tokenizer = model, tokenizer
        self.base_draft = draft or resolve(drafter, controller=controller).draft  # an EAGLE-3 drafter: its head
        self.settings = settings or ChatSettings()
        self.system = system
        self.turns: List[Turn] = [Turn(u, a) for u, a in history]
        self.max_context = max_context or context_limit(model)
        self.notify = notify or (lambda message: None)
        self.info = info or {}
        self.totals = Totals()
        self.last_turn: Optional[Turn] = None
        self.prompt_cache = PromptCache(model)
        self.store_history = history_store

    @classmethod
    def from_runtime(cls, rt, settings: Optional[ChatSettings] = None, **kwargs) -> "ChatSession":
        """A chat on a :class:`~mlx_redrafter.runtime.Runtime` (its resolved
        beam shape and lookup beams win over ``settings``)."""
        settings = settings or ChatSettings()
        (settings.beam_width, settings.beam_length), settings.lookup = rt.draft.drafter_shape, rt.lookup
        info = {"model": rt.model_spec, "drafter": str(rt.drafter_path) if rt.drafter_path else None}
        return cls(
            rt.model, rt.tokenizer, settings=settings, info=info, draft=rt.draft, history_store=rt.history, **kwargs
        )

    @property
    def drafter(self):
        return self.base_draft.drafter

    @property
    def controller(self):
        return self.base_draft.controller

    def draft(self) -> DraftConfig:
        """The draft of the next turn: the base one with the settings' beam shape and lookup beams."""
        s = self.settings
        return self.base_draft.shaped(s.beam_width, s.beam_length, s.lookup)

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
        self.prompt_cache.reset()

    @property
    def cache(self):
        """The KV cache (mlx-lm's per-layer list), ``None`` before the first turn."""
        return self.prompt_cache.cache

    @property
    def cached(self) -> List[int]:
        """The token ids whose KV :attr:`cache` holds."""
        return self.prompt_cache.ids

    # ------------------------------------------------------------------ context

    def _margin(self) -> int:
        # A verification briefly puts the drafted tokens behind the last one.
        from ..step.plan import make_plan

        return make_plan(self.model, self.draft()).margin

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

    # ------------------------------------------------------------------ a turn

    def stream_reply(self, text: str) -> Iterator[RedrafterResponse]:
        """Stream the reply to ``text`` and add the turn to the conversation.

        Closing the stream early or a ``KeyboardInterrupt`` ends the turn as
        interrupted: the partial reply stays in the conversation (unless it
        is empty), and the cache keeps the prompt and the emitted tokens, as
        after a normal reply, so the next turn reuses it.
        """
        ids, max_tokens = self._fit_context(text)
        turn = self.last_turn = Turn(text)
        s = self.settings
        generated: List[int] = []
        eos: List[int] = []  # the EOS that ended the reply: its KV may be in the cache
        stream = None
        try:
            reused = self.prompt_cache.reuse(ids)  # the tokens the cache holds (a hybrid's: prefilled by it too)
            turn.reused_tokens = self.prompt_cache.reused  # of those, what came from earlier turns
            turn.prefilled_tokens = len(ids) - turn.reused_tokens
            stream = stream_generate(
                self.model,
                self.tokenizer,
                ids[reused:],
                max_tokens=max_tokens,
                prompt_cache=self.cache,
                lookup_context=ids[:reused],
                draft=self.draft(),
                sampling=s.sampling,
            )
            for r in stream:
                if turn.tally.add(r):
                    generated.append(r.token)
                else:  # the EOS response emits no token
                    eos = [r.token]
                turn.reply += r.text
                turn.finish_reason = r.finish_reason
                yield r
        except (KeyboardInterrupt, GeneratorExit):
            turn.interrupted = turn.finish_reason is None  # else stopped after the last response
            if stream is None:  # interrupted before the generation began
                self.reset_cache()
            else:
                # Closing the step loop leaves the cache holding a prefix of the
                # prompt + the tokens verified so far, in order (the pipelined
                # loop compacts its holes, the synchronous one's extra tree rows
                # lie past the emitted tokens): trim it to what was emitted.
                stream.close()
                self.prompt_cache.settle(ids + generated + eos)
            self._record(turn)
            raise
        except BaseException:
            self.reset_cache()
            raise
        self.prompt_cache.settle(ids + generated + eos)
        self._record(turn)
        if self.store_history is not None and generated:
            self.store_history.remember(generated, turn.tally, self.base_draft.datastore, prompt=ids)

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
        return handle_command(self, line)
