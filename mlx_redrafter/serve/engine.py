"""The core of ``mlx-redrafter serve``: one model, a fair bounded queue of
requests, and the KV caches that requests share.

No HTTP here (that is :mod:`~mlx_redrafter.serve.app`, a thin layer on top):
:class:`Engine` turns token ids into a :class:`Job`, runs jobs one at a time
on its worker thread, and reports each job's text through the job's
``emit`` callback.

The KV caches stay from one request to the next
(:class:`~mlx_redrafter.llm.cache.PromptCache`, on mlx-lm's
``LRUPromptCache``): a request whose ids share a prefix with a cached
sequence prefills only the rest, so a follow-up turn of a conversation costs
only its new tokens, even when other conversations came in between. Every job runs the runtime's one
resolved :class:`~mlx_redrafter.config.DraftConfig` with the job's own
:class:`~mlx_redrafter.config.SamplingConfig`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..config import SamplingConfig
from ..errors import RedrafterError
from ..generate import stream_generate
from ..llm.cache import PromptCache
from ..llm.parts import context_limit
from ..llm.text import encode_prompt
from ..prompts import chat_prompt_ids
from ..responses import Tally
from .tools import Rendered, render, tool_format
from ..step.grammar import compile_for_model


class QueueFull(Exception):
    """The queue holds its bound of waiting requests."""


@dataclass
class GenParams:
    """What a request may choose (OpenAI's names map onto these)."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    grammar: object = None  # a compiled Grammar (Engine.grammar): structured output


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

    def extension(self) -> dict:
        return {"sources": self.sources, "tokens": self.tokens, "steps": self.steps,
                "tokens_per_second": round(self.tokens_per_second, 2), "prompt_tokens": self.prompt_tokens,
                "prompt_tokens_reused": self.prompt_tokens_reused}


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
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job at its next step (or skip it if it has not started)."""
        self.cancelled.set()


class JobQueue:
    """First come, first served, on one worker thread, with at most ``size``
    requests waiting (the one running not counted)."""

    def __init__(self, handler: Callable[[Job], "Result"], size: int):
        if size < 1:
            raise RedrafterError(f"The queue size must be at least 1 (got {size}).")
        self.handler, self.size = handler, size
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = False
        self.served = 0
        self.cancelled = 0
        self._live: set = set()  # submitted and not finished
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``size`` requests wait already."""
        with self._lock:
            if self.waiting >= self.size:
                raise QueueFull(f"{self.waiting} requests are waiting for the model (the bound is {self.size}).")
            self.waiting += 1
            self._live.add(job)
        self._queue.put(job)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="redrafter-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job (the running one stops at its next step) and end the worker."""
        with self._lock:
            for job in self._live:
                job.cancel()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running = True
            res = None
            try:
                if job.cancelled.is_set():  # its client left while it waited
                    res = Result(cancelled=True)
                    job.emit("done", res)
                else:
                    res = self.handler(job)
            except BaseException as e:  # the worker must survive any request
                try:
                    job.emit("error", e)
                except Exception:
                    pass  # nobody is listening any more (the server is stopping)
            finally:
                with self._lock:
                    self._live.discard(job)
                    self.running = False
                    self.served += 1
                    self.cancelled += int(res is not None and res.cancelled)

    def status(self) -> dict:
        with self._lock:
            return {"waiting": self.waiting, "running": self.running, "bound": self.size,
                    "served": self.served, "cancelled": self.cancelled}


class Engine:
    """A :class:`~mlx_redrafter.runtime.Runtime` served one request at a time,
    with prompt caches shared across requests (at most ``prompt_cache_size``
    sequences and ``prompt_cache_bytes`` bytes). ``max_tokens`` and
    ``sampling``: what a request that does not say gets. ``listeners`` are
    called on the worker thread with every job's :class:`Result` (metrics)."""

    def __init__(self, runtime, max_tokens: int = 512, sampling: Optional[SamplingConfig] = None,
                 queue_size: int = 16, prompt_cache_size: int = 10, prompt_cache_bytes: int = 1 << 63):
        self.rt = runtime
        self.model_id = runtime.model_spec
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingConfig()
        self.cache = PromptCache(runtime.model, prompt_cache_size, prompt_cache_bytes)
        self.queue = JobQueue(self._run, queue_size)
        self.listeners: List[Callable[[Result], None]] = []

    # ------------------------------------------------------------------ prompts

    def chat_ids(self, messages: List[dict]) -> List[int]:
        """Token ids of ``messages`` through the chat template, exactly as
        ``mlx-redrafter generate`` encodes its prompt."""
        return chat_prompt_ids(self.rt.tokenizer, messages)

    def render(self, messages: Sequence[dict], tools: Optional[list] = None, tool_choice=None, **options) -> Rendered:
        """``messages`` and ``tools`` through the chat template (see
        :func:`~mlx_redrafter.serve.tools.render`, which takes ``options``);
        without tools the ids are :meth:`chat_ids`'."""
        return render(self.rt.tokenizer, messages, tools, tool_choice, **options)

    def text_ids(self, prompt: str) -> List[int]:
        return encode_prompt(self.rt.tokenizer, prompt)

    def card(self) -> dict:
        """What ``/v1/models`` says of the model beside its id (whether a
        grammar constrains its tool calls: ``tool_calls_constrained``)."""
        fmt = tool_format(self.rt.tokenizer)
        return {"context_length": context_limit(self.rt.model) or None, "tools": True,
                "tool_format": fmt.name, "tool_calls_constrained": fmt.constrained}
    def grammar(self, spec):
        """``spec`` (a JSON Schema, ``"json"``...) compiled for the model; a
        :class:`RedrafterError` names what is wrong with it."""
        return compile_for_model(self.rt.model, self.rt.tokenizer, spec)

    def _margin(self) -> int:
        # A verification briefly puts the drafted tokens behind the last one.
        return self.rt.draft.margin

    def fit(self, ids: List[int], max_tokens: int) -> int:
        """``max_tokens`` cut to what the context leaves after the prompt;
        a :class:`RedrafterError` when the prompt alone does not fit."""
        if not ids:
            raise RedrafterError("The prompt is empty.", "Send at least one token of prompt.")
        limit = context_limit(self.rt.model)
        if not limit:
            return max_tokens
        room = limit - len(ids) - self._margin()
        if room < 1:
            raise RedrafterError(
                f"The prompt has {len(ids)} tokens and the model's context is {limit} tokens "
                f"(room for at least one reply token is needed).",
                "Send a shorter prompt.",
            )
        return min(max_tokens, room)

    # ------------------------------------------------------------------ jobs

    def submit(self, job: Job) -> None:
        """Queue a job (:class:`QueueFull` past the bound)."""
        self.queue.submit(job)

    def start(self) -> None:
        self.queue.start()

    def stop(self) -> None:
        self.queue.stop()

    def job(self, ids: List[int], params: GenParams, emit: Callable[[str, object], None]) -> Job:
        """A job for ``ids``, its ``max_tokens`` cut to fit the context
        (a :class:`RedrafterError` when the prompt alone does not fit)."""
        params.max_tokens = self.fit(ids, params.max_tokens)
        return Job(list(ids), params, emit)

    def _run(self, job: Job) -> Result:
        """Generate one job's reply on the worker thread."""
        ids = job.ids
        res = Result(prompt_tokens=len(ids), structured=job.params.grammar is not None)
        generated: List[int] = []
        eos: List[int] = []  # the EOS that ended the reply: its KV may be in the cache
        sources: List[str] = []  # of the tokens whose text has not been emitted yet
        try:
            res.reused_tokens = self.cache.reuse(ids)
            p = job.params
            stream = stream_generate(
                self.rt.model, self.rt.tokenizer, ids[res.reused_tokens:], prompt_cache=self.cache.cache,
                lookup_context=ids[:res.reused_tokens], draft=self.rt.draft, sampling=p.sampling,
                max_tokens=p.max_tokens, seed=p.seed, stop=p.stop, grammar=p.grammar,
            )
            try:
                for r in stream:
                    if _count(res, r):
                        generated.append(r.token)
                        sources.append(token_source(r))
                    else:  # the EOS response emits no token
                        eos = [r.token]
                    res.text += r.text
                    res.finish_reason, res.incomplete = r.finish_reason, r.incomplete
                    if r.text:
                        job.emit("text", self._piece(r.text, sources, res))
                        sources = []
                    if job.cancelled.is_set():  # the client left: stop at this step
                        break
            finally:
                stream.close()
        except BaseException:
            self.cache.discard()
            raise
        # Cancelled mid-reply too: the closed step loop left the cache holding a
        # prefix of the prompt + the verified tokens (as in the chat after Ctrl-C).
        res.cancelled = res.finish_reason is None
        if res.finish_reason == "stop" and not eos and job.params.stop:
            res.stop_sequence = first_stop(self.rt.tokenizer.decode(generated), job.params.stop)
        self.cache.settle(ids + generated + eos)
        for listener in self.listeners:
            listener(res)
        if self.rt.history is not None and generated:
            self.rt.history.remember(generated, res.tally, self.rt.draft.datastore, prompt=ids)
        job.emit("done", res)
        return res

    # ------------------------------------------------------------------ reports

    @staticmethod
    def _piece(text: str, sources: List[str], res: Result) -> Piece:
        t = res.tally
        return Piece(text, sources, t.tokens, t.steps, t.last.generation_tps, res.prompt_tokens, res.reused_tokens)

    def stats(self, res: Result) -> dict:
        """The drafting stats of a reply (an extra response field)."""
        t = res.tally
        by_source = t.by_source
        return {
            "drafting": self.rt.draft.drafting,  # a drafter, lookup drafts, a datastore, or several
            "beam_width": self.rt.beam_width if self.rt.drafter is not None else None,
            "beam_length": self.rt.beam_length if self.rt.drafter is not None else None,
            "steps": t.steps,
            "tokens_per_step": round(t.tokens_per_step, 3),
            "from_drafts": round(t.draft_share, 3),
            "from_drafts_by_source": {k: round(v / max(t.tokens, 1), 3) for k, v in by_source.items() if v},
            "prompt_tokens_reused": res.reused_tokens,
            "prompt_tokens_prefilled": res.prompt_tokens - res.reused_tokens,
            "generation_tps": round(t.last.generation_tps, 2) if t.last is not None else 0.0,
            "structured": {"complete": not res.incomplete} if res.structured else None,
        }

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_id, "drafter": str(self.rt.drafter_path) if self.rt.drafter_path else None,
                "queue": self.queue.status(), "prompt_cache": self.cache_status()}

    def cache_status(self) -> dict:
        c = self.cache
        return {"entries": c.entries, "bytes": c.nbytes, "hits": c.hits, "reused_tokens": c.reused_tokens,
                "bound": c.lru.max_size, "bound_bytes": c.lru.max_bytes}


def first_stop(text: str, stop: Sequence[str]) -> Optional[str]:
    """The stop string that ends ``text`` first (the one the stream stopped at)."""
    hits = [(text.find(s), i) for i, s in enumerate(stop) if s and s in text]
    return stop[min(hits)[1]] if hits else None


def _count(res: Result, r) -> bool:
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
