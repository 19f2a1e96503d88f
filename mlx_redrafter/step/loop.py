"""The step loop: one skeleton, two schedules.

Each step: the plan's sources propose rows (step/source.py), one tree
builder makes the tree to verify (step/build.py: packed, laid out or
chosen), one forward of the unmodified model verifies it (step/verify.py),
one acceptance keeps the longest path the model agrees with, and one read
per step brings the result to the host (step/protocol.py). The two
schedules differ only in when a step is read:

* **build ahead** (:func:`ahead_steps`, the default): step ``t + 1`` is
  built and queued before step ``t`` is read, like mlx-lm's
  ``generate_step``, so the device never waits for Python. Every shape must
  be known a step early: rows are laid out (or chosen at a bucket's size),
  the cache keeps every verified row and masks the rejected ones as holes
  (:class:`~mlx_redrafter.llm.cache.HoleyCache`), and sources that propose
  from the host's tokens line their rows up with the step in flight.
* **read, then build** (step/after_read.py ``after_read_steps``): each step is read before
  the next is built. Sources that need what the host read run here: a
  source that catches up on the accepted tokens' hidden states (an MTP head,
  an EAGLE-3 head, a draft model), a controller whose depth is read, a
  grammar whose masks follow the accepted tokens; and so do sliding-window
  caches (no holes), timings (a sync per phase), and wide trees whose rows
  share prefixes (packed when every row is on the host). The cache moves the
  accepted rows into place after each read.

A grammar is a mask on the read-then-build schedule (step/grammar.py
:class:`~mlx_redrafter.step.grammar.GrammarMask`): it prunes the rows, masks
each node's logits and adds its forced tokens as a row. Timings wrap the
phases (:class:`Laps`). The loops are endless; the caller stops them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..llm.cache import (
    HoleyCache,
    attach_sources,
    drop_sources,
    target_size,
)
from ..llm.parts import hidden_size, model_parts
from ..llm.recurrent import cache_length, recurrent_states, restore_states, take_tree_states
from .accept import Accepted, sample_first
from .build import Built, Candidates, accept, build
from .drafts import Drafts, columns, costly_names, fused_layers, source_names  # noqa: F401  (columns: re-exported)
from .governor import Governor, mode_of
from .keep import kept, live_key, opened
from .live_cost import LiveCost
from .protocol import StepRead, StepTokens, first_step, host_read, prefill, step_read
from .select import code_candidate
from .shadow import Shadow
from .source import At, Flight
from .verify import install_tree_hooks, needs_hooks, tree_hooks


class Laps:
    """Timings: each phase's time, with a sync at its end (``on=False``: nothing)."""

    def __init__(self, on: bool):
        self.on, self.times, self.start = on, {}, 0.0

    def begin(self, start: float) -> None:
        self.times, self.start = {}, start

    def lap(self, name: str, *arrays) -> None:
        if not self.on:
            return
        mx.eval(*arrays)
        spent = time.perf_counter() - self.start - sum(self.times.values())
        self.times[name] = self.times.get(name, 0.0) + spent


