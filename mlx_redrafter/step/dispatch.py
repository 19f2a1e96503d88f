"""Which steps run a generation, as its plan (step/plan.py) says: plain
mlx-lm decoding where nothing drafts (with a grammar's mask as a logits
processor: plain constrained decoding), else the step loop (step/loop.py)
in the plan's schedule, a grammar a mask on it.

Every iterator yields :class:`~mlx_redrafter.step.protocol.StepTokens`: the
first token (from the prompt), then ``accepted drafts + the LLM's own next
token`` per step. They are endless (a grammar's end at its EOS); the caller
stops them.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..config import DraftConfig, SamplingConfig
from ..errors import RedrafterError
from ..llm.cache import check_cache, drop_sources, target_size
from .after_read import after_read_steps
from .grammar import Grammar, GrammarMask, grammar_logits_processor
from .loop import ahead_steps
from .plan import AHEAD, DraftPlan, make_plan
from .protocol import StepStats, StepTokens


def plain_steps(
    model, prompt: mx.array, cache, sampling: Optional[SamplingConfig] = None, grammar: Optional[Grammar] = None
) -> Iterator[StepTokens]:
    """Plain mlx-lm decoding (``generate_step``), one token per step; with a
    ``grammar``, its mask is a logits processor (plain constrained decoding,
    the reference the constrained step equals) and the stream ends after
    the grammar's EOS."""
    from mlx_lm.sample_utils import make_sampler

    sampling = sampling or SamplingConfig()
    sampler = make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
    processors = [grammar_logits_processor(grammar)] if grammar is not None else None
    eos = set(grammar.eos_ids) if grammar is not None else ()
    tic = time.perf_counter()
    for i, (token, _) in enumerate(
        generate_step(prompt, model, max_tokens=-1, sampler=sampler, prompt_cache=cache, logits_processors=processors)
    ):
        now = time.perf_counter()
        yield StepTokens([int(token)], [False], StepStats(i, 0, 1, now - tic, i + 1))
        tic = now
        if int(token) in eos:
            return


def token_steps(
    model,
    prompt: mx.array,
    prompt_cache,
    *,
    plan: DraftPlan,
    sampling: SamplingConfig,
    timings: bool = False,
    history: Sequence[int] = (),
    grammar: Optional[Grammar] = None,
) -> Iterator[StepTokens]:
    """The step iterator of a generation as ``plan`` says (made by
    :func:`~mlx_redrafter.step.plan.make_plan` for this grammar and cache).
    ``prompt_cache=None``: a fresh cache. ``history``: tokens before
    ``prompt`` (already in the cache) that sources may copy from. A compiled
    ``grammar`` constrains the output."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    size = target_size(model)
    if plan.drafting and (plan.structured != (grammar is not None) or (timings and plan.schedule == AHEAD)):
        raise RedrafterError(
            "This draft plan was made for another generation (with or without a grammar, or timings).",
            "Make the plan with make_plan(model, draft, grammar=..., timings=...) for this generation.",
        )
    if not plan.drafting:
        drop_sources(cache, size)  # their caches would fall behind the model's
        return plain_steps(model, prompt, cache, sampling, grammar)
    check_cache(cache[:size])
    if grammar is not None:
        mask = GrammarMask(grammar)
        return after_read_steps(model, prompt, cache, plan, sampling, history, grammar=mask, timings=timings)
    if plan.schedule == AHEAD:
        return ahead_steps(model, prompt, cache, plan, sampling, history)
    return after_read_steps(model, prompt, cache, plan, sampling, history, timings=timings)


def redrafter_steps(
    model,
    prompt: mx.array,
    cache,
    *,
    draft: DraftConfig,
    sampling: Optional[SamplingConfig] = None,
    timings: bool = False,
    history: Sequence[int] = (),
) -> Iterator[StepTokens]:
    """The steps of ``draft`` on ``cache``: :func:`token_steps` with the plan
    :func:`~mlx_redrafter.step.plan.make_plan` makes of it."""
    plan = make_plan(model, draft, timings=timings, cache=cache)
    sampling = sampling or SamplingConfig()
    return token_steps(model, prompt, cache, plan=plan, sampling=sampling, timings=timings, history=history)
