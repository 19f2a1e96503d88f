"""The ReDrafter step loop, and ``stream_generate`` / ``generate`` around it.

One step: draft beams from ``(g0, c)``, pack them into a tree, verify the tree
in one LLM call, accept the longest matching prefix, compact the KV cache,
and draft the next beams, all lazily. The loop then syncs once to read the
accepted tokens and the next tree's size (the verify call needs a static
shape). Lookup beams (n-gram matches in the prompt and reply, lookup.py)
join the drafter's beams on the host after that sync, or replace them when
there is no drafter. With neither, tokens come from mlx-lm's own
``generate_step``.

This synchronous loop serves what the pipelined one (pipeline.py, the
default) does not: the adaptive-depth controller, profiling, rotating
(sliding-window) caches and wide, deep drafter trees; and any run with
``DraftConfig(pipelined=False)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse, generate_step
from mlx_lm.models.cache import make_prompt_cache

from .accept import Accepted, accept_greedy, accept_sampling, sample_first
from .errors import RedrafterError
from .lookup import LOOKUP_LENGTH, Lookup, join_beams
from .models import model_parts
from .pipeline import can_pipeline, pipelined_steps
from .profiles import lookup_profile
from .steps import StepStats, StepTokens, host_read, prefill
from .tree import count_nodes, count_rows, pack
from .verify import check_cache, compact_cache, set_cache_length, verify, verify_starts

# The draft shape when neither the caller nor a tuned profile (``mlx-redrafter
# sweep --save-profile``) gives one: the best cell of the sweep of the default
# model and its drafter on a 2-core Linux CPU (bench/RESULTS.md).
DEFAULT_WIDTH = 2
DEFAULT_LENGTH = 1
# Lookup beams beside the drafter's when the caller does not say (see lookup.py).
DEFAULT_LOOKUP = 1


@dataclass
class RedrafterResponse(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` plus the ReDrafter stats of the step
    that produced ``token``."""

    stats: StepStats = field(default_factory=StepStats)


@dataclass
class SamplingConfig:
    """mlx-lm's sampling parameters; ``temp == 0`` is greedy.

    Out-of-range values raise :class:`RedrafterError` (a ``ValueError``).
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0

    def __post_init__(self):
        checks = (
            ("temp", self.temp >= 0, "at least 0", "--temp 0 is greedy decoding; sampling needs a positive temperature."),
            ("top_p", 0 <= self.top_p <= 1, "between 0 and 1", "--top-p 0 turns nucleus sampling off."),
            ("min_p", 0 <= self.min_p <= 1, "between 0 and 1", "--min-p 0 turns min-p sampling off."),
            ("top_k", self.top_k >= 0, "at least 0", "--top-k 0 turns top-k sampling off."),
        )
        for name, ok, bound, fix in checks:
            if not ok:
                raise RedrafterError(f"{name} must be {bound} (got {getattr(self, name)}).", fix)

    @property
    def greedy(self) -> bool:
        return self.temp == 0


@dataclass
class DraftConfig:
    """How the step loop drafts: ``drafter=None, lookup=0`` is plain mlx-lm decoding.

    ``beam_length`` counts drafted tokens (not ``g0``). ``controller`` (an
    adaptive-depth :class:`~mlx_redrafter.controller.Controller`) picks the
    depth to verify each step, up to ``beam_length``. ``lookup`` adds that
    many lookup beams (``lookup_length`` tokens copied from the prompt and
    reply, :mod:`~mlx_redrafter.lookup`) to the drafter's beams; with no
    drafter they are the only drafts. ``pipelined=False`` runs the
    synchronous step loop where the pipelined one (pipeline.py) could run:
    for comparisons; the tokens are the same.
    """

    drafter: object = None
    beam_width: int = DEFAULT_WIDTH
    beam_length: int = DEFAULT_LENGTH
    warp: bool = False
    controller: object = None
    lookup: int = 0
    lookup_length: int = LOOKUP_LENGTH
    pipelined: bool = True  # False: the synchronous loop even where the pipelined one can run

    @property
    def drafting(self) -> bool:
        return self.drafter is not None or self.lookup > 0

    @property
    def feature_layers(self):
        """LLM layers the drafter fuses into its context (None: the last one alone)."""
        return getattr(getattr(self.drafter, "config", None), "feature_layers", None)

    @property
    def margin(self) -> int:
        """Context a verification needs past the last token: ``g0`` and the
        deepest draft (positions run to offset + depth)."""
        if not self.drafting:
            return 0
        depth = max(self.beam_length if self.drafter is not None else 0, self.lookup_length if self.lookup else 0)
        return depth + 1


def draft_shape(model_spec, drafter_path, beam_width: Optional[int] = None, beam_length: Optional[int] = None):
    """``(width, length, source, profile)``: the given values, each missing one
    from the tuned profile of this device + model + drafter, else the built-in
    default. ``profile`` is the profile's dict, or None."""
    width, length, source = DEFAULT_WIDTH, DEFAULT_LENGTH, "built-in default"
    profile = lookup_profile(model_spec, drafter_path) if model_spec and drafter_path else None
    if profile is not None:
        width, length = profile["beam_width"], profile["beam_length"]
        source = f"tuned profile {profile['file']}"
    if beam_width is not None or beam_length is not None:
        # One value alone keeps the other from the profile (or the default): say so.
        both = beam_width is not None and beam_length is not None
        source = "flags" if both else f"flags + {source}"
        width = beam_width if beam_width is not None else width
        length = beam_length if beam_length is not None else length
    return width, length, source, profile


