"""The synchronous step loop: each step is read before the next one is built.

One step: draft beams from ``(g0, c)``, pack them into a tree (tree.py),
verify the tree in one LLM call (verify.py), accept the longest matching
prefix (accept.py), compact the KV cache (llm/cache.py), and draft the next
beams, all lazily. The loop then syncs once (protocol.py) to read the
accepted tokens and the next tree's size (the verify call needs a static
shape). Lookup beams (n-gram matches in the prompt and reply,
draft/lookup.py) join the drafter's beams on the host after that sync, or
replace them when there is no drafter.

It serves what the pipelined loop (pipelined.py, the default) does not: the
adaptive-depth controller, timings, rotating (sliding-window) caches and
wide, deep drafter trees; and any run with ``DraftConfig(pipelined=False)``.
dispatch.py chooses.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Sequence

import mlx.core as mx

from ..config import DraftConfig, SamplingConfig
from ..draft.datastore.index import StoreLookup
from ..draft.datastore.use import DATASTORE, context_or_store, row_sources
from ..draft.lookup import Lookup, join_beams
from ..llm.cache import compact_cache, kv_offsets, set_cache_length, verify_starts
from ..llm.parts import model_parts
from ..llm.recurrent import cache_length, take_tree_states
from .accept import Accepted, accept_greedy, accept_sampling, sample_first
from .auto import AutoTree, drafter_scores, lookup_buckets
from .protocol import StepRead, StepTokens, draft_beams, first_step, host_read, prefill, step_read
from .select import bucket_of
from .tree import count_nodes, count_rows, pack
from .verify import verify


class _DrafterBeams:
    """Drafter beams only: they stay on the device; the tree size is counted
    there and read in the step's sync."""

    padded = False

    def __init__(self, embed, draft: DraftConfig):
        self.embed, self.cfg = embed, draft

    def draft(self, context, g0):
        """``(beams, depth to verify)``, lazily."""
        cfg = self.cfg
        top_k = cfg.controller.top_k if cfg.controller is not None else 0
        b = self.drafted = draft_beams(cfg, self.embed, context, g0, confidences=top_k)
        if cfg.controller is None:
            return b.tokens, mx.array(cfg.beam_length, mx.int32)
        return b.tokens, cfg.controller.choose_depth(b)

    def start(self, context, g0) -> List[mx.array]:
        """Draft the next beams lazily; return what the step's sync reads."""
        self.beams, depth = self.draft(context, g0)
        return [count_nodes(self.beams, depth), depth]

    def prefilled(self, cache) -> None:
        """The prompt is in ``cache``: nothing to do without tree="auto"."""

    def finish(self, vals: List[int], emitted: List[int]):
        """``(beams, n_nodes, depth)`` of the next tree, from the synced values."""
        n_nodes, depth = vals
        return self.beams, n_nodes, depth


