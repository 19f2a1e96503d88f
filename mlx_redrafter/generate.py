"""``stream_generate`` / ``generate``: the front door, like mlx-lm's.

A call resolves what it was asked (config.py: flags > tuned profile >
built-in), turns it into a draft plan (step/plan.py ``make_plan``: the
sources, the tree policy, the schedule; it checks the request), and runs
the steps step/dispatch.py picks for that plan (plain decoding, or the step
loop in the plan's schedule, step/loop.py). This module
turns the steps' tokens into text: EOS, stop strings and ``max_tokens`` end
the output exactly, even in the middle of an accepted run.

Structured output (``grammar=``): a JSON Schema (dict), ``"json"`` for any
JSON object, an llguidance grammar (a Lark string, or
``llguidance.grammar_from(...)``'s JSON) or a compiled
:class:`~mlx_redrafter.step.grammar.Grammar`; an invalid one raises
:class:`RedrafterError` naming the problem. The tokens equal plain decoding
with the grammar's mask applied at every step (token for token when greedy,
in distribution when sampling). Under a grammar the step loop reads each
step before it builds the next (each step's masks need the previous step's
tokens on the host: step/grammar.py ``GrammarMask``), and sources with a
cache of their own do not draft. The output ends when the grammar is complete (``finish_reason
"stop"``); cut earlier (``max_tokens``: ``"length"``, or a stop string), the
last response has ``incomplete=True``: the JSON will not parse, and
:func:`generate` warns.
"""

from __future__ import annotations

import inspect
import time
import warnings
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .config import DraftConfig, SamplingConfig
from .errors import RedrafterError
from .keywords import AUTO, call_configs
from .llm.cache import trim_cache
from .llm.parts import context_limit
from .llm.text import prompt_array, wrap_tokenizer
from .output import RedrafterResponse, StopMatcher
from .step.dispatch import token_steps
from .step.grammar import compile_for_model
from .step.plan import make_plan

INCOMPLETE = (
    "The structured output was cut (max_tokens or a stop string) before its grammar was complete: "
    "the JSON is incomplete. Raise max_tokens."
)

__all__ = [
    "DraftConfig",
    "RedrafterResponse",
    "SamplingConfig",
    "generate",
    "generate_tokens",
    "stream_generate",
    "trim_cache",
]


def _timings(timings: bool, profile: Optional[bool]) -> bool:
    """``profile=`` is the old name of ``timings=`` (deprecated: "profile" also names a tuned (W, L) file)."""
    if profile is None:
        return timings
    warnings.warn(
        "profile= is deprecated; use timings=True (the same phase timings).", DeprecationWarning, stacklevel=3
    )
    return timings or profile


def checked_plan(model, prompt: mx.array, draft: Optional[DraftConfig], **kw):
    """The generation's :class:`~mlx_redrafter.step.plan.DraftPlan` (``kw``:
    :func:`~mlx_redrafter.step.plan.make_plan`'s), once the prompt is checked."""
    check_generation_args(model, prompt)
    return make_plan(model, draft, **kw)