# --------------------------------------------------------------------------- the step loop


class _DrafterBeams:
    """Drafter beams only: they stay on the device; the tree size is counted
    there and read in the step's sync."""

    padded = False

    def __init__(self, embed, draft: DraftConfig):
        self.embed, self.cfg = embed, draft
        self.rows = draft.beam_width  # rows of the beams that come from the drafter

    def draft(self, context, g0):
        """``(beams, depth to verify)``, lazily."""
        cfg = self.cfg
        top_k = cfg.controller.top_k if cfg.controller is not None else 0
        b = cfg.drafter.draft(self.embed, context, g0, cfg.beam_width, cfg.beam_length, warp=cfg.warp, confidences=top_k)
        if cfg.controller is None:
            return b.tokens, mx.array(cfg.beam_length, mx.int32)
        return b.tokens, cfg.controller.choose_depth(b)

    def start(self, context, g0) -> List[mx.array]:
        """Draft the next beams lazily; return what the step's sync reads."""
        self.beams, depth = self.draft(context, g0)
        return [count_nodes(self.beams, depth), depth]

    def finish(self, vals: List[int], emitted: List[int]):
        """``(beams, n_nodes, depth)`` of the next tree, from the synced values."""
        n_nodes, depth = vals
        return self.beams, n_nodes, depth


class _JoinedBeams(_DrafterBeams):
    """The drafter's beams (if any), read in the step's sync, joined on the
    host with lookup beams over the history of emitted tokens; the tree size
    is counted on the host. Rows have different lengths (PAD-padded)."""

    padded = True

    def __init__(self, embed, draft: DraftConfig, prompt: List[int]):
        super().__init__(embed, draft)
        self.rows = draft.beam_width if draft.drafter is not None else 0
        self.lookup = Lookup(prompt)

    def start(self, context, g0) -> List[mx.array]:
        if self.cfg.drafter is None:
            return []
        beams, depth = self.draft(context, g0)
        return [depth, beams]

    def finish(self, vals: List[int], emitted: List[int]):
        cfg = self.cfg
        self.lookup.extend(emitted)
        drafted = []
        if cfg.drafter is not None:
            depth, flat, length = vals[0], vals[1:], cfg.beam_length
            drafted = [flat[w * length : w * length + depth] for w in range(cfg.beam_width)]
        rows = join_beams(drafted, self.lookup.propose(cfg.lookup_length, cfg.lookup), cfg.lookup)
        return mx.array(rows, dtype=mx.int32), count_rows(rows), len(rows[0])