class Generation:
    """One generation's model parts, drafts and tree policy around the target's cache."""

    def __init__(self, model, cache, plan, sampling, history: List[int], grammar=None, ahead: bool = False):
        self.model, self.plan, self.sampling, self.ahead = model, plan, sampling, ahead
        self.grammar = grammar
        sources = list(plan.sources) + ([grammar.source()] if grammar is not None else [])
        self.embed, self.backbone, self.lm_head = model_parts(model, fused_layers(sources) or None)
        self.auto = plan.tree.open(sources, live=plan.governed)
        self.drafts = Drafts(
            sources, model, self.embed, hidden_size(model), list(history), self.auto is not None, sampling.greedy, ahead
        )
        self.governor = self._governor(model, plan) if plan.governed and plan.sources else None
        self.shadow = None if self.governor is None else Shadow(self.names, self.drafts.proposers, self.governor.arms)
        size = target_size(model)
        keepers = [p for p in self.drafts.proposers if p.make_cache is not None]
        if keepers:
            for p, caches in zip(keepers, attach_sources(cache, size, [p.make_cache for p in keepers])):
                p.attach(caches)
        else:  # a generation without them would leave their caches behind the model's
            drop_sources(cache, size)
        self.cache = cache[:size]
        self.laps = Laps(False)

    def _governor(self, model, plan) -> Governor:
        """The plan's governor, started from what earlier generations learned (step/keep.py)."""
        self.names = source_names(plan.sources)
        self.key = live_key(model, self.names)
        governor = Governor(self.names, plan.starts_plain, costly_names(self.names, plan.sources))
        state = opened(self.key) or {}
        governor.restore(state.get("governor"))
        if self.auto is not None and self.auto.live is not None and state.get("cost"):
            try:
                self.auto.live = LiveCost.from_dict(state["cost"])
                self.auto.curve = self.auto.live.curve()
            except ValueError:  # another version's: start from the stored curve
                pass
        return governor

    def next_arm(self) -> Tuple[Optional[frozenset], bool]:
        """The governor's ``(arm, probing)`` for the step about to be drafted:
        only its sources propose (the grammar's forced rows always do).
        ``(None, False)`` when ungoverned: every source proposes."""
        if self.governor is None:
            return None, False
        arm, probing = self.governor.choose()
        on = [n in arm for n in self.names]
        self.drafts.on = on + [True] * (len(self.drafts.proposers) - len(on))
        return arm, probing

    @property
    def history(self) -> List[int]:
        return self.drafts.history

    def emitted(self, tokens: List[int]) -> None:
        """The host read these tokens: the drafts and tree auto's context grow by them."""
        if self.auto is not None:
            self.auto.advance(len(tokens))
        self.drafts.emitted(tokens)
        if self.shadow is not None:
            for arm, k in self.shadow.emitted(self.drafts.history):
                self.governor.saw(arm, k)

    def timed(self, out: StepTokens, size: int, arm=None, probing: bool = False) -> StepTokens:
        """A step of ``size`` tokens, run with ``arm``, emitted ``out`` in its
        ``stats.step_time``: the live cost and the governor learn from it, and
        its stats say whether it drafted (``mode``)."""
        seconds = out.stats.step_time
        if self.auto is not None:
            self.auto.timed(size, seconds, sorted(arm or ()))
        if self.governor is not None and arm is not None:
            self.governor.ran(arm, len(out.tokens), seconds, probing)
            out.stats.mode, out.stats.plain_rate = mode_of(arm, probing), self.governor.plain_rate
        return out

    def close(self) -> None:
        self.drafts.close()
        if self.governor is not None and self.governor.step:
            state = {"governor": self.governor.to_dict()}
            if self.auto is not None and self.auto.live is not None:
                state["cost"] = self.auto.live.to_dict()
            kept(self.key, state)

    # ------------------------------------------------------------------ one step

    def forward(self, tree, chain: bool, holes: Optional[HoleyCache] = None, base=None) -> mx.array:
        """``hidden [N, F]`` of ``tree``'s tokens. A cache with holes needs
        the device's positions and validity; a chain without holes is the
        model's own causal call; ``g0`` alone needs no hook."""
        tokens = tree.tokens[None]
        if holes is not None and holes.dirty:
            with tree_hooks(self.model, self.cache, tree, base=base, valid=holes.valid(), chain=chain):
                return self.backbone(tokens, cache=self.cache)[0]
        if tree.size == 1 or not needs_hooks(self.model, chain):
            return self.backbone(tokens, cache=self.cache)[0]
        with tree_hooks(self.model, self.cache, tree, chain=chain):
            return self.backbone(tokens, cache=self.cache)[0]

    def verify(self, built: Built, holes=None, base=None, masks=None):
        """``(hidden, Accepted)`` of a built tree (lazy); the recurrent layers take the accepted node's state."""
        hidden = self.forward(built.tree, built.chain, holes, base)
        self.laps.lap("verify", hidden)
        logits = self.lm_head(hidden)
        if masks is None:
            acc = accept(built, logits, self.sampling)
        else:  # a grammar: every node's logits masked by its own state
            acc = self.grammar.accept(built, logits, masks, self.sampling)
        self.laps.lap("accept", acc.n, acc.next_token, acc.path)
        take_tree_states(self.cache, acc.last)  # a hooked call keeps every node's state pending
        return hidden, acc

    def learn(self, built: Built, read: StepRead, codes: List[int], before: List[int]) -> None:
        """tree auto: learn from the verified nodes' codes and the accepted path,
        and (greedy) from host rows the step left out (``before``: what they repeat first)."""
        if self.auto is None or built.structure is None:
            return
        self.auto.observe(built.structure, codes, read.path[: read.n + 1])
        if built.host:
            cal = self.auto.cal
            verified = {built.structure.source[code_candidate(c, built.structure)] for c in codes if c >= 0}
            for rows, scores, prior in built.host:
                if cal.channel(prior) not in verified:
                    self.auto.observe_unverified(rows, scores, prior, before, read.emitted)


# --------------------------------------------------------------------------- build ahead