def check_generation_args(model, prompt: mx.array) -> None:
    if prompt.size == 0:
        raise RedrafterError("The prompt is empty.", "Give at least one token of prompt.")
    limit = context_limit(model)
    if limit and prompt.size >= limit:
        raise RedrafterError(
            f"The prompt has {prompt.size} tokens but the model's context is {limit} tokens.",
            "Shorten the prompt.",
        )


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    drafter=AUTO,
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
    grammar=None,
    tree: Optional[str] = None,
    mtp=AUTO,
    mtp_depth: Optional[int] = None,
    draft_model=None,
    num_draft_tokens: Optional[int] = None,
    sources: Sequence = (),
    always_draft: Optional[bool] = None,
) -> Iterator[RedrafterResponse]:
    """Stream a reply, like ``mlx_lm.stream_generate``, with ReDrafter when
    there is a drafter: the one given, else the drafter store's for this
    model (plain decoding with ``drafter=None``).

    The prompt: a string is tokenized and used **as is, with no chat
    template** (as in mlx-lm); token ids (a list or an ``mx.array``) are used
    as they are. To chat, template the messages first::

        from mlx_redrafter import load_model, stream_generate

        model, tokenizer = load_model("default")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name three rivers."}], add_generation_prompt=True)
        for r in stream_generate(model, tokenizer, prompt):  # the drafter shipped for "default"
            print(r.text, end="", flush=True)

    Each yielded :class:`~mlx_redrafter.output.RedrafterResponse` is one
    token: ``.text`` (the new text, possibly empty while a character is
    incomplete or a stop string may be starting), ``.token`` (its id),
    ``.from_draft`` (True when the token came from an accepted draft; the
    step's ``stats.source`` says which: ``"drafter"``, ``"mtp"``,
    ``"draft-model"``, ``"eagle3"``, ``"dflash"``, ``"lookup"``, ``"datastore"``),
    ``.finish_reason`` (``None``, then ``"stop"`` or ``"length"`` on the last one), ``.stats`` (the step's
    :class:`~mlx_redrafter.step.protocol.StepStats`: accepted drafts, tree
    size, timings) and mlx-lm's counters (``prompt_tokens``,
    ``generation_tokens``, ``generation_tps``, ``peak_memory``).

    Drafting keywords:
        drafter: a :class:`Drafter` (``load_drafter(...)``: a folder, a model
            id, a Hub repo); ``None`` for no drafter (plain decoding, or
            lookup drafts alone with ``lookup=True``); or ``"auto"`` (the
            default): the drafter that fits this model in the drafter store
            (``mlx-redrafter drafters list``: installed by ``make-drafter``,
            fetched from the Hub, or shipped with the package, as
            :func:`~mlx_redrafter.hub.store.find` picks it), else none.
            The lookup is cached on the model: later calls cost a ``stat``.
        beam_width, beam_length: beams per step and tokens per beam
            (``beam_length`` counts drafted tokens, not ``g0``). Not given:
            this device's tuned profile (``mlx-redrafter sweep
            --save-profile``) when the model and drafter were loaded with this
            package's loaders, else ``DEFAULT_WIDTH``/``DEFAULT_LENGTH``.
        lookup: drafts copied from the prompt and the reply (n-gram lookup):
            ``True`` or a number of lookup beams, ``False`` for none, ``None``
            for the tuned profile's choice (else ``DEFAULT_LOOKUP`` with a
            drafter, none without). ``drafter=None, lookup=True`` drafts by
            lookup alone, for any model.
        lookup_context: earlier tokens already in ``prompt_cache`` (a chat's
            previous turns) that lookup may copy from.
        controller, warp: the learned depth controller (``--adaptive``) and
            the official code's logit warping of drafts.
        tree: ``"fixed"`` (every drafted node is verified) or ``"auto"``
            (verify only the drafts that pay on this device's verify cost,
            ``mlx-redrafter doctor --calibrate``; ``beam_width`` and
            ``beam_length`` are then the caps of the candidates; where no
            draft can pay, plain decoding). None: ``"auto"`` for a model kept
            quantized, ``"fixed"`` otherwise.
        mtp: the model's native multi-token-prediction head (draft/mtp.py):
            ``"auto"`` (the default) the head the model's checkpoint ships, if
            any (Qwen3.5/3.6/3.8, Qwen3-Next, DeepSeek-V3, GLM-4.5+, MiMo;
            mlx-lm drops it at load, so it is read from the model's folder);
            a folder (the original checkpoint, or a split MTP folder as
            mlx-vlm writes it); a head; or None. Its beams join the tree
            with the drafter's and lookup's (lookup on by default with it).
        mtp_depth: tokens the MTP head drafts per step (chained; default 2).
        draft_model: a smaller mlx-lm model with the same tokenizer that
            drafts (mlx-lm's ``draft_model=``); its cache follows the model's
            in ``prompt_cache`` (after the model's layers, mlx-lm's layout).
        num_draft_tokens: tokens the draft model drafts per step (default 3).
            Under a grammar neither the MTP head nor the draft model drafts.
        sources: your own draft sources: objects with a ``name`` (their label
            in the stats) and ``propose(tokens)`` (the prompt and every token
            emitted so far -> draft rows, lists of token ids of any number and
            lengths). Their rows join the tree with every other source's and
            are verified the same way: the output stays the model's own
            (docs/sources.md shows one in 30 lines).
        datastore: suffix-datastore drafts (draft/datastore/use.py): a store file,
            a ``Datastore``, ``"default"`` (the model's own stores, only when
            the call already drafts), or ``None``/``False`` (none, the default).
        draft: a resolved :class:`DraftConfig`, in place of the keywords above.
        always_draft: ``False`` (the default): each step runs the sources
            that pay, measured live on this run's own steps, and plain
            decoding when none does (step/governor.py: never slower than
            plain decoding; what it learns carries to the next call).
            ``True``: every step drafts with every source asked for (to
            measure one setting). None: ``$MLX_REDRAFTER_ALWAYS_DRAFT=1``
            makes it True.

    Sampling keywords:
        temp, top_p, min_p, top_k, seed: as in mlx-lm (``temp=0``: greedy).
        sampling: a :class:`SamplingConfig`, in place of the keywords above.
        At ``temp == 0`` the tokens equal plain greedy decoding; at
        ``temp > 0`` they follow the model's own sampling distribution.

    Other keywords:
        max_tokens: the most tokens to generate.
        stop: strings that end the output (not included in it).
        prompt_cache: a list from ``make_prompt_cache``, updated in place. At
            the end it holds the prompt and the emitted tokens, sometimes minus
            the last one, or plus accepted drafts past an EOS or a stop string
            (EOS, stop strings and ``max_tokens`` end the output itself
            exactly); :func:`trim_cache` brings it to a known length.
        timings: add syncs to split the step time into pack / verify /
            accept / draft (``profile=`` is its deprecated old name).
        grammar: structured output: a JSON Schema dict, ``"json"`` (any JSON
            object), a Lark grammar string or a compiled grammar (see
            :mod:`mlx_redrafter.step.grammar`); drafting then runs in the
            synchronous loop, and the last response's ``incomplete=True`` says
            when ``max_tokens`` or a stop string cut the output short.

    Bad arguments raise :class:`RedrafterError` (a ``ValueError``).
    """
    timings = _timings(timings, profile)
    sampling, draft = call_configs(
        model,
        sampling,
        draft,
        max_tokens,
        dict(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k),
        dict(
            drafter=drafter,
            beam_width=beam_width,
            beam_length=beam_length,
            lookup=lookup,
            warp=warp,
            controller=controller,
            tree=tree,
            sources=tuple(sources),
            always_draft=always_draft,
        ),
        dict(mtp=mtp, mtp_depth=mtp_depth, draft_model=draft_model, num_draft_tokens=num_draft_tokens),
        datastore,
    )
    tokenizer = wrap_tokenizer(tokenizer)
    prompt = prompt_array(tokenizer, prompt)
    plan = checked_plan(model, prompt, draft, grammar=grammar is not None, timings=timings, cache=prompt_cache)
    grammar = _seeded_grammar(model, tokenizer, grammar, seed)
    steps = token_steps(
        model,
        prompt,
        prompt_cache,
        plan=plan,
        sampling=sampling,
        timings=timings,
        history=lookup_context,
        grammar=grammar,
    )
    yield from stream_text(tokenizer, steps, prompt.size, max_tokens, stop, structured=grammar is not None)