def redrafter_steps(
    model,
    prompt: mx.array,
    cache,
    *,
    draft: DraftConfig,
    sampling: Optional[SamplingConfig] = None,
    profile: bool = False,
    history: Sequence[int] = (),
) -> Iterator[StepTokens]:
    """Yield the tokens of each step: the first one (from the prompt), then
    ``accepted drafts + the LLM's own next token`` per step. Endless; the
    caller stops it. ``history``: tokens before ``prompt`` (already in the
    cache) that lookup drafts may copy from. The pipelined loop
    (pipeline.py) runs where it can (:func:`~mlx_redrafter.pipeline.can_pipeline`);
    ``draft.pipelined=False`` forces this synchronous one."""
    sampling = sampling or SamplingConfig()
    check_cache(cache)
    if draft.pipelined and can_pipeline(cache, draft, profile):
        yield from pipelined_steps(model, prompt, cache, draft=draft, sampling=sampling, history=history)
        return
    embed, backbone, head = model_parts(model, draft.feature_layers)
    if draft.lookup:
        drafts = _JoinedBeams(embed, draft, list(history) + host_read(prompt))
    else:
        drafts = _DrafterBeams(embed, draft)

    syncs = 0
    tic = time.perf_counter()
    logits, context = prefill(backbone, head, cache, prompt)
    g0 = sample_first(logits, sampling)
    vals = host_read(g0, *drafts.start(context, g0))
    syncs += 1
    g0_val = vals[0]
    beams, n_val, d_val = drafts.finish(vals[1:], [g0_val])
    yield StepTokens([g0_val], [False], StepStats(0, 0, 1, time.perf_counter() - tic, syncs))
    step = 0
    while True:
        step += 1
        tic = time.perf_counter()
        times = {}
        offsets = [c.offset for c in cache]
        starts = verify_starts(cache)
        beams = beams[:, :d_val]
        if n_val == 0:
            # Nothing drafted (lookup only, no match): a plain one-token step.
            logits, hidden, acc = _plain_step(backbone, head, cache, g0, d_val, sampling)
            tree_size = 1
            _lap(profile, times, "verify", tic, logits, hidden)
        else:
            tree = pack(beams, n_val, g0, padded=drafts.padded)
            tree_size = tree.size
            _lap(profile, times, "pack", tic, tree.tokens, tree.mask, tree.node_index)
            # A single path (W=1, or all beams alike) has the model's own causal
            # positions and mask: verify it unhooked.
            logits, hidden = verify(model, backbone, head, cache, tree, chain=n_val == d_val)
            _lap(profile, times, "verify", tic, logits, hidden)
            if sampling.greedy:
                acc = accept_greedy(beams, tree.node_index, logits)
            else:
                acc = accept_sampling(beams, tree, logits, sampling)
        _lap(profile, times, "accept", tic, acc.n, acc.next_token, acc.path)
        prev_beams = beams
        g0 = acc.next_token
        pending = drafts.start(hidden[acc.last], g0)
        _lap(profile, times, "draft", tic, *pending)
        vals = host_read(acc.n, acc.beam, g0, acc.path, prev_beams[acc.beam], *pending)
        syncs += 1
        n, beam, g0_val = vals[:3]
        path, row, rest = vals[3 : 4 + d_val], vals[4 + d_val : 4 + 2 * d_val], vals[4 + 2 * d_val :]
        # Most steps accept nothing, or a prefix packed in place (always so for
        # a single path): the cache rows need moving only otherwise. The move
        # stays lazy and runs with the next verify.
        if path[: n + 1] != list(range(n + 1)):
            compact_cache(cache, starts, acc.path)
        set_cache_length(cache, starts, offsets, 1 + n)
        emitted = row[:n] + [g0_val]
        stats = StepStats(
            step, n, tree_size, time.perf_counter() - tic, syncs, beam, d_val,
            source=("drafter" if beam < drafts.rows else "lookup") if n else "",
            draft_time=times.get("draft", 0.0), pack_time=times.get("pack", 0.0),
            verify_time=times.get("verify", 0.0), accept_time=times.get("accept", 0.0),
        )
        beams, n_val, d_val = drafts.finish(rest, emitted)
        yield StepTokens(emitted, [True] * n + [False], stats)


