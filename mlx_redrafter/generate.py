"""``stream_generate`` / ``generate``: the front door, like mlx-lm's.

A call resolves what it was asked (config.py: flags > tuned profile >
built-in), checks it, and runs the step iterator that step/dispatch.py picks
(plain decoding, or the pipelined or synchronous ReDrafter loop). This module
turns the steps' tokens into text: EOS, stop strings and ``max_tokens`` end
the output exactly, even in the middle of an accepted run.
"""

from __future__ import annotations

import time
import warnings
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .config import DraftConfig, SamplingConfig, library_draft
from .errors import RedrafterError
from .llm.cache import trim_cache
from .llm.parts import context_limit
from .llm.text import prompt_array, wrap_tokenizer
from .responses import RedrafterResponse, StopMatcher
from .step.dispatch import token_steps

__all__ = ["DraftConfig", "RedrafterResponse", "SamplingConfig", "generate", "generate_tokens",
           "stream_generate", "trim_cache"]


def _timings(timings: bool, profile: Optional[bool]) -> bool:
    """``profile=`` is the old name of ``timings=`` (deprecated: "profile" also names a tuned (W, L) file)."""
    if profile is None:
        return timings
    warnings.warn("profile= is deprecated; use timings=True (the same phase timings).", DeprecationWarning,
                  stacklevel=3)
    return timings or profile


def check_generation_args(model, prompt: mx.array, draft: DraftConfig) -> None:
    if prompt.size == 0:
        raise RedrafterError("The prompt is empty.", "Give at least one token of prompt.")
    limit = context_limit(model)
    if limit and prompt.size >= limit:
        raise RedrafterError(
            f"The prompt has {prompt.size} tokens but the model's context is {limit} tokens.",
            "Shorten the prompt.",
        )
    draft.check()
    if draft.drafter is not None:
        from .draft.drafter import check_fits

        check_fits(draft.drafter, model)


