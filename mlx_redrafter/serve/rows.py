"""One request while it decodes: a :class:`Row` of the server's batch.

Its text path is the front door's (:func:`~mlx_redrafter.generate.stream_text`):
EOS, stop strings and ``max_tokens`` end a reply exactly as they end a lone
generation. What feeds that path may change between two steps: the
runtime's step loop while the request is alone (:meth:`Row.start_alone`:
``token_steps`` with the runtime's draft plan, as ``stream_generate`` runs
it), or one token per step of the batch
(:meth:`Row.push`). At a switch the tokens known are the prompt and the reply
so far, and the KV cache goes with the request, trimmed to all of them but
the last (the next step's input); the text path, its detokenizer and its
stop-string matcher carry on unbroken.

In the batch each row samples with its own key (:func:`row_sampler`), split
as mlx-lm splits its global key, so a row's samples never depend on the
other rows; a seeded row's key starts at its seed, so its tokens are those
of plain decoding alone with that seed. Its grammar is a logits processor
(:func:`row_processors`: the plain constrained reference of step/grammar.py)
that starts after the prompt, so it also takes in the reply decoded before
the row joined.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import replace
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ..config import SamplingConfig
from ..generate import stream_text
from ..llm.cache import trim_to_known
from ..step.accept import filtered_logprobs
from ..step.batched import RowPlan
from ..step.dispatch import token_steps
from ..step.grammar import grammar_logits_processor
from ..step.protocol import StepStats, StepTokens
from .jobs import Job, Piece, Result, count_response, token_source

_ENTROPY = random.SystemRandom()  # keys of rows that asked for no seed


def row_sampler(sampling: SamplingConfig, seed: Optional[int] = None):
    """A batch row's sampler: mlx-lm's (``make_sampler``'s filters, then a
    categorical draw at ``1 / temp``) on the row's own key, which each draw
    splits as mlx-lm splits its global key (so ``seed`` gives the stream of
    ``mx.random.seed(seed)``). Greedy rows share mlx-lm's greedy sampler: the
    batch then takes their argmax in one call."""
    if sampling.greedy:
        return greedy_sampler
    state = [mx.random.key(seed if seed is not None else _ENTROPY.getrandbits(63))]

    def sample(logprobs: mx.array) -> mx.array:
        keys = mx.random.split(state[0])
        state[0] = keys[0]
        return mx.random.categorical(filtered_logprobs(logprobs, sampling) * (1 / sampling.temp), key=keys[1])

    return sample


def row_plan(params) -> RowPlan:
    """How a row decodes in a batch of draft trees (step/batched.py): greedy
    rows draft; sampled rows draft too, the sampling walk on their own key;
    a seeded sampled row does not draft and draws with :func:`row_sampler`,
    so that its samples stay plain decoding's with that seed."""
    sampling, grammar = params.sampling, params.grammar
    if params.seed is not None and not sampling.greedy:
        return RowPlan(sampling, grammar=grammar, drafts=False, sampler=row_sampler(sampling, params.seed))
    key = None if sampling.greedy else mx.random.key(_ENTROPY.getrandbits(63))
    return RowPlan(sampling, key=key, grammar=grammar)


def row_processors(grammar, prompt: List[int]) -> list:
    """A batch row's logits processors: its grammar's mask, started after
    ``prompt`` (its first call in the batch then takes in every reply token
    decoded so far, alone or batched)."""
    return [] if grammar is None else [grammar_logits_processor(grammar, start=len(prompt))]


