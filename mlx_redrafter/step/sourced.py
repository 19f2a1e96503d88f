"""The step loop with stateful draft sources: a layer head (a native MTP head,
an EAGLE-3 head) or a small draft model, beside the drafter and lookup.

Such a source keeps a cache of its own in step with the target's
(draft/chain.py), so it must see what each step accepted before it drafts
the next step. The loop therefore reads each step before it builds the next,
like the synchronous loop, with the same one host read per step
(protocol.py): after it the accepted tokens are on the host, the sources
catch up on them (with the target's hidden states of the accepted path,
still on the device) and draft lazily, and every row (the drafter's beams,
each source's beams, lookup or datastore copies) is verified in one tree
whose rows own their nodes (step/tree.py's ``Layout``: its size is known
without reading the beams). Under ``tree="auto"`` the device picks the nodes
that pay, as in the pipelined loop, and their codes ride in the same read.

The caches: ``cache`` is the model's, then the sources' (mlx-lm's layout for
a draft model); a cache without the sources' gets them appended in place
(llm/cache.py ``attach_sources``). When the loop ends every source feeds what
is pending, so the caches can be trimmed together.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Sequence

import mlx.core as mx

from ..config import DraftConfig, SamplingConfig
from ..draft.chain import Chain, chain_for
from ..draft.datastore.index import StoreLookup
from ..draft.datastore.use import DATASTORE, context_or_store
from ..draft.draft_model import ModelHead
from ..draft.lookup import Lookup
from ..llm.cache import attach_sources, compact_cache, kv_offsets, set_cache_length, target_size, verify_starts
from ..llm.identity import model_dims
from ..llm.parts import model_parts
from ..llm.recurrent import cache_length, take_tree_states
from .accept import Accepted, accept_greedy, accept_sampling, sample_first
from .auto import AutoTree, drafter_scores
from .protocol import StepRead, StepTokens, draft_beams, first_step, host_read, prefill, step_read
from .select import N_BUCKETS, SOURCES
from .tree import PAD, Tree, layout, merged_parent
from .verify import install_tree_hooks, verify


def source_head(model, source):
    """The chainable head of a stateful source: a layer head as it is (bound to
    ``model`` when it binds: an EAGLE-3 head's taps from the model's layer
    count, its embedding when it has none), an mlx-lm model wrapped."""
    if hasattr(source, "make_cache") and hasattr(source, "taps"):
        if hasattr(source, "bind"):
            source.bind(model)
        return source
    return ModelHead(source, vocab=model_parts(model)[0].weight.shape[0])


def tap_layers(draft: DraftConfig, chains: Sequence[Chain]) -> List[int]:
    """The target layers the backbone must also return: the drafter's fused
    layers, then the heads' taps (llm/parts.py ``model_parts``)."""
    layers = list(draft.feature_layers or [])
    for chain in chains:
        layers += [t for t in (getattr(chain.head, "taps", None) or ()) if t not in layers]
    return layers


def columns(layers: Sequence[int], wanted: Sequence[int], width: int, last: bool):
    """Indices into the fused backbone output ``[taps of layers..., final]``
    of the ``wanted`` taps (then the final state, with ``last``), or None when
    that is the whole vector."""
    if list(wanted) == list(layers) and last:
        return None
    idx = [layers.index(t) for t in wanted] + ([len(layers)] if last else [])
    return mx.array([i * width + j for i in idx for j in range(width)], mx.int32)


