"""``tree="auto"``: verify only the nodes that pay, on a cost the step's
size is priced by.

The candidates of a step are the rows every source proposed (a beam, a
lookup row...), each row owning its nodes
(:func:`~mlx_redrafter.step.select.row_structure`). :class:`AutoTree` holds
one generation's calibration (a channel per source's prior) and cost, and
turns those rows into the verified subset: :meth:`AutoTree.bucket` picks
the tree size from host estimates (size 1: ``g0`` alone, a plain decoding
step), :meth:`AutoTree.select` picks the nodes on the device, and the
step's one read carries :attr:`~mlx_redrafter.step.select.Selection.codes`,
from which :meth:`AutoTree.observe` learns.

The cost is anything with :class:`~mlx_redrafter.step.curve.CostCurve`'s
interface (``cost(n)`` in plain steps, ``max_size``, ``at(context)``): the
device's stored curve (calibrated, else the built-in one) is the prior, and
a :class:`~mlx_redrafter.step.live_cost.LiveCost` learns from every step's
measured size and time (:meth:`AutoTree.timed`), so within a few steps the
sizes are priced at what they cost on this machine now, at this context.

Nothing here reads the device: the loop's one read brings what it needs.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .curve import builtin_curve
from .live_cost import LiveCost
from .select import (
    DEPTHS,
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
from .tree import prefix_tree, unique_mask

CONTEXT_STEP = 64  # the context-dependent curve is re-priced every this many tokens


def can_pay(sources: Sequence, curve=None) -> bool:
    """Whether any tree ``sources`` could propose is expected to beat ``g0``
    alone on ``curve`` (default: the built-in one).

    Every row a source could draft (its most rows, of its longest length) is
    scored at the most confident prior of its channel and depth: if even
    that best case does not pay, no step of the generation will, and plain
    decoding runs instead (a steep curve, e.g. a 4-bit model on a CPU, where
    two tokens cost about two plain steps).
    """
    curve = curve if curve is not None else builtin_curve()
    cal = Calibration([s.prior for s in sources])
    lengths, channels = [], []
    for s in sources:
        lengths += [s.length] * s.rows
        channels += [cal.channel(s.prior.name)] * s.rows
    if not lengths:
        return False
    structure = row_structure(lengths, channels)
    best = cal.prior.max(axis=2)  # [channel, depth]: the most confident bucket
    q = best[structure.source, np.minimum(structure.depth, DEPTHS) - 1].astype(np.float64)
    p = path_p(np, structure.parent, q, max(lengths))
    return best_subset(p, structure, curve)[1] > 1.0


class AutoTree:
    """One generation's cost-aware selection: its :class:`Calibration` and cost."""

    def __init__(self, curve=None, priors: Sequence = (), calibration: Optional[Calibration] = None, live: bool = True):
        self.base = curve if curve is not None else builtin_curve()
        # The stored curve is the live cost's prior; False: the stored curve alone (a sweep's fixed setting).
        self.live = LiveCost(self.base) if live else None
        self.curve = self.base  # the base curve at the current context (:meth:`advance`)
        self.cal = calibration if calibration is not None else Calibration(priors)
        self.edges = mx.array(self.cal.edges)
        self._shapes = {}
        self.tokens, self._step = 0, 0

    def advance(self, tokens: int) -> None:
        """``tokens`` more positions are cached (the prompt, then each step's
        tokens): trees are priced at the context they attend to, the curve
        moved every :data:`CONTEXT_STEP` tokens (host numbers only)."""
        self.tokens += tokens
        step = self.tokens // CONTEXT_STEP
        if step != self._step:
            self._step = step
            if self.live is None or not self.live.samples:  # a live cost follows the context by itself
                self.curve = self.base.at(step * CONTEXT_STEP)

    def timed(self, size: int, seconds: float, sources: Sequence[str] = ()) -> None:
        """A step of ``size`` tokens, drafted by ``sources``, took ``seconds``:
        the live cost learns from it and prices the next step's sizes (the
        drafting itself is spent by then: the marginal curve)."""
        if self.live is None:
            return
        self.live.observe(size, seconds, sources)
        self.curve = self.live.curve()

    def shape(self, lengths: Sequence[int], priors: Sequence[str]):
        """``(Structure, device ancestors)`` of rows of these lengths and priors' names (cached)."""
        key = (tuple(lengths), tuple(priors))
        if key not in self._shapes:
            s = row_structure(lengths, [self.cal.channel(p) for p in priors])
            self._shapes[key] = (s, mx.array(s.ancestors()))
        return self._shapes[key]

    def bucket(self, structure: Structure, score: Optional[Sequence[float]] = None) -> int:
        """The tree size to verify (g0 included; 1: ``g0`` alone), from host
        estimates of p: ``score`` per candidate where the host knows it (a
        lookup row's matched length; NaN where not), else each node's
        sibling-rank rate."""
        score = None if score is None or len(score) != structure.size else score  # host numbers, NaN = unknown
        return pick_bucket(self.cal.estimate(structure, score), structure, self.curve)

    def select(
        self, structure: Structure, ancestors, beams: mx.array, lay, scores: mx.array, k: int, dedup: bool
    ) -> Tuple[Selection, mx.array, mx.array]:
        """The device's top-``k`` of the rows ``beams [R, L]`` laid out as ``lay``:
        ``(selection, rows, node_index)``, rows and node index ``[R, L]``
        over the selection's packed tree (not verified: ``PAD``).

        ``scores [R, L]`` are the nodes' raw scores. A prefix that rows share
        is verified once. ``dedup`` (sampling) drops a node whose prefix an
        earlier row already holds, with its subtree: the sampling walk needs
        each prefix once; without it (greedy) the later rows' nodes below
        the shared prefix hang below its first copy (``select_device``'s ``canon``).
        """
        from .tree import PAD

        valid = beams >= 0
        pick = (lay.node_row, lay.node_pos)
        canon = None
        if dedup:
            valid = valid & unique_mask(beams)
        elif len(lay.lengths) > 1:
            first = prefix_tree(beams)  # [R, L]: the first row holding each prefix
            canon = (lay.node_index[first, mx.arange(beams.shape[1])[None, :]] - 1)[pick]
        table = self.cal.device_table()
        sel = select_device(structure, scores[pick], valid[pick], table, self.edges, k, ancestors, canon)
        rows, index = sel.rows(beams, lay.node_index)
        live = sel.p[mx.maximum(lay.node_index - 1, 0)] > 0
        return sel, mx.where(live & (index > 0), rows, PAD), mx.where(live, index, 0).astype(mx.int32)

    def observe(self, structure: Structure, codes: Sequence[int], path: Sequence[int]) -> None:
        """Learn from a step's read: its codes and accepted path."""
        self.cal.observe(decode_codes(codes, structure), path)

    def observe_unverified(
        self,
        rows: Sequence[Sequence[int]],
        scores: Sequence[float],
        prior: str,
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
        emitted, when they were built ahead); its next tokens are then
        compared with ``emitted`` (this step's tokens). Nodes past
        ``emitted`` are not observed.
        """
        k, src = len(before), self.cal.channel(prior)
        for rank, (row, score) in enumerate(zip(rows, scores)):
            if list(row[:k]) != list(before):
                continue
            draft = list(row[k:])[: len(emitted)]
            if not draft:
                continue
            b = bucket_of(np, self.cal.edges, np.full(1, src), np.full(1, score, np.float32))[0]  # host numbers
            n = len(draft)
            hits = 0
            while hits < n and draft[hits] == emitted[hits]:
                hits += 1
            nodes = Observed([src] * n, list(range(1, n + 1)), [b] * n, list(range(n)), [min(rank, 3)] * n)
            self.cal.observe(nodes, list(range(hits + 1)))


__all__: List[str] = ["AutoTree", "CONTEXT_STEP", "can_pay"]