class _JoinedBeams(_DrafterBeams):
    """The drafter's beams (if any), read in the step's sync, joined on the
    host with lookup beams over the history of emitted tokens (or a
    datastore row where they find nothing); the tree size is counted on the
    host. Rows have different lengths (PAD-padded). ``sources``: the
    current tree's row sources."""

    padded = True

    def __init__(self, embed, draft: DraftConfig, prompt: List[int], greedy: bool):
        super().__init__(embed, draft)
        self.lookup = Lookup(prompt) if draft.lookup else None
        self.store = StoreLookup(draft.datastore, prompt) if draft.datastore is not None else None
        self.sources = ()
        self.auto = AutoTree(draft.curve) if draft.tree == "auto" else None
        self.greedy = greedy  # left-out rows are learned from under greedy decoding only
        self.left_out = None  # tree="auto": (rows, scores, source) of host rows the last trim dropped whole

    def prefilled(self, cache) -> None:
        """tree="auto": trees are priced at their context, the prompt (and any cached turns) first."""
        if self.auto is not None:
            self.auto.advance(cache_length(cache) or 0)

    def start(self, context, g0) -> List[mx.array]:
        if self.cfg.drafter is None:
            return []
        beams, depth = self.draft(context, g0)
        if self.auto is None:
            return [depth, beams]
        # tree="auto": each node's score bucket comes with the beams in the step's read.
        scores = drafter_scores(self.drafted).reshape(-1)
        return [depth, beams, bucket_of(mx, mx.zeros(scores.shape, mx.int32), scores)]

    def finish(self, vals: List[int], emitted: List[int]):
        cfg = self.cfg
        if self.auto is not None:
            self.auto.advance(len(emitted))
        for proposer in (self.lookup, self.store):
            if proposer is not None:
                proposer.extend(emitted)
        drafted, buckets, size = [], [], cfg.beam_width * cfg.beam_length
        if cfg.drafter is not None:
            depth, flat, length = vals[0], vals[1 : 1 + size], cfg.beam_length
            drafted = [flat[w * length : w * length + depth] for w in range(cfg.beam_width)]
            buckets = [vals[1 + size + w * length : 1 + size + w * length + depth] for w in range(cfg.beam_width)]
        proposals, source = context_or_store(self.lookup, self.store, cfg.lookup_length, cfg.lookup)
        rows = join_beams(drafted, proposals, cfg.lookup_rows)
        self.sources = row_sources(len(drafted), len(rows), source)
        if self.auto is not None:
            rows = self._trim(rows, buckets, emitted, source)
        # The depth is the longest row without its PAD end (a datastore row
        # ends where its sequence did; a trimmed tree reports its real depth),
        # so that n_nodes == depth only for a single path: verify runs a chain
        # unhooked then.
        depth = max(1, max((sum(1 for t in r if t >= 0) for r in rows), default=0))
        rows = [r[:depth] for r in rows]
        return mx.array(rows, dtype=mx.int32), count_rows(rows), depth

    def _trim(self, rows, buckets, emitted, source):
        """tree="auto": learn from the step just read, then keep the best subset of ``rows``."""
        cfg, width, extra = self.cfg, len(rows[0]), len(rows) - len(buckets)
        self.auto.observe_rows(emitted[:-1])
        if self.left_out is not None:  # greedy: host rows the step did not verify, against its tokens
            self.auto.observe_unverified(*self.left_out, (), emitted)
            self.left_out = None
        per_row = [b + [-1] * (width - len(b)) for b in buckets]
        if source == DATASTORE:  # its one row scores by the continuation's count
            raw = [c for _, c in self.store.last.continuations[:1]]
        else:
            raw = self.lookup.matched if self.lookup is not None else []
        looked = lookup_buckets(raw, extra, cfg.lookup_length, source)
        for i in range(extra):
            per_row.append((looked[i * cfg.lookup_length : (i + 1) * cfg.lookup_length] + [-1] * width)[:width])
        flat = [b for row in per_row for b in row]
        out = self.auto.trim(rows, self.sources, flat)
        dropped = [i for i in range(min(extra, len(raw))) if all(t < 0 for t in out[len(buckets) + i])]
        if self.greedy and dropped:
            self.left_out = (
                [[t for t in rows[len(buckets) + i] if t >= 0] for i in dropped],
                [raw[i] for i in dropped],
                source,
            )
        return out


