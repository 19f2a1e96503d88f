"""The grammar-constrained speculative step loop (synchronous).

Each step: the drafter's beams and the lookup rows (read to the host, as in
the synchronous loop's lookup path), plus a row of the tokens the grammar
forces after ``g0``, are pruned by the grammar; the host computes the mask
of every kept node (:func:`~mlx_redrafter.step.grammar.tree_masks`, tens of
microseconds a node) and the tree is verified and accepted on the device
over masked logits. The tokens equal plain constrained decoding
(:func:`~mlx_redrafter.step.grammar.grammar_logits_processor` on mlx-lm's
``generate_step``): token for token when greedy, in distribution when
sampling. The stream ends with the grammar's EOS once the grammar is
complete.

Why synchronous: the next step's masks depend on the tokens this step
accepts, so the host must read them before it can build the next tree; the
pipelined loop queues the next tree before that read. dispatch.py sends
every grammar-constrained generation here (or to plain constrained
decoding when nothing drafts).
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from ..config import DraftConfig, SamplingConfig
from ..llm.cache import check_cache, compact_cache, kv_offsets, set_cache_length, verify_starts
from ..llm.parts import model_parts
from ..llm.recurrent import take_tree_states
from .accept import Accepted, sample_first
from .grammar import Grammar, accept_constrained, apply_mask, packed_masks, tree_masks, unpack_masks
from .protocol import StepRead, StepTokens, first_step, host_read, prefill, step_read
from .synchronous import _JoinedBeams
from .tree import count_rows, pack
from .verify import verify

FORCED_LENGTH = 8  # at most this many grammar-forced tokens join the tree as a row


def _rows(drafts: _JoinedBeams, vals: List[int], emitted: List[int], matcher) -> List[List[int]]:
    """The step's draft rows on the host: drafter and lookup rows, then the forced row."""
    rows = []
    if drafts.cfg.drafting:
        beams, _, _ = drafts.finish(vals, emitted)
        rows = [[t for t in r if t >= 0] for r in beams.tolist()]  # a host-built array: no device sync
    return rows + [matcher.forced_tokens()[:FORCED_LENGTH]]


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


def _consume(matcher, out: StepTokens, eos: set) -> StepTokens:
    """Advance the matcher over a step's tokens; cut them after an EOS (drafts past it are not output)."""
    for i, t in enumerate(out.tokens):
        matcher.consume(t)  # raises if acceptance ever let a masked token through
        if t in eos:
            out.tokens, out.from_draft = out.tokens[: i + 1], out.from_draft[: i + 1]
            out.stats.accepted = sum(out.from_draft)
            break
    return out


def constrained_steps(
    model,
    prompt: mx.array,
    cache,
    draft: DraftConfig,
    sampling: Optional[SamplingConfig] = None,
    grammar: Grammar = None,
    history: Sequence[int] = (),
) -> Iterator[StepTokens]:
    """Yield each step's tokens under ``grammar`` (a compiled
    :class:`~mlx_redrafter.step.grammar.Grammar`), like
    :func:`~mlx_redrafter.step.dispatch.redrafter_steps`: the first token, then
    ``accepted drafts + the LLM's own next token`` per step. ``draft`` says
    what drafts (its controller and ``pipelined`` are ignored); with nothing
    drafting, only forced tokens do. The iterator ends after the grammar's
    EOS; the caller stops it earlier at ``max_tokens``."""
    sampling = sampling or SamplingConfig()
    check_cache(cache)
    embed, backbone, head = model_parts(model, draft.feature_layers)
    drafts = _JoinedBeams(embed, draft, list(history) + host_read(prompt), sampling.greedy)
    matcher, eos = grammar.matcher(), set(grammar.eos_ids)

    tic = time.perf_counter()
    logits, context = prefill(backbone, head, cache, prompt)
    drafts.prefilled(cache)
    g0 = sample_first(apply_mask(logits, matcher.mask()), sampling)
    vals = host_read(g0, *drafts.start(context, g0))
    syncs, last = 1, vals[0]
    matcher.consume(last)
    rows = _rows(drafts, vals[1:], [last], matcher)
    yield first_step(last, time.perf_counter() - tic, syncs)
    step = 0
    while last not in eos:
        step += 1
        tic = time.perf_counter()
        offsets, starts = kv_offsets(cache), verify_starts(cache)
        rows, words = tree_masks(matcher, rows)
        beams, tree_size, hidden, acc = _verify_step(model, backbone, head, cache, g0, rows, words, grammar, sampling)
        take_tree_states(cache, acc.last)  # recurrent layers: the accepted node's state (lazy)
        length = len(rows[0])
        g0 = acc.next_token
        pending = drafts.start(hidden[acc.last], g0)
        read = StepRead.parse(host_read(step_read(acc, beams[acc.beam]), *pending), length)
        syncs += 1
        if not read.in_place:
            compact_cache(cache, starts, acc.path)
        set_cache_length(cache, starts, offsets, 1 + read.n)
        out = read.tokens(step, tree_size, time.perf_counter() - tic, syncs, length, draft.drafter_rows)
        if read.n and read.beam == len(rows) - 1:
            out.stats.source = "grammar"  # the forced row is the last one
        out = _consume(matcher, out, eos)
        last = out.tokens[-1]
        if last not in eos:
            rows = _rows(drafts, read.rest, read.emitted, matcher)
        yield out
