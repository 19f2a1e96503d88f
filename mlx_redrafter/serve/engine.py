"""The core of ``mlx-redrafter serve``: one model, a fair bounded queue of
requests, and a KV cache that consecutive requests share.

No HTTP here (that is :mod:`~mlx_redrafter.serve.openai_api`, a thin layer on top):
:class:`Engine` turns token ids into a :class:`Job`, runs jobs one at a time
on its worker thread, and reports each job's text through the job's
``emit`` callback.

The KV cache stays from one request to the next, as in the chat
(:class:`~mlx_redrafter.llm.cache.PromptCache`): a request whose ids share
a prefix with the cached ones prefills only the rest, so a follow-up turn of
a conversation costs only its new tokens. Every job runs the runtime's one
resolved :class:`~mlx_redrafter.config.DraftConfig` with the job's own
:class:`~mlx_redrafter.config.SamplingConfig`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..config import SamplingConfig
from ..errors import RedrafterError
from ..generate import stream_generate
from ..llm.cache import PromptCache
from ..llm.parts import context_limit
from ..llm.text import encode_prompt
from ..prompts import chat_prompt_ids
from ..responses import Tally


class QueueFull(Exception):
    """The queue holds its bound of waiting requests."""


@dataclass
class GenParams:
    """What a request may choose (OpenAI's names map onto these)."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)


@dataclass
class Result:
    """A finished (or cancelled) job."""

    text: str = ""
    finish_reason: Optional[str] = None  # "stop", "length", or None when cancelled
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the previous request
    tally: Tally = field(default_factory=Tally)
    cancelled: bool = False

    @property
    def completion_tokens(self) -> int:
        return self.tally.tokens


@dataclass(eq=False)  # compared and hashed by identity: the queue keeps a set of live jobs
class Job:
    """One request: its prompt ids, its parameters, and where its output goes.

    ``emit(kind, value)`` is called from the worker thread with
    ``("text", str)`` per response, then ``("done", Result)`` or
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
    with a prompt cache shared across requests. ``max_tokens`` and
    ``sampling``: what a request that does not say gets."""

    def __init__(self, runtime, max_tokens: int = 512, sampling: Optional[SamplingConfig] = None,
                 queue_size: int = 16):
        self.rt = runtime
        self.model_id = runtime.model_spec
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingConfig()
        self.cache = PromptCache(runtime.model)
        self.queue = JobQueue(self._run, queue_size)

    # ------------------------------------------------------------------ prompts

    def chat_ids(self, messages: List[dict]) -> List[int]:
        """Token ids of ``messages`` through the chat template, exactly as
        ``mlx-redrafter generate`` encodes its prompt."""
        return chat_prompt_ids(self.rt.tokenizer, messages)

    def text_ids(self, prompt: str) -> List[int]:
        return encode_prompt(self.rt.tokenizer, prompt)

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
        res = Result(prompt_tokens=len(ids))
        generated: List[int] = []
        eos: List[int] = []  # the EOS that ended the reply: its KV may be in the cache
        try:
            res.reused_tokens = self.cache.reuse(ids)
            p = job.params
            stream = stream_generate(
                self.rt.model, self.rt.tokenizer, ids[res.reused_tokens:], prompt_cache=self.cache.cache,
                lookup_context=ids[:res.reused_tokens], draft=self.rt.draft, sampling=p.sampling,
                max_tokens=p.max_tokens, seed=p.seed, stop=p.stop,
            )
            try:
                for r in stream:
                    if res.tally.add(r):
                        generated.append(r.token)
                    else:  # the EOS response emits no token
                        eos = [r.token]
                    res.text += r.text
                    res.finish_reason = r.finish_reason
                    if r.text:
                        job.emit("text", r.text)
                    if job.cancelled.is_set():  # the client left: stop at this step
                        break
            finally:
                stream.close()
        except BaseException:
            self.cache.reset()
            raise
        if res.finish_reason is None:
            # Cancelled mid-reply: the cache may hold part of a verification.
            res.cancelled = True
            self.cache.reset()
        else:
            self.cache.settle(ids + generated + eos)
        if self.rt.history is not None and generated:
            self.rt.history.remember(generated, res.tally, self.rt.draft.datastore)
        job.emit("done", res)
        return res

    # ------------------------------------------------------------------ reports

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
        }

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_id, "drafter": str(self.rt.drafter_path) if self.rt.drafter_path else None,
                "queue": self.queue.status()}