@dataclass
class _Queued:
    """A step built and queued, not read yet (all lazy but the shapes)."""

    read: Optional[mx.array]  # what the host will read: [n, beam, g0, path, row, codes...]
    g0: mx.array  # the LLM's own token after the accepted drafts: the next root
    context: mx.array  # hidden state where g0 was predicted
    real: mx.array  # tokens in the cache once this step is kept (device scalar)
    row: mx.array  # [depth] the row the accepted drafts come from
    n: mx.array  # accepted drafts
    built: Optional[Built] = None
    before: list = field(default_factory=list)  # the recurrent layers' states before it (put back if never read)
    arm: Optional[frozenset] = None  # the governor's arm it was drafted with (None: ungoverned)
    probing: bool = False

    @property
    def depth(self) -> int:
        return 0 if self.built is None else self.built.depth

    @property
    def size(self) -> int:
        return 1 if self.built is None else self.built.size


def _kept(size: int, acc: Accepted, depth: int) -> mx.array:
    """``[size]`` bool: the verified rows on the accepted path (the cache's real tokens)."""
    on_path = mx.arange(depth + 1) <= acc.n
    return ((mx.arange(size)[:, None] == acc.path[None, :]) & on_path[None, :]).any(axis=1)


def _queue(gen: Generation, holes: HoleyCache, prev: _Queued) -> _Queued:
    """Build the step after ``prev`` (lazily)."""
    before = recurrent_states(gen.cache)
    arm, probing = gen.next_arm()
    flight = Flight(prev.row, prev.n, prev.g0, prev.depth)
    blocks = gen.drafts.propose(At(prev.g0, prev.context, gen.history, flight=flight))
    cands = Candidates([b for b in blocks if b is not None])
    built = build(cands, prev.g0, gen.auto, packed=False, greedy=gen.sampling.greedy)
    hidden, acc = gen.verify(built, holes, base=prev.real)
    holes.append(built.size, _kept(built.size, acc, built.depth))
    row = built.beams[acc.beam]
    read = step_read(acc, row)
    read = read if built.codes is None else mx.concatenate([read, built.codes])
    return _Queued(
        read, acc.next_token, hidden[acc.last], prev.real + 1 + acc.n, row, acc.n, built, before, arm, probing
    )


def ahead_steps(model, prompt: mx.array, cache, plan, sampling, history: Sequence[int] = ()) -> Iterator[StepTokens]:
    """The build-ahead schedule (see the module doc)."""
    install_tree_hooks(model)  # refuses unsupported positions before any work
    gen = Generation(model, cache, plan, sampling, list(history) + host_read(prompt), ahead=True)
    tic = time.perf_counter()
    logits, context = prefill(gen.backbone, gen.lm_head, gen.cache, prompt)
    holes = HoleyCache(gen.cache)
    length = cache_length(gen.cache) or 0
    if gen.auto is not None:
        gen.auto.advance(length)  # the prompt (and any cached turns): trees are priced at their context
    g0 = sample_first(logits, sampling)
    zero = mx.array(0, mx.int32)
    queued = _Queued(None, g0, context, mx.array(length, mx.int32), zero.reshape(1)[:0], zero)
    unread = None  # the step queued and not read: undone if the loop ends here
    try:
        # Read g0 before queueing step 1: a read queued behind a step waits for it.
        g0_val, syncs = host_read(g0)[0], 1
        queued = unread = _queue(gen, holes, queued)
        mx.async_eval(queued.read)
        before = [g0_val]
        gen.emitted(before)
        yield first_step(g0_val, time.perf_counter() - tic, syncs)
        step = 0
        while True:
            step, tic = step + 1, time.perf_counter()
            following = unread = _queue(gen, holes, queued)
            mx.async_eval(following.read)
            built = queued.built
            read = StepRead.parse(host_read(queued.read), built.depth)
            syncs += 1
            kept = set(read.path[: read.n + 1])
            holes.settle([i in kept for i in range(built.size)])
            if following.size == 1 and holes.dirty and all(size == 1 for size in holes.unread):
                # Plain decoding from here (the governor parked drafting): squeeze the holes out
                # once, so that its steps are the model's own calls, without masks.
                holes.compact()
            gen.learn(built, read, read.rest, before)
            before = read.emitted
            gen.emitted(before)
            elapsed = time.perf_counter() - tic
            out = read.tokens(step, built.size, elapsed, syncs, built.depth, built.labels)
            yield gen.timed(out, built.size, queued.arm, queued.probing)
            queued = following
    finally:
        holes.compact(drop_unread=True)
        if unread is not None:
            restore_states(gen.cache, unread.before)
        gen.close()
