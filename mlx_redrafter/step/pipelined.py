"""The pipelined ReDrafter loop: step t+1 is queued before step t is read.

The synchronous loop (synchronous.py) must read each step before it can build
the next one: the next tree's size and the cache's length depend on what was
accepted. Meanwhile the device idles while Python builds the next graph.
Here every shape is known on the host a step ahead, so the loop works like
mlx-lm's ``generate_step``: build step t+1, ``async_eval`` it, then read
step t (the one sync per step), which has usually finished by then.

* **Unpacked trees.** Each row (a drafter beam, a lookup draft) owns its
  nodes (:class:`~mlx_redrafter.step.tree.Layout`), so a tree's size is
  ``1 + sum(row lengths)``, known before the beams are.
* **A cache with holes.** Every verified node's key and value row stays in
  the cache; the rejected ones are holes, masked out by a validity vector
  built on the device. Positions come from a device count of real tokens
  (``TreeRoPE``'s base). Holes the host has read about are squeezed out when
  they reach ``COMPACT_HOLES`` rows, and when the loop ends (so the caller
  gets an ordinary cache back): :class:`~mlx_redrafter.llm.cache.HoleyCache`.
* **Lookup on the device.** One lookup draft (the default) is proposed on
  the device (:class:`~mlx_redrafter.draft.lookup.DeviceLookup`) from a history
  that each queued step extends with its accepted tokens, so it is as fresh
  as in the synchronous loop. Whether a step verifies a lookup row at all is
  decided on the host from the tokens read so far (a row costs its tokens'
  compute even when it matches nothing). More lookup drafts are proposed on
  the host, one step longer than needed, and lined up on the device with
  what the step in flight accepts; a draft that does not line up is padding.
  Where the host's lookup finds nothing, one datastore row
  (:mod:`~mlx_redrafter.draft.datastore.use`) is proposed and lined up the same way.

Used when every cache is a ``KVCache`` or ``QuantizedKVCache``, neither
the adaptive-depth controller nor timings are on, and the drafter's tree
is small or shares no prefixes (:func:`~mlx_redrafter.step.dispatch.can_pipeline`);
otherwise the synchronous loop runs (synchronous.py). Exactness is the same: the verified
logits of a node depend only on its real ancestors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence

import mlx.core as mx

from ..draft.datastore.index import StoreLookup
from ..draft.datastore.use import DATASTORE, context_or_store, row_sources
from ..draft.lookup import DeviceLookup, Lookup
from ..llm.cache import HoleyCache
from ..llm.parts import model_parts
from ..llm.recurrent import cache_length, recurrent_states, restore_states, take_tree_states
from .accept import Accepted, accept_greedy, accept_sampling, sample_first
from .auto import AutoTree, drafter_scores
from .protocol import StepRead, StepTokens, draft_beams, first_step, host_read, prefill, step_read
from .select import N_BUCKETS, SOURCES
from .tree import PAD, Tree, layout, merged_parent
from .verify import install_tree_hooks, needs_hooks, tree_hooks


@dataclass
class _Queued:
    """A step queued on the device. The host knows its shape, not its result."""

    read: mx.array  # protocol.step_read: [n, beam, next token, path (depth + 1), accepted row (depth)]
    g0: mx.array  # the LLM's own token after the accepted drafts: the next root
    context: mx.array  # hidden state of the last accepted node
    real: mx.array  # tokens in the cache once this step is kept (device scalar)
    row: mx.array  # [depth] the row the accepted drafts come from
    n: mx.array  # accepted drafts
    depth: int  # longest row (0: a tree of g0 alone)
    size: int  # tokens verified
    structure: object = None  # tree="auto": the candidates' Structure (the read ends with Selection.codes)
    sources: tuple = ()  # each row's source (draft/datastore/use.py's row_sources)
    host_rows: tuple = ()  # tree="auto", greedy: (proposals, scores, source) the host proposed for this step
    before: list = None  # the recurrent layers' states before this step (put back if it is never read)


def line_up(proposals: mx.array, row: mx.array, n: mx.array, g0: mx.array, length: int) -> mx.array:
    """Lookup drafts proposed one step late, lined up with the step in flight.

    ``proposals [K, P]`` continue the history the host has read; the step in
    flight emits ``row[:n]`` then ``g0``. A proposal that starts with those
    tokens yields its next ``length`` tokens; one that does not is all
    ``PAD`` (verified, never accepted). ``P`` is ``len(row) + 1 + length``.
    """
    d = row.shape[0]
    idx = mx.arange(d + 1)
    emitted = mx.where(idx == n, g0, mx.concatenate([row, mx.zeros((1,), row.dtype)]))
    same = (proposals[:, : d + 1] == emitted[None]) | (idx > n)[None]
    rest = mx.take(proposals, n + 1 + mx.arange(length), axis=1)
    return mx.where(same.all(axis=1, keepdims=True), rest, PAD)


@dataclass
class _Rows:
    """The next step's draft rows: tokens and node scores (lazy), lengths and sources (host)."""

    parts: List[mx.array] = field(default_factory=list)  # [rows, length] token blocks, one per source
    lengths: List[int] = field(default_factory=list)  # each row's length
    scores: List[object] = field(default_factory=list)  # per block, tree="auto": its nodes' scores
    host_scores: List[float] = field(default_factory=list)  # per node: what the host knows (NaN: on the device)
    host_rows: tuple = ()  # (proposals, scores, source) the host proposed
    source: object = None  # the host rows' source (lookup or datastore)

    def beams(self) -> mx.array:
        """Every row, PAD-padded to the longest: ``[R, depth]``."""
        depth = max(self.lengths)
        return mx.concatenate([mx.pad(p, [(0, 0), (0, depth - p.shape[1])], constant_values=PAD) for p in self.parts])


