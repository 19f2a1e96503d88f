"""What a request is on its way through ``serve``: its parameters
(:class:`GenParams`), the :class:`Job` the worker runs, the :class:`Piece`
of text it streams and the :class:`Result` it ends with. No model here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ..config import SamplingConfig
from ..output import Tally


@dataclass
class GenParams:
    """What a request may choose (OpenAI's names map onto these)."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    grammar: object = None  # a compiled Grammar (Engine.compile_grammar): structured output
    capped: bool = False  # max_tokens is the server's --max-tokens-cap, below what the request asked


@dataclass
class Result:
    """A finished (or cancelled) job."""

    text: str = ""
    finish_reason: Optional[str] = None  # "stop", "length", or None when cancelled
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the prompt cache
    tally: Tally = field(default_factory=Tally)
    cancelled: bool = False
    step_tokens: List[int] = field(default_factory=list)  # tokens emitted by each step
    drafted_by_source: Dict[str, int] = field(default_factory=dict)  # accepted draft tokens by source
    structured: bool = False  # the reply was constrained by a grammar
    incomplete: bool = False  # ...and ended before the grammar was complete (the JSON will not parse)
    stop_sequence: Optional[str] = None  # the stop string that ended the reply (None: EOS, max_tokens, cancelled)
    tokens: List[int] = field(default_factory=list)  # the reply's token ids (EOS not included)
    batched_tokens: int = 0  # of them, those decoded in a batch with other requests (the rest: alone, drafting)
    cut: bool = False  # the server's cap ended the reply, reported as a finished turn (serve --cap-ends-turn)

    @property
    def completion_tokens(self) -> int:
        return self.tally.tokens


@dataclass
class Piece:
    """A piece of a reply's text and how it was made: the ``x_redrafter``
    field of a streamed chunk.

    ``sources`` has one entry per token whose text is in ``text`` (a token
    may hold part of a character, so a piece can hold several): ``"drafter"``,
    ``"lookup"`` or ``"datastore"`` for a token from an accepted draft, ``"llm"`` for the
    LLM's own token. The counts are the reply's so far.
    """

    text: str
    sources: List[str]
    tokens: int = 0
    steps: int = 0
    tokens_per_second: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0

    @classmethod
    def of(cls, text: str, sources: List[str], res: "Result") -> "Piece":
        """A piece of ``res``'s reply, with its counts so far."""
        t = res.tally
        return cls(text, sources, t.tokens, t.steps, t.last.generation_tps, res.prompt_tokens, res.reused_tokens)

    def extension(self) -> dict:
        return {
            "sources": self.sources,
            "tokens": self.tokens,
            "steps": self.steps,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_reused": self.prompt_tokens_reused,
        }


def token_source(r) -> str:
    """Where a response's token came from: ``"drafter"``, ``"lookup"``, ``"datastore"`` or ``"llm"``."""
    return r.stats.source if r.from_draft else "llm"


@dataclass(eq=False)  # compared and hashed by identity: the queue keeps a set of live jobs
class Job:
    """One request: its prompt ids, its parameters, and where its output goes.

    ``emit(kind, value)`` is called from the worker thread with
    ``("text", Piece)`` per response with text, then ``("done", Result)`` or
    ``("error", exception)``.
    """

    ids: List[int]
    params: GenParams
    emit: Callable[[str, object], None]
    head: int = 0  # the first tokens every request of its kind shares (system prompt, tools): kept cached
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job at its next step (or skip it if it has not started)."""
        self.cancelled.set()


def count_response(res: Result, r) -> bool:
    """Count a response into ``res``; False for the EOS response (no token)."""
    step = res.tally.steps
    if not res.tally.add(r):
        return False
    if res.tally.steps != step:
        res.step_tokens.append(0)
    res.step_tokens[-1] += 1
    if r.from_draft:
        source = r.stats.source or "drafter"
        res.drafted_by_source[source] = res.drafted_by_source.get(source, 0) + 1
    return True