def _plain_step(backbone, head, cache, g0, length: int, sampling):
    """Verify ``g0`` alone: ``(logits, hidden, Accepted)`` of a step that drafted nothing."""
    hidden = backbone(g0.reshape(1, 1), cache=cache)[0]
    logits = head(hidden)
    zero = mx.array(0, mx.int32)
    path = mx.zeros((length + 1,), mx.int32)
    return logits, hidden, Accepted(zero, zero, path, zero, sample_first(logits[0], sampling))


def _lap(profile: bool, times: dict, name: str, start: float, *arrays) -> None:
    """Profile mode only: evaluate ``arrays`` and record the phase's duration."""
    if not profile:
        return
    mx.eval(*arrays)
    now = time.perf_counter()
    times[name] = now - start - sum(times.values())


def plain_steps(model, prompt: mx.array, cache, sampling: Optional[SamplingConfig] = None) -> Iterator[StepTokens]:
    """Plain mlx-lm decoding (``generate_step``), one token per step."""
    from mlx_lm.sample_utils import make_sampler

    sampling = sampling or SamplingConfig()
    sampler = make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
    tic = time.perf_counter()
    for i, (token, _) in enumerate(
        generate_step(prompt, model, max_tokens=-1, sampler=sampler, prompt_cache=cache)
    ):
        now = time.perf_counter()
        yield StepTokens([int(token)], [False], StepStats(i, 0, 1, now - tic, i + 1))
        tic = now


def _steps(model, prompt, prompt_cache, *, draft: DraftConfig, sampling: SamplingConfig, profile: bool = False, history=()):
    """ReDrafter's step iterator, or plain decoding's when nothing drafts."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if not draft.drafting:
        return plain_steps(model, prompt, cache, sampling)
    return redrafter_steps(model, prompt, cache, draft=draft, sampling=sampling, profile=profile, history=history)


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
    profile: bool = False,
):
    """Token-level generation without a tokenizer: ``(tokens, step_stats)``.

    ``draft`` says how to draft (None: plain decoding). Stops after
    ``max_tokens`` tokens or at the first of ``eos_ids`` (which is not
    included), exactly like :func:`stream_generate`. ``profile=True`` fills
    the phase times of the stats (see :func:`stream_generate`).
    """
    draft = draft or DraftConfig()
    sampling = SamplingConfig(temp, top_p, min_p, top_k)
    prompt = mx.array(prompt, dtype=mx.int32) if not isinstance(prompt, mx.array) else prompt
    check_generation_args(model, prompt, draft)
    steps = _steps(model, prompt, prompt_cache, draft=draft, sampling=sampling, profile=profile)
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


# --------------------------------------------------------------------------- streaming text


class StopMatcher:
    """Finds stop strings in streamed text and holds back what could start one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""

    def feed(self, text: str):
        """``(text_to_emit, stopped)``."""
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def encode_prompt(tokenizer, text: str) -> List[int]:
    """Token ids of a prompt string, exactly as :func:`stream_generate` encodes it.

    As mlx-lm: special tokens are added unless the text already starts with
    BOS (a chat template usually writes it).
    """
    add_special = tokenizer.bos_token is None or not text.startswith(tokenizer.bos_token)
    return tokenizer.encode(text, add_special_tokens=add_special)


def _prepare_prompt(tokenizer, prompt) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt.astype(mx.int32)
    if isinstance(prompt, str):
        prompt = encode_prompt(tokenizer, prompt)
    return mx.array(list(prompt), dtype=mx.int32)