def _seeded_grammar(model, tokenizer, grammar, seed: Optional[int]):
    """Seed the sampler (``seed``, when given) and compile ``grammar`` for the tokenizer (None: none)."""
    if seed is not None:
        mx.random.seed(seed)
    return None if grammar is None else compile_for_model(model, tokenizer, grammar)


def stream_text(tokenizer, steps, prompt_tokens: int, max_tokens: int, stop: Sequence[str], structured=False):
    """The responses of a stream of steps (:class:`~mlx_redrafter.step.protocol.StepTokens`):
    text, EOS, stop strings and ``max_tokens`` exactly as :func:`stream_generate`
    ends them (``structured``: a grammar's output, incomplete unless EOS ends
    it). The server feeds it a request's steps wherever they are decoded
    (alone with drafts, or in a batch). ``tokenizer``: mlx-lm's wrapper."""
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
            text=text,
            token=token,
            logprobs=None,
            from_draft=from_draft,
            prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed if n > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stats=stats,
            incomplete=structured and finish is not None and token not in eos,
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
    """Generate a complete reply and return its text, like ``mlx_lm.generate``.

    ``prompt`` is used as is (a string gets no chat template: see
    :func:`stream_generate`). ``verbose`` prints the text as it comes. Every
    other keyword is :func:`stream_generate`'s: ``drafter``, ``beam_width``,
    ``beam_length``, ``lookup``, ``lookup_context``, ``controller``, ``warp``,
    ``draft``, ``max_tokens``, ``temp``, ``top_p``, ``min_p``, ``top_k``,
    ``seed``, ``sampling``, ``stop``, ``prompt_cache``, ``timings``, ``grammar``, ``tree``,
    ``datastore``, ``mtp``, ``mtp_depth``, ``draft_model``, ``num_draft_tokens``, ``sources``,
    ``always_draft``.
    """
    text, r = "", None
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(r.text, end="", flush=True)
        text += r.text
    if verbose:
        print()
    if r is not None and r.incomplete:
        warnings.warn(INCOMPLETE, stacklevel=2)
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
    plan = checked_plan(model, prompt, draft, timings=timings, cache=prompt_cache)
    steps = token_steps(model, prompt, prompt_cache, plan=plan, sampling=sampling, timings=timings)
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


# help(generate) and tools show stream_generate's keywords, which generate passes on.
generate.__signature__ = inspect.Signature(
    [p for p in inspect.signature(stream_generate).parameters.values() if p.name in ("model", "tokenizer", "prompt")]
    + [inspect.Parameter("verbose", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False)]
    + [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(stream_generate).parameters.values()
        if p.name not in ("model", "tokenizer", "prompt")
    ],
    return_annotation=str,
)