class _Sourced:
    """One generation's sources, lookup and tree selection around the target's cache."""

    def __init__(self, model, cache, draft: DraftConfig, sampling: SamplingConfig, history: List[int]):
        self.model, self.cfg, self.sampling = model, draft, sampling
        self.cache = cache[: target_size(model)]
        # The controller (adaptive depth) decides the layer head's calls (never a draft model's).
        # DFlash hook (issue 56): a source with its own chain (chain_for: make_chain) drafts its own way.
        self.chains = [
            chain_for(source_head(model, s), w, n, draft.controller if s is draft.head else None)
            for s, w, n in draft.source_shapes
        ]
        for chain, caches in zip(
            self.chains, attach_sources(cache, len(self.cache), [c.make_cache for c in self.chains])
        ):
            chain.cache = caches
        layers = tap_layers(draft, self.chains)
        self.embed, self.backbone, self.head = model_parts(model, layers or None)
        width = model_dims(model)[0]
        self.drafter_cols = columns(layers, draft.feature_layers or [], width, last=True)
        self.chain_cols = [columns(layers, c.head.taps or [], width, last=not c.head.taps) for c in self.chains]
        self.lookup = Lookup(history) if draft.lookup else None
        self.store = StoreLookup(draft.datastore, history) if draft.datastore is not None else None
        self.auto = AutoTree(draft.curve) if draft.tree == "auto" else None

    def features(self, hidden: mx.array, i: int):
        """Chain ``i``'s features from the backbone's output ``[..., F]``."""
        cols = self.chain_cols[i]
        return hidden if cols is None else mx.take(hidden, cols, axis=-1)

    def entered(self, tokens: List[int], hidden: mx.array) -> None:
        """``tokens`` entered the target's cache, ``hidden [len, F]`` its states there."""
        for i, chain in enumerate(self.chains):
            chain.extend(tokens, self.features(hidden, i) if chain.reads_hidden else None)

    def emitted(self, tokens: List[int]) -> None:
        """The host read these tokens: lookup's history (and tree auto's context) grow by them."""
        if self.auto is not None:
            self.auto.advance(len(tokens))
        for proposer in (self.lookup, self.store):
            if proposer is not None:
                proposer.extend(tokens)

    def rows(self, context: mx.array, g0: mx.array, g0_val: int):
        """The next step's rows ``[(tokens [R, L], scores or None)]``, their lengths and
        sources (host), and each row node's host score (NaN: scored on the device)."""
        cfg, parts, lengths, sources, host = self.cfg, [], [], [], []
        self.host_rows = ()
        if cfg.drafter is not None:
            ctx = context if self.drafter_cols is None else mx.take(context, self.drafter_cols, axis=-1)
            beams = draft_beams(cfg, self.embed, ctx, g0)
            parts.append((beams.tokens, drafter_scores(beams) if self.auto is not None else None))
            lengths += [cfg.beam_length] * cfg.beam_width
            sources += ["drafter"] * cfg.beam_width
        for chain in self.chains:
            beams = chain.draft(g0_val)
            parts.append((beams.tokens, drafter_scores(beams) if self.auto is not None else None))
            lengths += [beams.tokens.shape[1]] * chain.width  # the controller's depth, else the chain's length
            sources += [chain.source] * chain.width
        host += [float("nan")] * sum(lengths)
        proposals, source = context_or_store(self.lookup, self.store, cfg.lookup_length, cfg.lookup)
        if proposals:
            scores = self._host_scores(source)
            scores = [scores[min(i, len(scores) - 1)] if scores else 0 for i in range(len(proposals))]
            self.host_rows = (proposals, scores, source)
            depth = max(len(p) for p in proposals)
            rows = mx.array([p + [PAD] * (depth - len(p)) for p in proposals], mx.int32)
            per_node = mx.array([[s] * depth for s in scores], mx.float32)
            parts.append((rows, per_node if self.auto is not None else None))
            lengths += [len(p) for p in proposals]
            sources += [source] * len(proposals)
            host += [s for s, p in zip(scores, proposals) for _ in p]  # host numbers already
        return parts, lengths, tuple(sources), host

    def _host_scores(self, source: str) -> List[float]:
        if source == DATASTORE:
            return [count for _, count in self.store.last.continuations[:1]]
        return list(self.lookup.matched)

    # ------------------------------------------------------------------ one step

    def verify(self, parts, lengths, sources, host, g0: mx.array):
        """Verify this step's rows: ``(Accepted, hidden, read array, depth, size, structure)``, lazily."""
        if not lengths:
            return self._g0_alone(g0)
        depth = max(lengths)
        beams = mx.concatenate([mx.pad(t, [(0, 0), (0, depth - t.shape[1])], constant_values=PAD) for t, _ in parts])
        lay = layout(tuple(lengths))
        if self.auto is not None:
            return self._verify_auto(parts, beams, lay, sources, host, g0)
        tree = lay.tree(beams, g0)
        logits, hidden = verify(self.model, self.backbone, self.head, self.cache, tree, chain=len(lengths) == 1)
        if self.sampling.greedy:
            acc = accept_greedy(beams, lay.node_index, logits)
        else:
            merged = Tree(tree.tokens, tree.depth, merged_parent(lay, beams), lay.node_index, tree.mask)
            acc = accept_sampling(beams, merged, logits, self.sampling)
        return acc, hidden, step_read(acc, beams[acc.beam]), depth, lay.size, None

    def _verify_auto(self, parts, beams, lay, sources, host, g0):
        """tree="auto": verify the bucket's best nodes (step/auto.py); the read ends with their codes."""
        structure, ancestors = self.auto.shape(lay.lengths, sources)
        size = self.auto.bucket(structure, host)
        if size == 1:
            acc, hidden, read, depth, _, _ = self._g0_alone(g0)
            return acc, hidden, mx.concatenate([read, mx.zeros((0,), mx.int32)]), depth, 1, structure
        depth = beams.shape[1]
        scores = mx.concatenate([mx.pad(s, [(0, 0), (0, depth - s.shape[1])]) for _, s in parts])
        sel, rows, index = self.auto.select(
            structure, ancestors, beams, lay, scores, size - 1, dedup=not self.sampling.greedy
        )
        tree = sel.tree(beams[lay.node_row, lay.node_pos], g0)
        chain = size == 2 or len(lay.lengths) == 1  # the selection is a prefix of one row: causal
        logits, hidden = verify(self.model, self.backbone, self.head, self.cache, tree, chain=chain)
        if self.sampling.greedy:
            acc = accept_greedy(rows, index, logits)
        else:
            picked = Tree(tree.tokens, tree.depth, tree.parent, index, tree.mask)
            acc = accept_sampling(rows, picked, logits, self.sampling)
        read = mx.concatenate([step_read(acc, rows[acc.beam]), sel.codes])
        return acc, hidden, read, depth, size, structure

    def _g0_alone(self, g0: mx.array):
        """Nothing drafted (or nothing pays): verify ``g0`` alone, a plain decoding step."""
        hidden = self.backbone(g0.reshape(1, 1), cache=self.cache)[0]
        token = sample_first(self.head(hidden)[0], self.sampling)
        zero = mx.array(0, mx.int32)
        acc = Accepted(zero, zero, mx.zeros((1,), mx.int32), zero, token)
        return acc, hidden, step_read(acc, mx.zeros((0,), mx.int32)), 0, 1, None

    def learn(self, structure, read: StepRead, emitted: List[int]) -> None:
        """tree="auto": learn from the verified nodes' codes, and (greedy) from
        host rows the step left out (:meth:`AutoTree.observe_unverified`)."""
        if structure is None:
            return
        self.auto.observe(structure, read.rest, read.path[: read.n + 1])
        if self.host_rows and self.sampling.greedy:
            verified = {structure.source[c // N_BUCKETS] for c in read.rest if c >= 0}
            proposals, scores, source = self.host_rows
            if SOURCES.index(source) not in verified:
                self.auto.observe_unverified(proposals, scores, source, [], emitted)

    def close(self) -> None:
        for chain in self.chains:
            chain.close()


def sourced_steps(
    model, prompt: mx.array, cache, *, draft: DraftConfig, sampling: SamplingConfig, history: Sequence[int] = ()
) -> Iterator[StepTokens]:
    """:func:`~mlx_redrafter.step.dispatch.redrafter_steps` with stateful sources (see the module doc)."""
    install_tree_hooks(model)  # refuses unsupported positions before any work
    prompt_ids = host_read(prompt)
    run = _Sourced(model, cache, draft, sampling, list(history) + prompt_ids)
    tic = time.perf_counter()

    def sink(start, hidden):
        run.entered(prompt_ids[start : start + hidden.shape[0]], hidden)

    logits, context = prefill(run.backbone, run.head, run.cache, prompt, sink=sink)
    if run.auto is not None:
        run.auto.advance(cache_length(run.cache) or 0)  # trees are priced at their context
    g0 = sample_first(logits, sampling)
    try:
        g0_val, syncs = host_read(g0)[0], 1
        run.emitted([g0_val])
        yield first_step(g0_val, time.perf_counter() - tic, syncs)
        step = 0
        while True:
            step, tic = step + 1, time.perf_counter()
            parts, lengths, sources, host = run.rows(context, g0, g0_val)
            offsets, starts = kv_offsets(run.cache), verify_starts(run.cache)
            acc, hidden, read_array, depth, size, structure = run.verify(parts, lengths, sources, host, g0)
            take_tree_states(run.cache, acc.last)  # recurrent layers: the accepted node's state (lazy)
            read = StepRead.parse(host_read(read_array), depth)
            syncs += 1 + sum(chain.reads for chain in run.chains)
            if not read.in_place:
                compact_cache(run.cache, starts, acc.path)
            set_cache_length(run.cache, starts, offsets, 1 + read.n)
            run.learn(structure, read, read.emitted)
            run.entered([g0_val] + read.row[: read.n], hidden[mx.array(read.path[: read.n + 1], mx.int32)])
            run.emitted(read.emitted)
            yield read.tokens(step, size, time.perf_counter() - tic, syncs, depth, draft.drafter_rows, sources=sources)
            g0, g0_val, context = acc.next_token, read.g0, hidden[acc.last]
    finally:
        run.close()
