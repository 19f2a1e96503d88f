"""The core of ``mlx-redrafter serve``: one model, a fair bounded queue of
requests decoded together, and the KV caches that requests share.

No HTTP here (that is :mod:`~mlx_redrafter.serve.app`, a thin layer on top):
:class:`Engine` turns token ids into a :class:`Job`, decodes jobs on its
worker thread (:mod:`~mlx_redrafter.serve.scheduler`: at most ``max_batch``
at once, ``queue_size`` more waiting, then :class:`QueueFull`), and reports
each job's text through the job's ``emit`` callback. A request alone
decodes with the runtime's drafting exactly as ``generate`` does;
concurrent ones are decoded together where that pays
(:mod:`~mlx_redrafter.serve.batch`).

The KV caches stay from one request to the next
(:class:`~mlx_redrafter.llm.prompt_cache.PromptCache`, on mlx-lm's
``LRUPromptCache``): a request whose ids share a prefix with a cached
sequence prefills only the rest, so a follow-up turn of a conversation costs
only its new tokens, even when other conversations came in between. Every job runs the runtime's one
resolved :class:`~mlx_redrafter.config.DraftConfig` with the job's own
:class:`~mlx_redrafter.config.SamplingConfig`.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ..config import SamplingConfig
from ..errors import RedrafterError
from ..llm.parts import context_limit
from ..llm.prompt_cache import NO_BYTE_BOUND, PromptCache
from ..llm.text import encode_prompt, token_floor
from ..prompts import render_messages
from ..step.grammar import compile_for_model
from .batch import BatchDecoder
from .jobs import GenParams, Job, Piece, Result, token_source  # noqa: F401 (the engine's public names)
from .scheduler import JobQueue, QueueFull, Scheduler  # noqa: F401
from .tools import Rendered, prompt_with_tools, tool_format


class PromptTooLong(RedrafterError):
    """A prompt the model's context cannot hold (each API's
    ``context_length_exceeded``): ``tokens`` (at least that many), where
    ``maximum`` fit (room for one reply token kept), for an API to say in its
    own words (Anthropic's ``prompt is too long: N tokens > M maximum``)."""

    def __init__(self, size: str, tokens: int, limit: int, margin: int):
        super().__init__(
            f"The prompt has {size} and the model's context is {limit} tokens "
            f"(room for at least one reply token is needed).",
            "Send a shorter prompt.",
        )
        self.tokens, self.maximum = tokens, limit - margin - 1


def short_name(spec: str) -> str:
    """The name a client can type for a model served as ``spec``: a file's or
    folder's stem, a Hub id's last part (``./gemma-3-270m.gguf``:
    ``gemma-3-270m``; ``mlx-community/Qwen3-0.6B-4bit``: ``Qwen3-0.6B-4bit``)."""
    name = PurePath(spec.rstrip("/\\")).name or spec
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


class Engine:
    """A :class:`~mlx_redrafter.runtime.Runtime` serving up to ``max_batch``
    requests at once (1: one at a time, each drafted, as before batching)
    with ``queue_size`` more waiting, and prompt caches shared across requests
    (at most ``prompt_cache_size`` sequences and ``prompt_cache_bytes``
    bytes). ``max_tokens`` and ``sampling``: what a request that does not say
    gets; ``max_tokens_cap``: the longest reply whatever a request asks (None:
    the context's room), and ``cap_ends_turn``: a reply that cap cuts is
    reported as a finished turn (``stop``), for a model that never ends one
    (a base model), whose cut replies agents take for errors.
    ``served_names``: the names the model answers to (the first is the one
    the server reports, as vLLM's ``--served-model-name``); besides, it
    always answers to the model as given and its short name (:attr:`names`).
    ``batch_drafts``: whether requests decoded together draft (each its own
    tree, all verified in one forward: serve/batch.py; off by default,
    bench/RESULTS.md section 34), else they decode plainly.
    ``listeners`` are called on the worker thread with every job's
    :class:`Result` (metrics); ``queue.step_listeners`` with the rows each
    step decoded, ``queue.shed_listeners`` for each request turned away."""

    # The policies below, as set by __init__ (their defaults here serve test doubles that skip it).
    max_tokens_cap: Optional[int] = None
    cap_ends_turn = False
    checkpoints = False  # whether the prompt cache copies caches at checkpoints (PromptCache.checkpoint)

    def __init__(
        self,
        runtime,
        max_tokens: int = 512,
        sampling: Optional[SamplingConfig] = None,
        queue_size: int = 16,
        prompt_cache_size: int = 10,
        prompt_cache_bytes: int = NO_BYTE_BOUND,
        max_batch: int = 8,
        max_tokens_cap: Optional[int] = None,
        served_names: Sequence[str] = (),
        cap_ends_turn: bool = False,
        batch_drafts: bool = False,
    ):
        self.rt = runtime
        self.model_id = served_names[0] if served_names else runtime.model_spec
        spec = runtime.model_spec
        self.names = list(dict.fromkeys([self.model_id, *served_names, spec, short_name(spec)]))
        self.max_tokens = max_tokens
        self.max_tokens_cap, self.cap_ends_turn = max_tokens_cap, cap_ends_turn
        self.sampling = sampling or SamplingConfig()
        self.cache = PromptCache(runtime.model, prompt_cache_size, prompt_cache_bytes)
        self.checkpoints = self.cache.checkpoints
        decoder = BatchDecoder(self, max_batch, batch_drafts)  # max_batch 1 for a model whose caches cannot batch
        self.queue = Scheduler(decoder, queue_size)
        self.listeners: List[Callable[[Result], None]] = []

    # ------------------------------------------------------------------ prompts

    def chat_ids(self, messages: List[dict]) -> List[int]:
        """Token ids of ``messages`` through the chat template, exactly as
        ``mlx-redrafter generate`` encodes its prompt (:meth:`encode`)."""
        return self.encode(render_messages(self.rt.tokenizer, messages))

    def chat_prompt(
        self, messages: Sequence[dict], tools: Optional[list] = None, tool_choice=None, bounded: bool = True, **options
    ) -> Rendered:
        """``messages`` and ``tools`` through the chat template (see
        :func:`~mlx_redrafter.serve.tools.prompt_with_tools`, which takes ``options``),
        encoded by :meth:`encode` (``bounded``: refusing a prompt the context
        provably cannot hold); without tools the ids are :meth:`chat_ids`'."""
        return prompt_with_tools(
            self.rt.tokenizer, messages, tools, tool_choice, encode=lambda text: self.encode(text, bounded), **options
        )

    def text_ids(self, prompt: str) -> List[int]:
        return self.encode(prompt)

    def encode(self, text: str, bounded: bool = True) -> List[int]:
        """A prompt's token ids, as ``generate`` encodes it. ``bounded``: a
        prompt so long that the context provably cannot hold it
        (:func:`~mlx_redrafter.llm.text.token_floor`) is a :class:`PromptTooLong`
        before it is tokenized: 20 million words would take a minute and gigabytes."""
        limit = context_limit(self.rt.model)
        floor = token_floor(self.rt.tokenizer, text) if bounded and limit else 0
        if floor and floor > limit - self._margin() - 1:  # fit()'s test, on a lower bound of the length
            raise PromptTooLong(f"at least {floor} tokens ({len(text)} characters)", floor, limit, self._margin())
        return list(encode_prompt(self.rt.tokenizer, text))

    def card(self) -> dict:
        """What ``/v1/models`` says of the model beside its id (whether a
        grammar constrains its tool calls: ``tool_calls_constrained``)."""
        fmt = tool_format(self.rt.tokenizer)
        return {
            "context_length": context_limit(self.rt.model) or None,
            "tools": True,
            "tool_format": fmt.name,
            "tool_calls_constrained": fmt.constrained,
        }

    def compile_grammar(self, spec):
        """``spec`` (a JSON Schema, ``"json"``...) compiled for the model; a
        :class:`RedrafterError` names what is wrong with it."""
        return compile_for_model(self.rt.model, self.rt.tokenizer, spec)

    def _margin(self) -> int:
        # A verification briefly puts the drafted tokens behind the last one.
        return self.rt.plan().margin

    def fit(self, ids: List[int], max_tokens: int) -> int:
        """``max_tokens`` cut to ``max_tokens_cap`` and to what the context
        leaves after the prompt (a cap, as Anthropic's and OpenAI's APIs
        take a ``max_tokens`` past the room left: the reply ends there with
        ``length``); a :class:`PromptTooLong` when the prompt alone does not fit."""
        if not ids:
            raise RedrafterError("The prompt is empty.", "Send at least one token of prompt.")
        if self.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.max_tokens_cap)
        limit = context_limit(self.rt.model)
        if not limit:
            return max_tokens
        room = limit - len(ids) - self._margin()
        if room < 1:
            raise PromptTooLong(f"{len(ids)} tokens", len(ids), limit, self._margin())
        return min(max_tokens, room)

    # ------------------------------------------------------------------ jobs

    def submit(self, job: Job) -> None:
        """Queue a job (:class:`QueueFull` past the bound)."""
        self.queue.submit(job)

    def start(self) -> None:
        self.queue.start()

    def stop(self) -> None:
        self.queue.stop()

    def job(self, ids: List[int], params: GenParams, emit: Callable[[str, object], None], head: int = 0) -> Job:
        """A job for ``ids``, its ``max_tokens`` cut to fit the context
        (a :class:`RedrafterError` when the prompt alone does not fit);
        ``head``: how many of its first tokens every request of its kind
        shares (a system prompt and tools: kept in the prompt cache)."""
        asked, params.max_tokens = params.max_tokens, self.fit(ids, params.max_tokens)
        params.capped = self.max_tokens_cap is not None and params.max_tokens == self.max_tokens_cap < asked
        return Job(list(ids), params, emit, head)

    def cache_for(self, job: Job):
        """``(cache, reused, held)``: the KV cache ``job`` starts from, the
        prompt tokens it reused from the prompt cache, and those it holds
        (more for a model whose cache cannot be trimmed back: it is prefilled
        up to the checkpoints the next requests reuse, ``job.head`` among
        them: :meth:`~mlx_redrafter.llm.prompt_cache.PromptCache.take`)."""
        return self.cache.take(job.ids, [job.head] if job.head else [])

    def finish(self, row, cache) -> None:
        """A row's reply ended (or its client left): store its KV cache (which
        holds a prefix of the prompt + the reply + the EOS that ended it, as a
        closed step loop or the batch leave it), tell the listeners and the
        lookup history, then the job (on the worker thread)."""
        job, res, generated = row.job, row.res, row.generated
        ids = job.ids
        res.tokens = list(generated)
        res.cancelled = res.finish_reason is None
        if res.finish_reason == "length" and job.params.capped and self.cap_ends_turn:
            res.finish_reason, res.cut = "stop", True
        if res.finish_reason == "stop" and not row.eos and job.params.stop:
            res.stop_sequence = first_stop(self.rt.tokenizer.decode(generated), job.params.stop)
        if cache is not None:
            self.cache.store(cache, ids + generated + row.eos)
        for listener in self.listeners:
            listener(res)
        if self.rt.history is not None and generated:
            self.rt.history.remember(generated, res.tally, self.rt.draft.datastore, prompt=ids)
        job.emit("done", res)

    # ------------------------------------------------------------------ reports

    def stats(self, res: Result) -> dict:
        """The drafting stats of a reply (an extra response field)."""
        t = res.tally
        by_source = t.by_source
        return {
            "drafting": self.rt.plan().drafting,  # some source drafts (and pays)
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
            "tokens_batched": res.batched_tokens,  # decoded together with other requests (plain decoding)
            "cut_at_cap": res.cut,  # ended by --max-tokens-cap, reported as a finished turn (--cap-ends-turn)
        }

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.model_id,
            "drafter": str(self.rt.drafter_path) if self.rt.drafter_path else None,
            # The stateful sources, named: "MTP head: ...", "draft model: ..." (a row alone drafts with them).
            "sources": list(self.rt.source_labels),
            "queue": self.queue.status(),
            "prompt_cache": self.cache_status(),
            "memory": memory_status(),
        }

    def cache_status(self) -> dict:
        c = self.cache
        return {
            "entries": c.entries,
            "bytes": c.nbytes,
            "hits": c.hits,
            "reused_tokens": c.reused_tokens,
            "bound": c.lru.max_size,
            "bound_bytes": c.byte_bound,  # null: no --prompt-cache-bytes
        }


def memory_status() -> dict:
    """MLX's memory in MB: arrays alive, freed buffers it keeps for reuse
    (its cache), and the peak since start."""
    mb = lambda n: round(n / 2**20, 1)
    return {
        "active_mb": mb(mx.get_active_memory()),
        "cache_mb": mb(mx.get_cache_memory()),
        "peak_mb": mb(mx.get_peak_memory()),
    }


def first_stop(text: str, stop: Sequence[str]) -> Optional[str]:
    """The stop string that ends ``text`` first (the one the stream stopped at)."""
    hits = [(text.find(s), i) for i, s in enumerate(stop) if s and s in text]
    return stop[min(hits)[1]] if hits else None
