"""``tree="auto"``: what the step loops need to verify only the nodes that pay.

The candidates of a step are the rows the loop would verify under
``tree="fixed"`` (drafter beams, lookup rows), each row owning its nodes
(:func:`~mlx_redrafter.step.select.row_structure`). :class:`AutoTree` holds
one generation's calibration and curve and turns those rows into the
verified subset:

* the pipelined loop asks :meth:`AutoTree.bucket` for the tree size (host
  estimates only), then :meth:`AutoTree.select` picks the nodes on the
  device; the step's one read carries :attr:`Selection.codes`, from which
  :meth:`AutoTree.observe` learns;
* the synchronous loop has the rows on the host after its read and trims
  them with :meth:`AutoTree.trim` (the exact best subset), then learns from
  what the next read accepts (:meth:`AutoTree.observe_rows`).

Nothing here reads the device: the loops' one read brings what it needs.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .curve import builtin_curve
from .select import (
    DEPTHS,
    PRIOR_Q,
    Q_MIN,
    SOURCES,
    Calibration,
    Observed,
    Selection,
    Structure,
    best_subset,
    bucket_of,
    decode_codes,
    path_p,
    pick_bucket,
    row_structure,
    select_device,
)
from .tree import PAD, unique_mask

DRAFTER, LOOKUP = SOURCES.index("drafter"), SOURCES.index("lookup")


def drafter_scores(beams) -> mx.array:
    """``[W, L]`` each drafter node's own log-probability given its parent
    (lazy), from :class:`~mlx_redrafter.draft.beam.Beams`. A drafter that
    reports no per-depth scores counts every node as sure (log 1)."""
    if beams.path_scores is None:
        return mx.zeros(beams.tokens.shape, mx.float32)
    cum = beams.path_scores
    return mx.concatenate([cum[:, :1], cum[:, 1:] - cum[:, :-1]], axis=1)


def can_pay(draft, curve=None) -> bool:
    """Whether any tree ``draft`` could propose is expected to beat ``g0``
    alone on ``curve`` (default: ``draft.curve``, else the built-in one).

    Every row it could draft (the drafter's ``W`` beams of ``L``, the stateful
    sources' beams, its lookup rows, a datastore row) is scored at the most confident prior of its
    source and depth: if even that best case does not pay, no step of the
    generation will, and plain decoding runs instead (a steep curve, e.g. a
    4-bit model on a CPU, where two tokens cost about two plain steps).
    """
    curve = curve if curve is not None else (draft.curve if draft.curve is not None else builtin_curve())
    lengths, sources = [], []
    if draft.drafter is not None:
        lengths += [draft.beam_length] * draft.beam_width
        sources += [SOURCES[DRAFTER]] * draft.beam_width
    for name, width, length in draft.source_rows:  # an MTP head, a draft model
        lengths += [length] * width
        sources += [name] * width
    rows = draft.lookup or (1 if draft.datastore is not None else 0)
    lengths += [draft.lookup_length] * rows
    sources += [SOURCES[LOOKUP] if draft.lookup else "datastore"] * rows
    if not lengths:
        return False
    structure = row_structure(lengths, sources)
    best = PRIOR_Q.max(axis=2)  # [source, depth]: the most confident bucket
    q = best[structure.source, np.minimum(structure.depth, DEPTHS) - 1].astype(np.float64)
    p = path_p(np, structure.parent, q, max(lengths))
    return best_subset(p, structure, curve)[1] > 1.0


def row_sources(drafter_rows: int, rows: int) -> List[str]:
    """Each row's source: the drafter's rows first, then lookup rows (protocol.py's order)."""
    return [SOURCES[DRAFTER]] * drafter_rows + [SOURCES[LOOKUP]] * (rows - drafter_rows)


CONTEXT_STEP = 64  # the context-dependent curve is re-priced every this many tokens


class AutoTree:
    """One generation's cost-aware selection: its :class:`Calibration` and curve."""

    def __init__(self, curve=None, calibration: Optional[Calibration] = None):
        self.base = curve if curve is not None else builtin_curve()
        self.curve = self.base  # the base curve at the current context (:meth:`advance`)
        self.cal = calibration if calibration is not None else Calibration()
        self._shapes = {}
        self.pending: Optional[Tuple[Structure, List[List[int]], List[int]]] = None  # synchronous loop
        self.tokens, self._step = 0, 0

    def advance(self, tokens: int) -> None:
        """``tokens`` more positions are cached (the prompt, then each step's
        tokens): trees are priced at the context they attend to, the curve
        moved every :data:`CONTEXT_STEP` tokens (host numbers only)."""
        self.tokens += tokens
        step = self.tokens // CONTEXT_STEP
        if step != self._step:
            self._step = step
            self.curve = self.base.at(step * CONTEXT_STEP)

    def shape(self, lengths: Sequence[int], sources: Sequence[str]):
        """``(Structure, device ancestors)`` of rows of these lengths and sources (cached)."""
        key = (tuple(lengths), tuple(sources))
        if key not in self._shapes:
            s = row_structure(lengths, sources)
            self._shapes[key] = (s, mx.array(s.ancestors()))
        return self._shapes[key]

    # ------------------------------------------------------------------ pipelined

    def bucket(self, structure: Structure, score: Optional[Sequence[float]] = None) -> int:
        """The tree size to verify (g0 included), from host estimates of p:
        ``score`` per candidate where the host knows it (a lookup row's
        matched length; NaN where not), else each node's sibling-rank rate."""
        score = None if score is None or len(score) != structure.size else score  # host numbers, NaN = unknown
        return pick_bucket(self.cal.estimate(structure, score), structure, self.curve)

    def select(
        self, structure: Structure, ancestors, beams: mx.array, lay, scores: mx.array, k: int, dedup: bool
    ) -> Tuple[Selection, mx.array, mx.array]:
        """The device's top-``k`` of the rows ``beams [R, L]`` laid out as ``lay``:
        ``(selection, rows, node_index)``, rows and node index ``[R, L]``
        over the selection's packed tree (not verified: ``PAD``).

        ``scores [R, L]`` are the nodes' raw scores. ``dedup`` (sampling)
        drops a node whose prefix an earlier row already holds, with its
        subtree: the sampling walk needs each prefix once.
        """
        valid = beams >= 0
        if dedup:
            valid = valid & unique_mask(beams)
        pick = (lay.node_row, lay.node_pos)
        sel = select_device(structure, scores[pick], valid[pick], self.cal.device_table(), k, ancestors)
        rows, index = sel.rows(beams, lay.node_index)
        live = sel.p[mx.maximum(lay.node_index - 1, 0)] > 0
        return sel, mx.where(live & (index > 0), rows, PAD), mx.where(live, index, 0).astype(mx.int32)

    def observe(self, structure: Structure, codes: Sequence[int], path: Sequence[int]) -> None:
        """Learn from a pipelined step's read: its codes and accepted path."""
        self.cal.observe(decode_codes(codes, structure), path)

    def observe_unverified(
        self,
        rows: Sequence[Sequence[int]],
        scores: Sequence[float],
        source: str,
        before: Sequence[int],
        emitted: Sequence[int],
    ) -> None:
        """Learn from host rows the step did not verify (greedy decoding only).

        A lookup or datastore row left out of the tree would be a row that
        is never observed again, so its calibration could never recover from
        a low prior. Under greedy decoding a draft token is accepted exactly
        when it equals the model's own token there, and the host reads those
        tokens anyway: ``rows`` were proposed after the tokens the host had
        read, so each must first repeat ``before`` (what the step in flight
        emitted); its next tokens are then compared with ``emitted`` (this
        step's tokens). Nodes past ``emitted`` are not observed.
        """
        k, src = len(before), SOURCES.index(source)
        for rank, (row, score) in enumerate(zip(rows, scores)):
            if list(row[:k]) != list(before):
                continue
            draft = list(row[k:])[: len(emitted)]
            if not draft:
                continue
            b = bucket_of(np, np.full(1, src), np.full(1, score, np.float32))[0]  # host numbers
            n = len(draft)
            hits = 0
            while hits < n and draft[hits] == emitted[hits]:
                hits += 1
            nodes = Observed([src] * n, list(range(1, n + 1)), [b] * n, list(range(n)), [min(rank, 3)] * n)
            self.cal.observe(nodes, list(range(hits + 1)))

    # ------------------------------------------------------------------ synchronous

    def trim(
        self, rows: List[List[int]], sources: Sequence[str], buckets: Sequence[int], max_size: Optional[int] = None
    ) -> List[List[int]]:
        """The best parent-closed subset of host ``rows`` (PAD-padded, equal
        lengths) as rows cut short with ``PAD``. ``buckets`` holds each
        row-major node's score bucket (-1: padding)."""
        lengths = [len(r) for r in rows]
        structure, _ = self.shape(lengths, sources)
        flat = [t for r in rows for t in r]
        valid = [t >= 0 and b >= 0 for t, b in zip(flat, buckets)]
        b = np.maximum(np.fromiter(buckets, np.int64, len(flat)), 0)
        q = self.cal.table()[structure.source, np.minimum(structure.depth, DEPTHS) - 1, b]
        q = np.where(np.fromiter(valid, bool, len(flat)), np.clip(q, Q_MIN, 1.0), 0.0)
        p = path_p(np, structure.parent, q, max(lengths, default=1))
        keep = set(best_subset(p, structure, self.curve, max_size)[0])
        out, start = [], 0
        for r in rows:
            cut = sum(1 for j in range(len(r)) if start + j in keep)
            out.append(r[:cut] + [PAD] * (len(r) - cut))
            start += len(r)
        self.pending = (structure, out, [bk if v else -1 for bk, v in zip(buckets, valid)])
        return out

    def observe_rows(self, accepted: Sequence[int]) -> None:
        """Learn from the synchronous step that verified :meth:`trim`'s rows
        and accepted the drafts ``accepted``."""
        if self.pending is None:
            return
        structure, rows, buckets = self.pending
        self.pending = None
        src, dep, bkt, par, rank, hits = [], [], [], [], [], {0}
        ranks = structure.rank()
        position = {}
        flat = [(r, j) for r, row in enumerate(rows) for j in range(len(row))]
        for cand, (r, j) in enumerate(flat):
            if rows[r][j] < 0:
                continue
            position[cand] = len(src) + 1
            parent = structure.parent[cand]
            src.append(structure.source[cand])
            dep.append(structure.depth[cand])
            bkt.append(buckets[cand])
            par.append(position.get(parent, 0) if parent >= 0 else 0)
            rank.append(ranks[cand])
            if j < len(accepted) and rows[r][: j + 1] == list(accepted[: j + 1]):
                hits.add(position[cand])
        self.cal.observe(Observed(src, dep, bkt, par, rank), sorted(hits))


def lookup_buckets(matched: Sequence[int], rows: int, length: int, source: str = "lookup") -> List[int]:
    """Host score buckets of ``rows`` lookup rows of ``length`` nodes: each
    row's score, the matched suffix length (a datastore row: its
    continuation's count; a missing row: -1, padding)."""
    out, src = [], SOURCES.index(source)
    for i in range(rows):
        if i < len(matched):
            b = bucket_of(np, np.full(1, src), np.full(1, matched[i], np.float32))[0]
            out += [b] * length
        else:
            out += [-1] * length
    return out