def _refuse_both(given, what: str, **loose) -> None:
    """A resolved config and loose keywords for the same thing contradict each other."""
    named = sorted(k for k, v in loose.items() if v not in (None, False, 0))
    if given is not None and named:
        raise RedrafterError(f"Both {what}= and {', '.join(named)}= were given.", f"Put everything in {what}=, or drop it.")


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    drafter=None,
    beam_width: Optional[int] = None,
    beam_length: Optional[int] = None,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    seed: Optional[int] = None,
    stop: Sequence[str] = (),
    prompt_cache=None,
    warp: bool = False,
    profile: Optional[bool] = None,
    controller=None,
    lookup: Optional[Union[bool, int]] = None,
    lookup_context: Sequence[int] = (),
    *,
    datastore=None,
    timings: bool = False,
    draft: Optional[DraftConfig] = None,
    sampling: Optional[SamplingConfig] = None,
) -> Iterator[RedrafterResponse]:
    """Stream a reply, like ``mlx_lm.stream_generate``, with ReDrafter when a
    ``drafter`` is given (plain decoding when it is ``None``).

    ``lookup`` adds drafts copied from the prompt and the reply (n-gram
    lookup): ``True`` or a number of lookup beams, ``False`` for none;
    ``None`` is the tuned profile's choice, else ``DEFAULT_LOOKUP`` with a
    drafter and none without. ``drafter=None, lookup=True`` is speculative
    decoding with lookup drafts only, for any model. ``lookup_context``:
    earlier tokens already in ``prompt_cache`` (a chat's previous turns)
    that lookup may copy from. ``datastore`` (draft/stores.py): a store file,
    a ``Datastore``, ``False``, or ``None`` (the model's own, when drafting).

    ``beam_length`` counts drafted tokens (not ``g0``). A width or length
    not given comes from this device's tuned profile (``mlx-redrafter sweep
    --save-profile``) when the model and drafter were loaded with this
    package's loaders, else from ``DEFAULT_WIDTH``/``DEFAULT_LENGTH``.
    ``draft`` (a resolved :class:`DraftConfig`) and ``sampling`` replace the
    loose keywords. Bad arguments raise :class:`RedrafterError` (a
    ``ValueError``). At ``temp == 0`` the tokens equal plain greedy decoding;
    at ``temp > 0`` they follow the model's own sampling distribution (after
    ``top_p``/``min_p``/``top_k``). ``timings=True`` adds syncs to split the
    step time into pack / verify / accept / draft (``profile=``: old name).

    ``prompt_cache`` (a list from ``make_prompt_cache``) is updated in place;
    at the end it holds the prompt and the emitted tokens, sometimes minus the
    last one, or plus accepted drafts past an EOS or a stop string (EOS, stop
    strings and ``max_tokens`` end the output itself exactly); :func:`trim_cache`
    brings it to a known length.
    """
    timings = _timings(timings, profile)
    _refuse_both(sampling, "sampling", temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    sampling = sampling or SamplingConfig(temp, top_p, min_p, top_k)
    if max_tokens < 1:
        raise RedrafterError(f"max_tokens must be at least 1 (got {max_tokens}).")
    draft = _resolve_draft(model, draft, datastore, drafter=drafter, beam_width=beam_width, beam_length=beam_length,
                           lookup=lookup, warp=warp, controller=controller)
    tokenizer = wrap_tokenizer(tokenizer)
    prompt = prompt_array(tokenizer, prompt)
    check_generation_args(model, prompt, draft)
    if seed is not None:
        mx.random.seed(seed)
    steps = token_steps(model, prompt, prompt_cache, draft=draft, sampling=sampling, timings=timings,
                        history=lookup_context)
    yield from _stream_text(tokenizer, steps, prompt.size, max_tokens, stop)


def _resolve_draft(model, draft: Optional[DraftConfig], datastore, **loose) -> DraftConfig:
    """A given ``draft`` (alone), else the loose keywords resolved, with the
    store that ``datastore=`` names (:func:`~mlx_redrafter.draft.stores.open_datastore`)."""
    from dataclasses import replace

    from .draft.stores import open_datastore

    _refuse_both(draft, "draft", **loose, datastore=datastore is not None and datastore is not False)
    if draft is not None:
        return draft
    k = loose
    draft = library_draft(model, k["drafter"], k["beam_width"], k["beam_length"], k["lookup"], warp=k["warp"],
                          controller=k["controller"])
    store = open_datastore(datastore, getattr(model, "redrafter_spec", None), drafting=draft.drafting)
    return draft if store is None else replace(draft, datastore=store)


def _stream_text(tokenizer, steps, prompt_tokens: int, max_tokens: int, stop: Sequence[str]):
    """The responses of a stream of steps: text, EOS, stop strings, ``max_tokens``."""
    detok = tokenizer.detokenizer
    detok.reset()
    matcher = StopMatcher(stop)
    eos = tokenizer.eos_token_ids
    n = 0
    tic = time.perf_counter()
    prompt_tps = 0.0

    def response(text, token, from_draft, stats, finish=None):
        elapsed = max(time.perf_counter() - tic, 1e-9)
        return RedrafterResponse(
            text=text, token=token, logprobs=None, from_draft=from_draft, prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tps, generation_tokens=n, generation_tps=n / elapsed if n > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, stats=stats,
        )

    try:
        for step in steps:
            if step.stats.step == 0:
                prompt_tps = prompt_tokens / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            for token, from_draft in zip(step.tokens, step.from_draft):
                if token in eos:
                    detok.finalize()
                    text, _ = matcher.feed(detok.last_segment)
                    yield response(text + matcher.flush(), token, from_draft, step.stats, "stop")
                    return
                detok.add_token(token)
                n += 1
                text, stopped = matcher.feed(detok.last_segment)
                if stopped:
                    yield response(text, token, from_draft, step.stats, "stop")
                    return
                if n >= max_tokens:
                    detok.finalize()
                    more, stopped = matcher.feed(detok.last_segment)
                    text += more if stopped else more + matcher.flush()
                    yield response(text, token, from_draft, step.stats, "stop" if stopped else "length")
                    return
                yield response(text, token, from_draft, step.stats)
    finally:
        steps.close()


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete reply and return its text, like ``mlx_lm.generate``."""
    text = ""
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(r.text, end="", flush=True)
        text += r.text
    if verbose:
        print()
    return text


def generate_tokens(
    model,
    prompt,
    *,
    draft: Optional[DraftConfig] = None,
    max_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    prompt_cache=None,
    timings: bool = False,
    profile: Optional[bool] = None,
):
    """Token-level generation without a tokenizer: ``(tokens, step_stats)``.

    ``draft`` says how to draft (None: plain decoding). Stops after
    ``max_tokens`` tokens or at the first of ``eos_ids`` (which is not
    included), exactly like :func:`stream_generate`. ``timings=True`` fills
    the phase times of the stats (``profile=``: its deprecated old name).
    """
    timings = _timings(timings, profile)
    draft = draft or DraftConfig()
    sampling = SamplingConfig(temp, top_p, min_p, top_k)
    prompt = mx.array(prompt, dtype=mx.int32) if not isinstance(prompt, mx.array) else prompt
    check_generation_args(model, prompt, draft)
    steps = token_steps(model, prompt, prompt_cache, draft=draft, sampling=sampling, timings=timings)
    tokens, stats = [], []
    try:
        for step in steps:
            stats.append(step.stats)
            for t in step.tokens:
                if t in eos_ids:
                    return tokens, stats
                tokens.append(t)
                if len(tokens) >= max_tokens:
                    return tokens, stats
    finally:
        steps.close()
    return tokens, stats