def context_limit(model) -> Optional[int]:
    """The model's context in tokens (``max_position_embeddings``), if it says."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def check_generation_args(model, prompt: mx.array, draft: DraftConfig) -> None:
    if prompt.size == 0:
        raise RedrafterError("The prompt is empty.", "Give at least one token of prompt.")
    limit = context_limit(model)
    if limit and prompt.size >= limit:
        raise RedrafterError(
            f"The prompt has {prompt.size} tokens but the model's context is {limit} tokens.",
            "Shorten the prompt.",
        )
    if draft.drafter is not None:
        if draft.beam_width < 1 or draft.beam_length < 1:
            raise RedrafterError(
                f"Beam width and length must be at least 1 (got width {draft.beam_width}, length {draft.beam_length}).",
                f"Use e.g. --beam-width {DEFAULT_WIDTH} --beam-length {DEFAULT_LENGTH}.",
            )
        from .drafter import check_fits

        check_fits(draft.drafter, model)
    if draft.lookup < 0 or draft.lookup_length < 1:
        raise RedrafterError(
            f"lookup must be at least 0 beams of at least 1 token (got {draft.lookup} of {draft.lookup_length}).",
            "Use lookup=True (one lookup beam) or lookup=False.",
        )


def lookup_beams(lookup, drafter, profile: Optional[dict] = None) -> int:
    """Lookup beams for a public ``lookup=`` (True, False, a count, or None:
    the tuned profile's choice, else ``DEFAULT_LOOKUP`` with a drafter and
    none without)."""
    if lookup is not None:
        return int(lookup)
    if drafter is None:
        return 0
    return int(profile.get("lookup", DEFAULT_LOOKUP)) if profile else DEFAULT_LOOKUP


def library_draft(model, drafter, beam_width: Optional[int], beam_length: Optional[int], lookup=None, **kw) -> DraftConfig:
    """The :class:`DraftConfig` of a public call: a width or length not given
    (None) comes from the tuned profile of this device when the model and the
    drafter were loaded by :func:`~mlx_redrafter.models.load_model` and
    :func:`~mlx_redrafter.drafter.load_drafter` (they record where from), else
    from the built-in defaults; so does ``lookup`` (see :func:`lookup_beams`)."""
    profile = None
    if drafter is not None and (beam_width is None or beam_length is None or lookup is None):
        spec, path = getattr(model, "redrafter_spec", None), getattr(drafter, "source_path", None)
        beam_width, beam_length, _, profile = draft_shape(spec, path, beam_width, beam_length)
    width = DEFAULT_WIDTH if beam_width is None else beam_width
    length = DEFAULT_LENGTH if beam_length is None else beam_length
    return DraftConfig(drafter, width, length, lookup=lookup_beams(lookup, drafter, profile), **kw)


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
    profile: bool = False,
    controller=None,
    lookup: Optional[Union[bool, int]] = None,
    lookup_context: Sequence[int] = (),
) -> Iterator[RedrafterResponse]:
    """Stream a reply, like ``mlx_lm.stream_generate``, with ReDrafter when a
    ``drafter`` is given (plain decoding when it is ``None``).

    ``lookup`` adds drafts copied from the prompt and the reply (n-gram
    lookup): ``True`` or a number of lookup beams, ``False`` for none;
    ``None`` is ``DEFAULT_LOOKUP`` with a drafter and none without.
    ``drafter=None, lookup=True`` is speculative decoding with lookup drafts
    only, for any model. ``lookup_context``: earlier tokens already in
    ``prompt_cache`` (a chat's previous turns) that lookup may copy from.

    ``beam_length`` counts drafted tokens (not ``g0``). A width or length
    not given comes from this device's tuned profile (``mlx-redrafter sweep
    --save-profile``) when the model and drafter were loaded with this
    package's loaders, else from ``DEFAULT_WIDTH``/``DEFAULT_LENGTH``. Bad
    arguments raise :class:`RedrafterError` (a ``ValueError``). At ``temp == 0`` the
    tokens equal plain greedy decoding; at ``temp > 0`` they follow the
    model's own sampling distribution (after ``top_p``/``min_p``/``top_k``).
    EOS, ``stop`` strings and ``max_tokens`` end the output exactly, even in
    the middle of an accepted run. ``profile=True`` adds syncs to split the
    step time into pack / verify / accept / draft.

    ``prompt_cache`` (a list from ``make_prompt_cache``) is updated in place.
    When the stream ends its offset covers the prompt and the emitted
    tokens, sometimes minus the last one and, when EOS or a stop string ends
    an accepted run early, plus accepted tokens that were not emitted; use
    :func:`trim_cache` to bring it to a known length.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    sampling = SamplingConfig(temp, top_p, min_p, top_k)
    if max_tokens < 1:
        raise RedrafterError(f"max_tokens must be at least 1 (got {max_tokens}).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _prepare_prompt(tokenizer, prompt)
    draft = library_draft(model, drafter, beam_width, beam_length, lookup, warp=warp, controller=controller)
    check_generation_args(model, prompt, draft)
    if seed is not None:
        mx.random.seed(seed)
    steps = _steps(model, prompt, prompt_cache, draft=draft, sampling=sampling, profile=profile, history=lookup_context)

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
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed if n > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stats=stats,
        )

    try:
        for step in steps:
            if step.stats.step == 0:
                prompt_tps = prompt.size / max(time.perf_counter() - tic, 1e-9)
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


