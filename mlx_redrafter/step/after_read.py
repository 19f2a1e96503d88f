"""The read-then-build schedule of the one step (step/loop.py's module doc).

Each step is read before the next is built: sources that need what the host
read (a source that catches up on the accepted tokens' hidden states, a
controller whose depth is read, a grammar whose masks follow the accepted
tokens), sliding-window caches, timings and packed trees run here. A step
the governor (step/governor.py) runs plain is the model's own call, and a
run of them is queued a step ahead, as mlx-lm's loop does, so that plain
decoding here is as fast as plain decoding anywhere. A drafting step's next
arm is chosen before its read where a source proposes early (on the device,
read with the step), else once the step is timed: the governor then decides
on every step's time, and an arm's last step before another, like a
generation's first drafting step, is measured (an MTP head's or a draft
model's first run measures its steps two steps sooner).
"""

from __future__ import annotations

import time
from typing import Iterator, List, Sequence

import mlx.core as mx

from ..llm.cache import compact_cache, kv_leaves, kv_offsets, set_cache_length, verify_starts
from ..llm.recurrent import cache_length, recurrent_states, restore_states
from .accept import sample_first
from .build import build
from .governor import PLAIN
from .loop import Generation, Laps
from .plan import holes_fit
from .protocol import StepRead, StepStats, StepTokens, first_step, host_read, prefill, step_read
from .verify import install_tree_hooks


def after_read_steps(
    model,
    prompt: mx.array,
    cache,
    plan,
    sampling,
    history: Sequence[int] = (),
    grammar=None,
    timings: bool = False,
) -> Iterator[StepTokens]:
    """The read-then-build schedule (see the module doc). ``grammar``: a
    :class:`~mlx_redrafter.step.grammar.GrammarMask`; the loop ends after
    its EOS."""
    install_tree_hooks(model)  # refuses unsupported positions before any work
    prompt_ids = host_read(prompt)
    gen = Generation(model, cache, plan, sampling, list(history) + prompt_ids, grammar=grammar)
    gen.laps = Laps(timings)
    # Plain steps may run a step ahead where nothing reads each one (a grammar's masks,
    # timings' syncs) and the last can be dropped from the cache (no sliding window).
    ahead_ok = grammar is None and not timings and holes_fit(model, cache)
    run = _AfterRead(gen, plan.tree.packed or grammar is not None, ahead_ok)
    try:
        out = run.first(prompt, prompt_ids)
        yield out
        while grammar is None or not grammar.ended(out):
            out = run.step()
            yield out
    finally:
        run.close()
        gen.close()