def synchronous_steps(
    model,
    prompt: mx.array,
    cache,
    *,
    draft: DraftConfig,
    sampling: SamplingConfig,
    timings: bool = False,
    history: Sequence[int] = (),
) -> Iterator[StepTokens]:
    """:func:`~mlx_redrafter.step.dispatch.redrafter_steps`, one step at a time (see the module doc)."""
    embed, backbone, head = model_parts(model, draft.feature_layers)
    if draft.lookup_rows or draft.tree == "auto":
        drafts = _JoinedBeams(embed, draft, list(history) + host_read(prompt), sampling.greedy)
    else:
        drafts = _DrafterBeams(embed, draft)
    tic = time.perf_counter()
    logits, context = prefill(backbone, head, cache, prompt)
    drafts.prefilled(cache)
    g0 = sample_first(logits, sampling)
    vals = host_read(g0, *drafts.start(context, g0))
    syncs = 1
    beams, n_val, d_val = drafts.finish(vals[1:], vals[:1])
    yield first_step(vals[0], time.perf_counter() - tic, syncs)
    step = 0
    while True:
        step += 1
        tic = time.perf_counter()
        times = {}
        offsets, starts = kv_offsets(cache), verify_starts(cache)
        beams = beams[:, :d_val]
        logits, hidden, acc, tree_size = _verify_and_accept(
            model, backbone, head, cache, beams, n_val, d_val, g0, drafts.padded, sampling, timings, times, tic
        )
        take_tree_states(cache, acc.last)  # recurrent layers: the accepted node's state (lazy)
        g0 = acc.next_token
        pending = drafts.start(hidden[acc.last], g0)
        _lap(timings, times, "draft", tic, *pending)
        read = StepRead.parse(host_read(step_read(acc, beams[acc.beam]), *pending), d_val)
        syncs += 1
        # Most steps accept nothing, or a prefix packed in place (always so for
        # a single path): the cache rows need moving only otherwise. The move
        # stays lazy and runs with the next verify.
        if not read.in_place:
            compact_cache(cache, starts, acc.path)
        set_cache_length(cache, starts, offsets, 1 + read.n)
        out = read.tokens(
            step,
            tree_size,
            time.perf_counter() - tic,
            syncs,
            d_val,
            draft.drafter_rows,
            times,
            sources=getattr(drafts, "sources", None),
        )
        beams, n_val, d_val = drafts.finish(read.rest, read.emitted)
        yield out


def _verify_and_accept(model, backbone, head, cache, beams, n_val, d_val, g0, padded, sampling, timings, times, tic):
    """Verify this step's tree and accept from it: ``(logits, hidden, Accepted, tree size)``, lazily."""
    if n_val == 0:
        # Nothing drafted (lookup only, no match): a plain one-token step.
        logits, hidden, acc = _plain_step(backbone, head, cache, g0, d_val, sampling)
        _lap(timings, times, "verify", tic, logits, hidden)
        _lap(timings, times, "accept", tic, acc.n, acc.next_token, acc.path)
        return logits, hidden, acc, 1
    tree = pack(beams, n_val, g0, padded=padded)
    _lap(timings, times, "pack", tic, tree.tokens, tree.mask, tree.node_index)
    # A single path (W=1, or all beams alike) has the model's own causal
    # positions and mask: verify it unhooked.
    logits, hidden = verify(model, backbone, head, cache, tree, chain=n_val == d_val)
    _lap(timings, times, "verify", tic, logits, hidden)
    if sampling.greedy:
        acc = accept_greedy(beams, tree.node_index, logits)
    else:
        acc = accept_sampling(beams, tree, logits, sampling)
    _lap(timings, times, "accept", tic, acc.n, acc.next_token, acc.path)
    return logits, hidden, acc, tree.size


def _plain_step(backbone, head, cache, g0, length: int, sampling):
    """Verify ``g0`` alone: ``(logits, hidden, Accepted)`` of a step that drafted nothing."""
    hidden = backbone(g0.reshape(1, 1), cache=cache)[0]
    logits = head(hidden)
    zero = mx.array(0, mx.int32)
    path = mx.zeros((length + 1,), mx.int32)
    return logits, hidden, Accepted(zero, zero, path, zero, sample_first(logits[0], sampling))


def _lap(timings: bool, times: dict, name: str, start: float, *arrays) -> None:
    """Timings only: evaluate ``arrays`` and record the phase's duration."""
    if not timings:
        return
    mx.eval(*arrays)
    now = time.perf_counter()
    times[name] = now - start - sum(times.values())