def trim_cache(cache, length: int) -> bool:
    """Trim every layer so that it holds exactly ``length`` tokens.

    Returns False (and changes nothing) when a layer cannot be trimmed
    (a rotating window that has wrapped) or holds fewer tokens: rebuild the
    cache from the tokens then.
    """
    from mlx_lm.models.cache import can_trim_prompt_cache

    current = cache[0].offset
    if current < length or not can_trim_prompt_cache(cache):
        return current == length
    for c in cache:
        c.trim(c.offset - length)
    return True


@dataclass
class Tally:
    """Totals over a stream of responses: tokens, steps, accepted drafts, speed."""

    tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    lookup_tokens: int = 0  # the part of drafted_tokens that came from lookup beams
    last: Optional[RedrafterResponse] = None
    _step: int = -1

    def add(self, r: RedrafterResponse) -> bool:
        """Count a response; False for the EOS response, which emits no token."""
        self.last = r
        if r.generation_tokens <= self.tokens:
            return False
        self.tokens = r.generation_tokens
        self.drafted_tokens += int(r.from_draft)
        self.lookup_tokens += int(r.from_draft and r.stats.source == "lookup")
        if r.stats.step != self._step:
            self.steps += 1
            self._step = r.stats.step
        return True

    def merge(self, other: "Tally") -> None:
        """Add the totals of another stream (e.g. one chat turn) to these."""
        self.tokens += other.tokens
        self.steps += other.steps
        self.drafted_tokens += other.drafted_tokens
        self.lookup_tokens += other.lookup_tokens
        self.last = other.last or self.last

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def draft_share(self) -> float:
        """The fraction of tokens that came from accepted drafts."""
        return self.drafted_tokens / max(self.tokens, 1)

    @property
    def lookup_share(self) -> float:
        """The fraction of tokens that came from accepted lookup drafts."""
        return self.lookup_tokens / max(self.tokens, 1)

    def draft_summary(self) -> str:
        """``"40% from drafts"``, split by source when lookup drafts were accepted."""
        text = f"{self.draft_share:.0%} from drafts"
        if self.lookup_tokens:
            drafter = (self.drafted_tokens - self.lookup_tokens) / max(self.tokens, 1)
            text += f" ({drafter:.0%} drafter, {self.lookup_share:.0%} lookup)"
        return text

    def summary(self) -> str:
        r = self.last
        if r is None:
            return "no tokens generated"
        return (
            f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
            f"generation: {self.tokens} tokens, {r.generation_tps:.1f} tok/s, "
            f"{self.tokens_per_step:.2f} tokens/step, "
            f"{self.draft_summary()} | "
            f"peak memory {r.peak_memory:.2f} GB"
        )


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