class _AfterRead:
    """The read-then-build schedule between two steps: the next root ``g0``
    (on the device and the host), the hidden state where it was predicted,
    and the next step's candidates. ``host``: every row reaches the host
    before the tree is built (a packed tree, a grammar's masks)."""

    def __init__(self, gen: Generation, host: bool, ahead_ok: bool):
        self.gen, self.host, self.step_no, self.syncs = gen, host, 0, 0
        self.ahead_ok = ahead_ok  # plain steps may be queued a step ahead
        self.queued = None  # (token, hidden, flat token): the next plain step, queued before this one was read
        self.before: list = []  # the recurrent states before it (put back if it is never read)

    def first(self, prompt: mx.array, prompt_ids: List[int]) -> StepTokens:
        gen, grammar, drafts = self.gen, self.gen.grammar, self.gen.drafts
        sink = None
        if drafts.stateful:

            def sink(start, hidden):
                drafts.entered(prompt_ids[start : start + hidden.shape[0]], hidden)

        tic = time.perf_counter()
        logits, context = prefill(gen.backbone, gen.lm_head, gen.cache, prompt, sink=sink)
        if gen.auto is not None:
            gen.auto.advance(cache_length(gen.cache) or 0)  # trees are priced at their context
        g0 = sample_first(logits if grammar is None else grammar.root(logits), gen.sampling)
        self.arm = gen.next_arm()
        if self.arm[0] and not any(drafts.early):  # nothing of its first step runs before it is timed
            gen.governor.measure_first()
        vals = host_read(g0, *drafts.early_reads(g0, context, self.host))
        self.g0, self.g0_val, self.syncs = g0, vals[0], 1 + drafts.reads()
        gen.emitted([self.g0_val])
        self.context, self.rest = context, vals[1:]
        out = first_step(self.g0_val, time.perf_counter() - tic, self.syncs)
        return out if grammar is None else grammar.consume(out)

    def step(self) -> StepTokens:
        if self.arm[0] == PLAIN:
            return self._plain()
        gen, grammar, drafts, laps = self.gen, self.gen.grammar, self.gen.drafts, self.gen.laps
        self.step_no, tic = self.step_no + 1, time.perf_counter()
        laps.begin(tic)
        # The sources that need the read propose now: a stateful one catches up
        # first, so that its cache never runs ahead of the target's when the loop ends here.
        cands, masks = drafts.late(self.rest, self.host, self.g0, self.context, self.g0_val), None
        laps.lap("draft", *[b.tokens for b in cands.blocks])
        self.syncs += drafts.reads()
        offsets, starts = kv_offsets(gen.cache), verify_starts(gen.cache)
        if grammar is not None:
            cands, words = grammar.prune(cands)
        built = build(cands, self.g0, gen.auto, packed=self.host, greedy=gen.sampling.greedy)
        if grammar is not None:
            masks = grammar.masks(words, built)
        laps.lap("pack", built.tree.tokens, built.tree.mask)
        hidden, acc = gen.verify(built, masks=masks)
        g0, context = acc.next_token, hidden[acc.last]
        (arm, probing), ahead = self.arm, any(drafts.early)
        if ahead:  # the next step's sources propose early: its arm is chosen before this step's time is known
            self.arm = gen.next_arm()
        early = drafts.early_reads(g0, context, self.host)  # the next step's device rows, lazily
        laps.lap("draft", *early)
        codes = () if built.codes is None else (built.codes,)
        read = StepRead.parse(host_read(step_read(acc, built.beams[acc.beam]), *codes, *early), built.depth)
        self.syncs += 1
        k = 0 if built.codes is None else built.codes.size
        # Most steps accept nothing, or a prefix packed in place (always so for
        # a single path): the cache rows need moving only otherwise. The move
        # stays lazy and runs with the next verify.
        if not read.in_place:  # the path's padding past a chosen tree's size would write past a window's end
            compact_cache(gen.cache, starts, acc.path[: min(built.size, built.depth + 1)])
        set_cache_length(gen.cache, starts, offsets, 1 + read.n)
        gen.learn(built, read, read.rest[:k], [])
        if drafts.stateful:
            drafts.entered([self.g0_val] + read.row[: read.n], hidden[mx.array(read.path[: read.n + 1], mx.int32)])
        gen.emitted(read.emitted)
        self.g0, self.g0_val, self.context, self.rest = g0, read.g0, context, read.rest[k:]
        out = read.tokens(self.step_no, built.size, 0.0, 0, built.depth, built.labels)
        out = out if grammar is None else grammar.consume(out)
        out.stats.step_time, out.stats.host_syncs = time.perf_counter() - tic, self.syncs
        out.stats = _timed(out.stats, laps)
        out = gen.timed(out, built.size, arm, probing)
        if not ahead:  # nothing proposes before the read: the next arm is chosen knowing this step's time
            self.arm = gen.next_arm()
        return out

    def _plain(self) -> StepTokens:
        """A step of plain decoding (the governor's choice): ``g0`` alone through
        the model's own call. When the next step is plain too, it is queued before
        this one is read, as mlx-lm's loop does, so the device never waits for
        the host; sources with caches of their own keep what entered the target's
        to catch up on when they next draft."""
        gen, drafts = self.gen, self.gen.drafts
        self.step_no, tic = self.step_no + 1, time.perf_counter()
        token, hidden, flat = self.queued if self.queued is not None else self._forward(self.g0)
        self.queued = None
        (arm, probing), self.arm = self.arm, gen.next_arm()
        early = []
        if self.ahead_ok and self.arm[0] == PLAIN:
            self.before = recurrent_states(gen.cache)
            self.queued = self._forward(token)
            mx.async_eval(self.queued[2])
        else:  # the next step drafts: its early sources propose now, read with this step
            early = drafts.early_reads(token, hidden[-1], self.host)
        # The token's own flat array, evaluated with its step: a new op on it here would
        # wait behind the step queued above, and the device would idle while the host builds.
        vals = host_read(flat, *early)
        self.syncs += 1 + drafts.reads()
        if drafts.stateful:
            drafts.entered([self.g0_val], hidden)
        gen.emitted(vals[:1])
        self.g0, self.g0_val, self.context, self.rest = token, vals[0], hidden[-1], vals[1:]
        out = StepTokens(vals[:1], [False], StepStats(self.step_no, 0, 1, time.perf_counter() - tic, self.syncs))
        return gen.timed(out, 1, arm, probing)

    def _forward(self, g0: mx.array):
        """``(next token, hidden [1, F], the token as a flat int32 [1])`` of
        ``g0`` through the model's own call (lazy)."""
        gen = self.gen
        hidden = gen.backbone(g0.reshape(1, 1), cache=gen.cache)[0]
        token = sample_first(gen.lm_head(hidden)[0], gen.sampling)
        return token, hidden, token.reshape(1)

    def close(self) -> None:
        """The loop ends: a plain step queued and never read is undone."""
        if self.queued is not None:  # its token entered the attention layers; their recurrent states come back whole
            for c in kv_leaves(self.gen.cache):
                c.trim(1)
            restore_states(self.gen.cache, self.before)
            self.queued = None


def _timed(stats, laps: Laps):
    if laps.on:
        t = laps.times
        stats.draft_time, stats.pack_time = t.get("draft", 0.0), t.get("pack", 0.0)
        stats.verify_time, stats.accept_time = t.get("verify", 0.0), t.get("accept", 0.0)
    return stats