class Row:
    """A request being decoded: its reply so far (``generated``, the ``eos``
    that ended it, ``res``), and where its tokens come from: ``loop`` (the
    step loop, with ``cache``) while alone, else its ``uid`` in the batch."""

    def __init__(self, job: Job, tokenizer):
        p = job.params
        self.job = job
        self.res = Result(prompt_tokens=len(job.ids), structured=p.grammar is not None)
        self.generated: List[int] = []
        self.eos: List[int] = []  # the EOS that ended the reply: its KV may be in the cache
        self.sources: List[str] = []  # of the tokens whose text has not been emitted yet
        self.loop = None
        self.cache = None
        self.uid: Optional[int] = None
        self.inbox: "deque[StepTokens]" = deque()
        self.left = 0  # tokens of the current step not yet through the text path
        self.steps = 0
        self.on_step: Optional[Callable[[StepTokens], None]] = None
        self.done = False
        self.started = time.perf_counter()
        self.prompt_tps: Optional[float] = None  # measured here when the batch prefilled the prompt
        self.tokenizer, self.text = tokenizer, None

    def begin(self, reused: int) -> None:
        """Start the text path: ``reused`` prompt tokens came from the prompt
        cache, the rest is prefilled (what ``stream_generate`` would be given)."""
        p = self.job.params
        self.res.reused_tokens = reused
        self.text = stream_text(
            self.tokenizer, self._steps(), len(self.job.ids) - reused, p.max_tokens, p.stop, p.grammar is not None
        )

    @property
    def known(self) -> List[int]:
        """The tokens decoded so far: the prompt and the reply."""
        return self.job.ids + self.generated

    @property
    def alone(self) -> bool:
        return self.loop is not None

    @property
    def switchable(self) -> bool:
        """Whether the row may move between alone and the batch mid-reply. A
        seeded request keeps the way it started, so that its samples repeat
        (alone: those of ``generate --seed``; batched: its own key's)."""
        return self.job.params.seed is None

    def _steps(self):
        while True:
            step = next(self.loop) if self.loop is not None else self.inbox.popleft()
            if self.loop is not None and step.stats.step > 0 and self.on_step is not None:
                self.on_step(step)
            step.stats = replace(step.stats, step=self.steps)  # one numbering across switches
            self.steps += 1
            self.left = len(step.tokens)
            yield step

    def read(self) -> None:
        """Take the next token through the text path, count it, emit its text."""
        r = next(self.text)
        self.left -= 1
        res = self.res
        if r.stats.step == 0 and self.uid is not None:  # its prefill ran in the batch, before the text path began
            self.prompt_tps = r.prompt_tokens / max(time.perf_counter() - self.started, 1e-9)
        if self.prompt_tps is not None:
            r.prompt_tps = self.prompt_tps
        if count_response(res, r):
            self.generated.append(r.token)
            self.sources.append(token_source(r))
            res.batched_tokens += int(self.uid is not None)
        else:  # the EOS response emits no token
            self.eos = [r.token]
        res.text += r.text
        res.finish_reason, res.incomplete = r.finish_reason, r.incomplete
        if r.text:
            self.job.emit("text", Piece.of(r.text, self.sources, res))
            self.sources = []
        self.done = r.finish_reason is not None

    # ------------------------------------------------------------------ alone

    def start_alone(self, model, plan, cache, prompt: List[int], history: List[int], on_step=None) -> None:
        """Decode ``prompt`` (the known tokens not in ``cache``) on with the
        step loop of ``plan`` (the runtime's, for this row's grammar);
        ``history``: the tokens in ``cache``, for the sources that copy."""
        p = self.job.params
        if p.seed is not None:  # as stream_generate seeds a generation
            mx.random.seed(p.seed)
        self.cache, self.on_step = cache, on_step
        self.loop = token_steps(
            model,
            mx.array(prompt, mx.int32),
            cache,
            plan=plan,
            sampling=p.sampling,
            history=history,
            grammar=p.grammar,
        )

    def step_alone(self) -> None:
        """Read one step of the loop (stops early when the reply ends or its client leaves)."""
        self.read()
        while self.left > 0 and not self.done and not self.job.cancelled.is_set():
            self.read()

    def leave_alone(self):
        """Close the step loop (between two steps); ``(cache, held)``: its
        cache trimmed to the first ``held`` known tokens (all but the last),
        or ``(None, 0)`` when it cannot be trimmed."""
        self.loop.close()
        self.loop = None
        cache, self.cache = self.cache, None
        return trim_to_known(cache, self.known)

    # ------------------------------------------------------------------ batched

    def push(self, token: int, seconds: float) -> None:
        """A token of the batch's step (which took ``seconds``), through the text path."""
        self.inbox.append(StepTokens([token], [False], StepStats(step_time=seconds)))
        self.read()

    def push_step(self, step: StepTokens) -> None:
        """A step of a batch of draft trees (its accepted drafts and its own
        token), through the text path as a step alone is read."""
        self.inbox.append(step)
        self.step_alone()

    def remaining(self) -> int:
        return self.job.params.max_tokens - len(self.generated)

    def close(self) -> None:
        """End the text path and the step loop; the cache stays as they left it."""
        if self.text is not None:
            self.text.close()
        if self.loop is not None:
            self.loop.close()
            self.loop = None