def _kept(size: int, acc: Accepted, depth: int) -> mx.array:
    """``[size]`` bool: the verified rows on the accepted path (the cache's real tokens)."""
    on_path = mx.arange(depth + 1) <= acc.n
    return ((mx.arange(size)[:, None] == acc.path[None, :]) & on_path[None, :]).any(axis=1)


class _Pipeline:
    def __init__(self, model, cache, draft, sampling, history: List[int]):
        self.model, self.cache, self.cfg, self.sampling = model, cache, draft, sampling
        self.embed, self.backbone, self.head = model_parts(model, draft.feature_layers)
        self.lookup = Lookup(history) if draft.lookup else None
        # One lookup draft (the default) is proposed on the device from the
        # freshest history; more come from the host, one step late.
        self.fresh = DeviceLookup(history) if draft.lookup == 1 else None
        self.store = StoreLookup(draft.datastore, history) if draft.datastore is not None else None
        self.kv = None  # set after the prefill
        self.auto = AutoTree(draft.curve) if draft.tree == "auto" else None

    def rows(self, prev: _Queued) -> _Rows:
        """The next step's rows (see :class:`_Rows`)."""
        cfg, rows = self.cfg, _Rows()
        if cfg.drafter is not None:
            beams = draft_beams(cfg, self.embed, prev.context, prev.g0)
            rows.parts.append(beams.tokens)
            rows.scores.append(drafter_scores(beams) if self.auto is not None else None)
            rows.lengths += [cfg.beam_length] * cfg.beam_width
            rows.host_scores += [float("nan")] * (cfg.beam_length * cfg.beam_width)
        if self.fresh is not None:
            self.fresh.append(prev.row, prev.n, prev.g0, prev.depth + 1)
        if self.lookup is not None or self.store is not None:
            self._host_rows(prev, rows)
        rows.sources = row_sources(cfg.drafter_rows, len(rows.lengths), rows.source)
        return rows

    def _host_rows(self, prev: _Queued, rows: _Rows) -> None:
        """Lookup or datastore rows. Whether to verify them is decided from what
        the host has read (a row costs its tokens' compute even when it matches nothing)."""
        cfg = self.cfg
        proposals, rows.source = context_or_store(
            self.lookup, self.store, cfg.lookup_length + prev.depth + 1, cfg.lookup
        )
        if not proposals:
            return
        host = self._host_scores(rows.source)
        rows.host_rows = (proposals, host, rows.source)
        if self.fresh is not None and rows.source != DATASTORE:
            block = self.fresh.propose(cfg.lookup_length)[None]
            matched = self.fresh.matched.reshape(1, 1)
        else:
            block = line_up(mx.array(proposals, mx.int32), prev.row, prev.n, prev.g0, cfg.lookup_length)
            matched = mx.array(host, mx.float32)[:, None]
        rows.parts.append(block)
        rows.scores.append(mx.broadcast_to(matched, block.shape).astype(mx.float32))
        rows.lengths += [cfg.lookup_length] * block.shape[0]
        # The host's own match (one step late) stands for the device's in the bucket's estimate.
        rows.host_scores += [
            host[min(i, len(host) - 1)] for i in range(block.shape[0]) for _ in range(cfg.lookup_length)
        ]

    def _host_scores(self, source: str) -> List[int]:
        """Each host-proposed row's score: the matched suffix length (lookup)
        or the continuation's count (the datastore row)."""
        if source == DATASTORE:
            return [count for _, count in self.store.last.continuations[:1]]
        return self.lookup.matched

    def learn(self, queued: _Queued, read: StepRead) -> None:
        """tree="auto": learn from the step's read (its verified nodes), and,
        greedy, from the host rows it did not verify (:meth:`AutoTree.observe_unverified`)."""
        self.auto.observe(queued.structure, read.rest, read.path[: read.n + 1])
        if queued.host_rows:
            verified = {queued.structure.source[c // N_BUCKETS] for c in read.rest if c >= 0}
            proposals, scores, source = queued.host_rows
            if SOURCES.index(source) not in verified:
                self.auto.observe_unverified(proposals, scores, source, self.last_emitted, read.emitted)

    def emitted(self, tokens: List[int]) -> None:
        """The host read these tokens: lookup's history grows by them."""
        self.last_emitted = list(tokens)
        if self.auto is not None:
            self.auto.advance(len(tokens))
        for proposer in (self.lookup, self.store):
            if proposer is not None:
                proposer.extend(tokens)
        if self.fresh is not None:  # every appended step is read: the device length is known
            self.fresh.settle(len(self.lookup.history))

    def queue(self, prev: _Queued) -> _Queued:
        """Build the step after ``prev`` (lazily)."""
        before = recurrent_states(self.cache)
        rows = self.rows(prev)
        if not rows.lengths:
            queued = self._queue_g0(prev)
        elif self.auto is not None:
            queued = self._queue_auto(prev, rows)
        else:
            queued = self._queue_all(prev, rows)
        queued.before = before
        return queued

    def _queue_all(self, prev: _Queued, rows: _Rows) -> _Queued:
        """Verify every row's nodes (tree="fixed")."""
        beams, lay = rows.beams(), layout(tuple(rows.lengths))
        tree = lay.tree(beams, prev.g0)
        hidden = self._forward(tree, prev.real, chain=len(rows.lengths) == 1)
        logits = self.head(hidden)
        if self.sampling.greedy:
            acc = accept_greedy(beams, lay.node_index, logits)
        else:
            merged = Tree(tree.tokens, tree.depth, merged_parent(lay, beams), lay.node_index, tree.mask)
            acc = accept_sampling(beams, merged, logits, self.sampling)
        return self._queued(prev, acc, hidden, beams[acc.beam], lay.size, sources=rows.sources)

    def _queue_auto(self, prev: _Queued, rows: _Rows) -> _Queued:
        """tree="auto": verify the bucket's best nodes (step/auto.py); the read ends with their codes."""
        beams, lay = rows.beams(), layout(tuple(rows.lengths))
        structure, ancestors = self.auto.shape(lay.lengths, rows.sources)
        size = self.auto.bucket(structure, rows.host_scores)
        host_rows = rows.host_rows if self.sampling.greedy else ()
        if size == 1:  # g0 alone; the host rows left out are still learned from
            queued = self._queue_g0(prev)
            queued.structure, queued.host_rows = structure, host_rows
            return queued
        depth = beams.shape[1]
        scores = mx.concatenate([mx.pad(x, [(0, 0), (0, depth - x.shape[1])]) for x in rows.scores])
        sel, chosen, index = self.auto.select(
            structure, ancestors, beams, lay, scores, size - 1, dedup=not self.sampling.greedy
        )
        tree = sel.tree(beams[lay.node_row, lay.node_pos], prev.g0)
        tree.levels = depth + 1  # the candidates' depth bounds the selection's
        # One row of candidates: the selection is a prefix of it (parents
        # first, ties to the shallower), a single path that the model's own
        # causal call verifies without the tree hooks (cheaper per step).
        hidden = self._forward(tree, prev.real, chain=size == 2 or len(lay.lengths) == 1)
        logits = self.head(hidden)
        if self.sampling.greedy:
            acc = accept_greedy(chosen, index, logits)
        else:
            walk = Tree(tree.tokens, tree.depth, tree.parent, index, tree.mask)
            acc = accept_sampling(chosen, walk, logits, self.sampling)
        return self._queued(
            prev,
            acc,
            hidden,
            chosen[acc.beam],
            size,
            codes=sel.codes,
            depth=depth,
            structure=structure,
            sources=rows.sources,
            host_rows=host_rows,
        )

    def _queue_g0(self, prev: _Queued) -> _Queued:
        """Nothing drafted: verify ``g0`` alone (a plain decoding step)."""
        one = Tree(prev.g0.reshape(1), mx.zeros((1,), mx.int32), None, None, mx.ones((1, 1), mx.bool_), levels=1)
        hidden = self._forward(one, prev.real, chain=True)
        zero = mx.zeros((1,), mx.int32)
        acc = Accepted(zero[0], zero[0], zero, zero[0], sample_first(self.head(hidden)[0], self.sampling))
        return self._queued(prev, acc, hidden, zero[:0], 1)

    def _queued(self, prev, acc: Accepted, hidden, row, size: int, codes=None, depth=None, **fields) -> _Queued:
        """The one tail of every queued step: the recurrent layers take the
        accepted node's state, the cache learns which verified rows are real,
        and the step's read (lazy) is what the host will read."""
        depth = row.shape[0] if depth is None else depth
        take_tree_states(self.cache, acc.last)  # a hooked call keeps every node's state pending
        self.kv.append(size, _kept(size, acc, depth))
        read = step_read(acc, row)
        return _Queued(
            read=read if codes is None else mx.concatenate([read, codes]),
            g0=acc.next_token,
            context=hidden[acc.last],
            real=prev.real + 1 + acc.n,
            row=row,
            n=acc.n,
            depth=depth,
            size=size,
            **fields,
        )

    def _forward(self, tree: Tree, base: mx.array, chain: bool) -> mx.array:
        """``hidden [N, h]`` of the tree. A cache without holes needs no device
        positions, and a chain without holes is the model's own causal call."""
        tokens = tree.tokens[None]
        if self.kv.dirty:
            with tree_hooks(self.model, self.cache, tree, base=base, valid=self.kv.valid(), chain=chain):
                return self.backbone(tokens, cache=self.cache)[0]
        if not needs_hooks(self.model, chain):
            return self.backbone(tokens, cache=self.cache)[0]
        with tree_hooks(self.model, self.cache, tree, chain=chain):
            return self.backbone(tokens, cache=self.cache)[0]


def pipelined_steps(
    model, prompt: mx.array, cache, *, draft, sampling, history: Sequence[int] = ()
) -> Iterator[StepTokens]:
    """:func:`~mlx_redrafter.step.dispatch.redrafter_steps`, pipelined (see the module doc)."""
    install_tree_hooks(model)  # refuses unsupported positions before any work
    pipe = _Pipeline(model, cache, draft, sampling, list(history) + host_read(prompt))
    tic = time.perf_counter()
    logits, context = prefill(pipe.backbone, pipe.head, cache, prompt)
    pipe.kv = HoleyCache(cache)
    if pipe.auto is not None:
        pipe.auto.advance(
            cache_length(cache) or 0
        )  # the prompt (and any cached turns): trees are priced at their context
    g0 = sample_first(logits, sampling)
    zero = mx.array(0, mx.int32)
    real = mx.array(cache_length(cache) or 0, mx.int32)
    queued = _Queued(read=None, g0=g0, context=context, real=real, row=zero.reshape(1)[:0], n=zero, depth=0, size=1)
    unread = None  # the step queued and not read: undone if the loop ends here
    try:
        # Read g0 before queueing step 1: a read queued behind a step waits for it.
        g0_val = host_read(g0)[0]
        syncs = 1
        queued = unread = pipe.queue(queued)
        mx.async_eval(queued.read)
        pipe.emitted([g0_val])
        yield first_step(g0_val, time.perf_counter() - tic, syncs)
        step = 0
        while True:
            step += 1
            tic = time.perf_counter()
            following = unread = pipe.queue(queued)
            mx.async_eval(following.read)
            read = StepRead.parse(host_read(queued.read), queued.depth)
            syncs += 1
            kept = set(read.path[: read.n + 1])
            pipe.kv.settle([i in kept for i in range(queued.size)])
            if queued.structure is not None:
                pipe.learn(queued, read)
            pipe.emitted(read.emitted)
            yield read.tokens(
                step,
                queued.size,
                time.perf_counter() - tic,
                syncs,
                queued.depth,
                draft.drafter_rows,
                sources=queued.sources,
            )
            queued = following
    finally:
        pipe.kv.compact(drop_unread=True)
        if unread is not None:
            restore_states(cache, unread.before)
