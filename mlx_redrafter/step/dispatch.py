"""Which step loop runs a generation: plain mlx-lm decoding, the pipelined
ReDrafter loop (the default), or the synchronous one; under a grammar
(structured output), plain constrained decoding or the synchronous
constrained loop (constrained.py). A draft with stateful sources (an MTP
head, a draft model: ``DraftConfig.stateful``) runs the sourced loop
(sourced.py); under a grammar those sources do not draft (the drafter and
lookup do), and a generation without them drops their caches from the
prompt cache (they would fall behind the model's).

Every loop yields :class:`~mlx_redrafter.step.protocol.StepTokens`: the
first token (from the prompt), then ``accepted drafts + the LLM's own next
token`` per step. The loops are endless; the caller stops them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

from ..config import DraftConfig, SamplingConfig
from ..errors import RedrafterError
from ..llm.cache import check_cache, drop_sources, target_size
from ..llm.recurrent import leaves
from .auto import can_pay
from .constrained import constrained_steps
from .grammar import Grammar, grammar_logits_processor
from .pipelined import pipelined_steps
from .protocol import StepStats, StepTokens
from .sourced import sourced_steps
from .synchronous import synchronous_steps
from .verify import tree_support

# Recurrent layers keep only the accepted node's state, which the pipelined loop
# takes on the device; attention layers keep holes, which sliding windows cannot.
PIPELINED_CACHES = (KVCache, QuantizedKVCache, ArraysCache)
# Wide and deep drafter trees whose beams share prefixes verify fewer nodes
# packed: past this many drafter nodes (W x L) the synchronous loop, which
# packs them, measured faster (bench/RESULTS.md section 11: W=2 L=3 is faster
# pipelined, W=4 L=5 synchronous).
MAX_SHARED_NODES = 8


def drafting_pays(draft: DraftConfig) -> bool:
    """Whether ``draft`` drafts at all: under ``tree="auto"``, only where its
    curve lets some tree pay (:func:`~mlx_redrafter.step.auto.can_pay`);
    otherwise every step would verify ``g0`` alone, which plain mlx-lm
    decoding does with less host work. The controller keeps its own rule."""
    if not draft.drafting or draft.tree != "auto" or draft.controller is not None:
        return draft.drafting
    return can_pay(draft)


def can_pipeline(cache, draft: DraftConfig, timings: bool = False) -> bool:
    """Whether :func:`~mlx_redrafter.step.pipelined.pipelined_steps` runs this
    generation (else the synchronous loop does): plain or quantized caches, no
    controller, no timings, and drafter beams that share few prefixes (see
    ``MAX_SHARED_NODES``) or ``tree="auto"``."""
    if draft.stateful:  # a source with a cache of its own runs the sourced loop
        return False
    if timings or draft.controller is not None or not all(type(c) in PIPELINED_CACHES for c in leaves(cache)):
        return False
    if draft.tree == "auto":  # the verified subset has a bucket's size whatever W x L is
        return True
    w, length = draft.beam_width, draft.beam_length
    # Beams of one token, or a single beam, share no prefix: nothing to dedup.
    return draft.drafter is None or w == 1 or length == 1 or w * length <= MAX_SHARED_NODES


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
    """Yield the tokens of each ReDrafter step. ``history``: tokens before
    ``prompt`` (already in the cache) that lookup drafts may copy from. The
    pipelined loop runs where it can (:func:`can_pipeline`);
    ``draft.pipelined=False`` forces the synchronous one. ``timings=True``
    splits each step's time into phases (the synchronous loop, with a sync
    per phase)."""
    sampling = sampling or SamplingConfig()
    size = target_size(model)
    check_cache(cache[:size])
    if draft.stateful:  # a head or a draft model keeps a cache in step with the model's
        if timings:
            raise RedrafterError(
                "timings=True splits the synchronous loop's phases; a draft with an MTP head or a draft model "
                "runs the sourced loop, which does not split them.",
                "Drop timings (--timings), or the MTP head (--mtp none) and the draft model.",
            )
        yield from sourced_steps(model, prompt, cache, draft=draft, sampling=sampling, history=history)
        return
    drop_sources(cache, size)
    if draft.pipelined and can_pipeline(cache, draft, timings):
        yield from pipelined_steps(model, prompt, cache, draft=draft, sampling=sampling, history=history)
    else:
        yield from synchronous_steps(
            model, prompt, cache, draft=draft, sampling=sampling, timings=timings, history=history
        )


def _say_plain_once(model, why: str) -> None:
    """One warning per model that it decodes without drafting, and why."""
    import warnings

    if not getattr(model, "_redrafter_said_plain", False):
        object.__setattr__(model, "_redrafter_said_plain", True)
        warnings.warn(f"{why} Decoding without drafting (same output).", stacklevel=3)


def plain_steps(
    model, prompt: mx.array, cache, sampling: Optional[SamplingConfig] = None, grammar: Optional[Grammar] = None
) -> Iterator[StepTokens]:
    """Plain mlx-lm decoding (``generate_step``), one token per step; with a
    ``grammar``, its mask is a logits processor (plain constrained decoding,
    the reference the constrained loop equals) and the stream ends after
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
    draft: DraftConfig,
    sampling: SamplingConfig,
    timings: bool = False,
    history: Sequence[int] = (),
    grammar: Optional[Grammar] = None,
) -> Iterator[StepTokens]:
    """The step iterator of a generation: ReDrafter's, or plain decoding's
    when nothing drafts. ``prompt_cache=None``: a fresh cache. A compiled
    ``grammar`` constrains the output: plain constrained decoding when
    nothing drafts, else the synchronous constrained loop (its masks need
    each step's tokens on the host before the next tree is built; the
    pipelined loop and the controller do not run under a grammar)."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if draft.drafting and tree_support(model):  # e.g. a recurrent layer no hook covers: plain decoding, said once
        _say_plain_once(model, tree_support(model))
        draft = DraftConfig()
    if not drafting_pays(draft):  # tree="auto" on a curve where no draft can pay: plain decoding is faster
        draft = DraftConfig()
    if grammar is not None and draft.stateful:  # the constrained loop drafts by drafter and lookup only
        draft = replace(draft, head=None, draft_model=None)
    if not draft.stateful:
        drop_sources(cache, target_size(model))
    if grammar is not None:
        if not draft.drafting:
            return plain_steps(model, prompt, cache, sampling, grammar)
        return constrained_steps(model, prompt, cache, draft, sampling, grammar, history)
    if not draft.drafting:
        return plain_steps(model, prompt, cache, sampling)
    return redrafter_steps(model, prompt, cache, draft=draft, sampling=sampling, timings=timings, history=history)
