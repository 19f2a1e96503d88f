"""The grammar-constrained speculative step loop (synchronous).

Each step: the drafter's beams and the lookup rows (read to the host, as in
the synchronous loop of generate.py), plus a row of the tokens the grammar
forces after ``g0``, are pruned by the grammar; the host computes the mask
of every kept node (:func:`~mlx_redrafter.step.grammar.tree_masks`, tens of
microseconds a node) and the tree is verified and accepted on the device
over masked logits. The tokens equal plain constrained decoding
(:func:`~mlx_redrafter.step.grammar.grammar_logits_processor` on mlx-lm's
``generate_step``): token for token when greedy, in distribution when
sampling. The stream ends with the grammar's EOS once the grammar is
complete.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Sequence

import mlx.core as mx

from ..accept import Accepted, sample_first
from ..generate import SamplingConfig, _JoinedBeams
from ..models import model_parts
from ..steps import StepStats, StepTokens, host_read, prefill
from ..tree import count_rows, pack
from ..verify import check_cache, compact_cache, set_cache_length, verify, verify_starts
from .grammar import Grammar, accept_constrained, apply_mask, packed_masks, tree_masks, unpack_masks

FORCED_LENGTH = 8  # at most this many grammar-forced tokens join the tree as a row


def _rows(drafts: _JoinedBeams, vals: List[int], emitted: List[int], matcher) -> List[List[int]]:
    """The step's draft rows on the host: drafter and lookup rows, then the forced row."""
    rows = []
    if drafts.cfg.drafting:
        beams, _, _ = drafts.finish(vals, emitted)
        rows = [[t for t in r if t >= 0] for r in beams.tolist()]  # a host-built array: no device sync
    return rows + [matcher.forced_tokens()[:FORCED_LENGTH]]


def _source(beam: int, n: int, drafts: _JoinedBeams, lookup: int) -> str:
    if not n:
        return ""
    if beam < drafts.rows:
        return "drafter"
    return "lookup" if beam < drafts.rows + lookup else "grammar"


def _verify_step(model, backbone, head, cache, g0, rows, words, grammar: Grammar, sampling):
    """Verify the pruned rows (or ``g0`` alone when none is left): ``(beams, tree_size, hidden, Accepted)``."""
    beams = mx.array(rows, dtype=mx.int32)
    n_nodes, length = count_rows(rows), len(rows[0])
    if n_nodes == 0:
        hidden = backbone(g0.reshape(1, 1), cache=cache)[0]
        logits = apply_mask(head(hidden), unpack_masks(words[:1], grammar.vocab_size))
        zero = mx.array(0, mx.int32)
        acc = Accepted(zero, zero, mx.zeros((length + 1,), mx.int32), zero, sample_first(logits[0], sampling))
        return beams, 1, hidden, acc
    tree = pack(beams, n_nodes, g0, padded=True)
    logits, hidden = verify(model, backbone, head, cache, tree, chain=n_nodes == length)
    masks = packed_masks(words, beams, tree.node_index, tree.size, grammar.vocab_size)
    return beams, tree.size, hidden, accept_constrained(beams, tree, logits, masks, sampling)


def constrained_steps(
    model, prompt: mx.array, cache, draft, sampling=None, grammar: Grammar = None, history: Sequence[int] = ()
) -> Iterator[StepTokens]:
    """Yield each step's tokens under ``grammar`` (a compiled
    :class:`~mlx_redrafter.step.grammar.Grammar`), like
    :func:`~mlx_redrafter.generate.redrafter_steps`: the first token, then
    ``accepted drafts + the LLM's own next token`` per step. ``draft`` (a
    ``DraftConfig``; its controller and ``pipelined`` are ignored) says what
    drafts; with nothing drafting, only forced tokens do. The iterator ends
    after the grammar's EOS; the caller stops it earlier at ``max_tokens``."""
    sampling = sampling or SamplingConfig()
    check_cache(cache)
    embed, backbone, head = model_parts(model, draft.feature_layers)
    drafts = _JoinedBeams(embed, draft, list(history) + host_read(prompt))
    matcher, eos = grammar.matcher(), set(grammar.eos_ids)

    tic = time.perf_counter()
    logits, context = prefill(backbone, head, cache, prompt)
    g0 = sample_first(apply_mask(logits, matcher.mask()), sampling)
    vals = host_read(g0, *drafts.start(context, g0))
    syncs, g0_val = 1, vals[0]
    matcher.consume(g0_val)
    rows = _rows(drafts, vals[1:], [g0_val], matcher)
    yield StepTokens([g0_val], [False], StepStats(0, 0, 1, time.perf_counter() - tic, syncs))
    step = 0
    while g0_val not in eos:
        step += 1
        tic = time.perf_counter()
        offsets, starts = [c.offset for c in cache], verify_starts(cache)
        rows, words = tree_masks(matcher, rows)
        beams, tree_size, hidden, acc = _verify_step(model, backbone, head, cache, g0, rows, words, grammar, sampling)
        length = len(rows[0])
        g0 = acc.next_token
        pending = drafts.start(hidden[acc.last], g0)
        vals = host_read(acc.n, acc.beam, g0, acc.path, beams[acc.beam], *pending)
        syncs += 1
        n, beam, g0_val = vals[:3]
        path, row, rest = vals[3 : 4 + length], vals[4 + length : 4 + 2 * length], vals[4 + 2 * length :]
        if path[: n + 1] != list(range(n + 1)):
            compact_cache(cache, starts, acc.path)
        set_cache_length(cache, starts, offsets, 1 + n)
        emitted = row[:n] + [g0_val]
        for i, t in enumerate(emitted):
            matcher.consume(t)  # raises if acceptance ever let a masked token through
            if t in eos:
                emitted, g0_val = emitted[: i + 1], t
                break
        drafted = [i < n for i in range(len(emitted))]
        stats = StepStats(step, sum(drafted), tree_size, time.perf_counter() - tic, syncs, beam, length,
                          source=_source(beam, n, drafts, draft.lookup))
        if g0_val not in eos:
            rows = _rows(drafts, rest, emitted, matcher)
        yield StepTokens(emitted, drafted, stats)
