"""Verify only what pays: expected-gain selection of draft-tree nodes.

Every source proposes candidate nodes (the drafter's beam nodes, lookup
continuations, later the datastore's), each with a parent, a depth and a raw
score. A calibration turns the score into ``q``, the probability that the
node is accepted given that its parent is, per (source, depth, score bucket);
``p(node) = p(parent) * q`` is the probability that its whole path is
accepted. A parent-closed subset ``S`` verified with ``g0`` then yields
``1 + sum_S p`` tokens in expectation (linearity: a node is accepted exactly
when its path is) at a cost of ``c(1 + |S|)`` plain steps
(:mod:`~mlx_redrafter.step.curve`), and the rule is to maximize their ratio.

Why a greedy add-by-p is exact: ``q <= 1``, so ``p(child) <= p(parent)``.
Order the nodes by ``p`` descending, ties by depth ascending, then index:
every node's parent comes before it (a larger ``p``, or the same ``p`` and a
smaller depth). So each prefix of that order is parent-closed, and the
top-``k`` prefix has the largest ``sum p`` of *any* ``k`` nodes; the best
``S`` of each size is that prefix, and evaluating every size (c is neither
monotone nor convex, so no first-stop rule) finds the optimum. The greedy
that always adds the best frontier node (parent already in ``S``) walks that
same order.

For the pipelined loop the tree size must be known on the host a step
ahead: :func:`pick_bucket` chooses a size from :data:`BUCKETS` using host
estimates of ``p``, and :func:`select_device` picks the top-``k`` nodes by
the step's actual ``p`` with fixed-shape MLX ops and no sync. Its
:attr:`Selection.codes` go into the step's one host read, and
:meth:`Calibration.observe` learns from them and the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .curve import BUCKET_SIZES
from .source import DEPTHS, N_BUCKETS, RANKS, Prior
from .tree import PAD, Tree

BUCKETS = BUCKET_SIZES  # verified tree sizes, g0 included
Q_MIN = 0.01  # floor of q, so that p stays a normal float32 up to depth 16
PRIOR_WEIGHT = 20.0  # pseudo-observations behind each prior rate
MAX_WEIGHT = 2000.0  # observations kept per cell: older ones fade, so the rates follow the text


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Structure:
    """The static shape of a step's candidates (host numpy arrays, ``[M]``).

    ``parent[i]`` is the index of node ``i``'s parent, ``-1`` for a child of
    ``g0``; parents come before children. ``source`` holds each node's
    calibration channel (an index into :class:`Calibration`'s priors);
    ``depth`` is 1 for a child of ``g0``.
    """

    parent: np.ndarray
    source: np.ndarray
    depth: np.ndarray

    @property
    def size(self) -> int:
        return int(self.parent.shape[0])

    def rank(self) -> np.ndarray:
        """Each node's place among the earlier nodes of its source and depth (capped at ``RANKS - 1``)."""
        seen, out = {}, []
        for key in zip(self.source.tolist(), self.depth.tolist()):
            out.append(min(seen.get(key, 0), RANKS - 1))
            seen[key] = seen.get(key, 0) + 1
        return np.array(out, np.int32)

    def ancestors(self) -> np.ndarray:
        """``[M+1, M+1]`` bool over g0 + nodes: ``[q, k]`` = k is q or an ancestor of q."""
        m = self.size
        anc = np.eye(m + 1, dtype=bool)
        anc[:, 0] = True
        for i in range(m):  # parents come first, so their rows are complete
            if self.parent[i] >= 0:
                anc[i + 1] |= anc[self.parent[i] + 1]
        return anc


def row_structure(lengths: Sequence[int], channels: Sequence[int]) -> Structure:
    """The candidates of rows (a drafter beam, a lookup row, ...) that own
    their nodes, in :func:`~mlx_redrafter.step.tree.layout` order: row ``r``'s
    token ``j`` is candidate ``sum(lengths[:r]) + j`` (its layout node + 1).
    ``channels``: each row's calibration channel."""
    parent, source, depth = [], [], []
    for n, channel in zip(lengths, channels):
        start = len(parent)
        for j in range(n):
            parent.append(start + j - 1 if j else -1)
            source.append(int(channel))
            depth.append(j + 1)
    return Structure(np.array(parent, np.int32), np.array(source, np.int32), np.array(depth, np.int32))


# --------------------------------------------------------------------------- probabilities (numpy or MLX)


def bucket_of(xp, edges, source, score):
    """Score bucket of each node (``xp`` is ``numpy`` or ``mlx.core``;
    ``edges [C, B-1]``: each channel's, :attr:`Calibration.edges`)."""
    edges = xp.array(edges)[source]  # [M, B-1]
    return (score[:, None] >= edges).sum(axis=1).astype(xp.int32)


def path_p(xp, parent, q, max_depth: int):
    """``p = q * p(parent)`` down the tree (``max_depth`` passes fix every level)."""
    p = q
    for _ in range(max_depth - 1):
        p = q * xp.where(parent >= 0, p[xp.maximum(parent, 0)], 1.0)
    return p


def node_p(xp, structure: Structure, score, valid, table, edges):
    """``(p, bucket)`` of every candidate: invalid ones (padding) get ``p = 0``
    and bucket -1. ``table [C, D, B]`` is :meth:`Calibration.table`, ``edges``
    :attr:`Calibration.edges`."""
    source, depth = xp.array(structure.source), xp.array(structure.depth)
    parent = xp.array(structure.parent)
    bucket = bucket_of(xp, edges, source, score)
    q = xp.array(table)[source, xp.minimum(depth, DEPTHS) - 1, bucket]
    q = xp.where(valid, xp.clip(q, Q_MIN, 1.0), 0.0).astype(xp.float32)
    p = path_p(xp, parent, q, int(structure.depth.max(initial=1)))
    return p, xp.where(valid, bucket, -1)


def rank_by_p(xp, p, depth):
    """Each node's place in the order p descending, depth ascending, index
    ascending (a permutation of ``0..M-1``; parents rank before children)."""
    idx = xp.arange(p.shape[0])
    same_p = p[None, :] == p[:, None]
    shallower = (depth[None, :] < depth[:, None]) | ((depth[None, :] == depth[:, None]) & (idx[None, :] < idx[:, None]))
    before = (p[None, :] > p[:, None]) | (same_p & shallower)  # [i, j]: j comes before i
    return before.sum(axis=1).astype(xp.int32)


# --------------------------------------------------------------------------- host selection


def greedy_order(p: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> List[int]:
    """Every node, in the order the greedy adds them: the frontier node
    (parent already added) of largest ``p``, ties to the shallower, then lower index."""
    children = [[] for _ in range(len(p))]
    frontier = []
    for i, par in enumerate(parent):
        (frontier if par < 0 else children[par]).append(i)
    order = []
    while frontier:
        best = min(frontier, key=lambda i: (-p[i], depth[i], i))
        frontier.remove(best)
        order.append(best)
        frontier += children[best]
    return order


def expected_gain(p_sum: float, size: int, curve) -> float:
    """Expected tokens per plain-step time of a tree of ``size`` tokens whose nodes' p sum to ``p_sum``."""
    return (1.0 + p_sum) / curve(size)


def best_subset(p, structure: Structure, curve, max_size: Optional[int] = None) -> Tuple[List[int], float]:
    """The parent-closed ``S`` maximizing ``(1 + sum_S p) / c(1 + |S|)``, and that value.

    Every size up to ``max_size`` (default: the curve's) is evaluated, the
    best kept. ``S`` lists nodes in the order added (parents first).
    """
    p = np.asarray(p, np.float64)
    limit = (max_size or curve.max_size) - 1
    order = greedy_order(p, structure.parent, structure.depth)[: max(limit, 0)]
    best_k, best, total = 0, expected_gain(0.0, 1, curve), 0.0
    for k, i in enumerate(order, start=1):
        total += p[i]
        value = expected_gain(total, k + 1, curve)
        if value > best:
            best_k, best = k, value
    return order[:best_k], best


def pick_bucket(p_estimate, structure: Structure, curve, buckets: Sequence[int] = BUCKETS) -> int:
    """The tree size (from ``buckets``, g0 included) with the best expected gain
    for host estimates of p (:meth:`Calibration.estimate`); only sizes the
    candidates can fill are considered."""
    p = np.asarray(p_estimate, np.float64)
    order = greedy_order(p, structure.parent, structure.depth)
    sums = np.concatenate([[0.0], np.cumsum(p[order])])
    sizes = [b for b in buckets if b - 1 <= structure.size] or [1]
    return max(sizes, key=lambda b: (expected_gain(sums[b - 1], b, curve), -b))


# --------------------------------------------------------------------------- device selection


@dataclass
class Selection:
    """The ``k`` verified nodes of a step, chosen on the device (all lazy).

    Packed index 0 is ``g0``; index ``i >= 1`` is candidate ``nodes[i - 1]``.
    """

    nodes: mx.array  # [k] candidate indices, parents first
    position: mx.array  # [M] packed index of each candidate, 0 when not verified
    depth: mx.array  # [k+1]
    parent: mx.array  # [k+1] packed index of each node's parent (g0's is 0)
    mask: mx.array  # [k+1, k+1] bool: ancestor-or-self
    codes: mx.array  # [k] int32 for the host read: :func:`code_of` each node, -1 for padding
    p: mx.array  # [M] each candidate's p (0: invalid, or under an invalid parent)

    def tree(self, tokens: mx.array, g0: mx.array) -> Tree:
        """The :class:`~mlx_redrafter.step.tree.Tree` to verify, from the candidates' ``tokens [M]``.

        Its ``node_index`` is ``[1, M]`` (candidate -> packed index); use
        :meth:`rows` for the ``[R, L]`` view that acceptance takes.
        """
        picked = mx.maximum(tokens[self.nodes], 0)
        all_tokens = mx.concatenate([g0.reshape(1).astype(tokens.dtype), picked])
        return Tree(all_tokens, self.depth, self.parent, self.position[None], self.mask)

    def rows(self, beams: mx.array, node_index: mx.array) -> Tuple[mx.array, mx.array]:
        """``(beams, node_index)`` ``[R, L]`` for :func:`~mlx_redrafter.step.accept.accept_greedy`:
        ``node_index`` is a :class:`~mlx_redrafter.step.tree.Layout`'s (candidate
        ``i`` is layout node ``i + 1``); nodes not verified become ``PAD``
        (never accepted) at packed index 0."""
        idx = self.position[mx.maximum(node_index - 1, 0)]
        chosen = (node_index > 0) & (idx > 0)
        return mx.where(chosen, beams, PAD), mx.where(chosen, idx, 0).astype(mx.int32)


def select_device(
    structure: Structure,
    score: mx.array,
    valid: mx.array,
    table: mx.array,
    edges,
    k: int,
    ancestors: Optional[mx.array] = None,
    canon: Optional[mx.array] = None,
) -> Selection:
    """The top-``k`` candidates by p, ties to the shallower (parent-closed,
    see the module doc), with fixed shapes and no host sync.

    ``score [M]`` and ``valid [M]`` are the step's device arrays; ``k``
    (``bucket - 1``) is at most ``structure.size``. ``ancestors`` is
    ``mx.array(structure.ancestors())``, cached by the caller. ``canon
    [M]`` (optional, lazy): each candidate's first copy, where rows share a
    prefix (a beam search's or a block's top paths); a later copy is never
    chosen (it ranks last), and what hangs below it hangs below the first
    copy, which it attends to and descends from: each prefix is verified once.
    """
    if not 0 <= k <= structure.size:
        raise ValueError(f"cannot verify {k} of {structure.size} candidates")
    p, bucket = node_p(mx, structure, score, valid, table, edges)
    depth, parent = mx.array(structure.depth), mx.array(structure.parent)
    anc = ancestors if ancestors is not None else mx.array(structure.ancestors())
    if canon is not None:
        # A copy has its first copy's p (the same path), so that first copy ranks before
        # anything the copy's children rank before; the copy itself ranks after everything.
        first = canon == mx.arange(p.shape[0], dtype=canon.dtype)
        rank = rank_by_p(mx, mx.where(first, p, -1.0), depth)
        anc = _to_first_copies(anc, canon)
    else:
        rank = rank_by_p(mx, p, depth)
    nodes = mx.argsort(rank)[:k].astype(mx.int32)
    position = mx.where(rank < k, rank + 1, 0).astype(mx.int32)
    if canon is not None:  # a copy is verified as its first copy: its children's parent, its rows' node
        position = position[canon]
    zero = mx.zeros((1,), mx.int32)
    sel_parent = parent[nodes]
    packed_parent = mx.where(sel_parent >= 0, position[mx.maximum(sel_parent, 0)], 0)
    ext = mx.concatenate([zero, nodes + 1])
    mask = anc[ext][:, ext]
    b = bucket[nodes]
    codes = mx.where(b >= 0, code_of(nodes, b, packed_parent, structure), -1).astype(mx.int32)
    return Selection(
        nodes,
        position,
        mx.concatenate([zero, depth[nodes]]),
        mx.concatenate([zero, packed_parent.astype(mx.int32)]),
        mask,
        codes,
        p,
    )


def _to_first_copies(anc: mx.array, canon: mx.array) -> mx.array:
    """``ancestors [M+1, M+1]`` (index 0: ``g0``) with every ancestor that
    is a later copy replaced by its first copy (``canon [M]``)."""
    ext = mx.concatenate([mx.zeros((1,), canon.dtype), canon.astype(canon.dtype) + 1])
    n = anc.shape[0]
    to_first = (ext[:, None] == mx.arange(n, dtype=ext.dtype)[None, :]).astype(mx.float32)  # [k', k]
    return (anc.astype(mx.float32) @ to_first) > 0


# --------------------------------------------------------------------------- calibration


@dataclass
class Observed:
    """Host view of one verified tree: node ``i`` sits at packed index ``i + 1``."""

    source: List[int]
    depth: List[int]
    bucket: List[int]  # -1: padding (not observed)
    parent: List[int]  # packed index of the parent, 0 = g0
    rank: Optional[List[int]] = None  # :meth:`Structure.rank` of each node (None: host estimates not learned)


def code_of(candidate, bucket, packed_parent, structure: Structure):
    """A verified node's code in the step's read: its candidate, score
    bucket and packed parent (where rows share a prefix, the parent is not
    the structure's: :func:`select_device`'s ``canon``)."""
    return (candidate * N_BUCKETS + bucket) * (structure.size + 1) + packed_parent


def code_candidate(code: int, structure: Structure) -> int:
    """The candidate of a code (-1: padding)."""
    return code // (structure.size + 1) // N_BUCKETS if code >= 0 else -1


def decode_codes(codes: Sequence[int], structure: Structure) -> Observed:
    """:attr:`Selection.codes` as read by the host -> :class:`Observed`."""
    ranks, stride = structure.rank(), structure.size + 1
    src, dep, bkt, par, rnk = [], [], [], [], []
    for c in codes:
        if c < 0:
            src.append(0), dep.append(0), bkt.append(-1), par.append(0), rnk.append(0)
            continue
        cand, bucket = divmod(c // stride, N_BUCKETS)
        src.append(int(structure.source[cand]))
        dep.append(int(structure.depth[cand]))
        bkt.append(bucket)
        par.append(c % stride)
        rnk.append(int(ranks[cand]))
    return Observed(src, dep, bkt, par, rnk)


class Calibration:
    """Conditional acceptance rates q[channel, depth, bucket], learned online.

    One channel per prior (:class:`~mlx_redrafter.step.source.Prior`, a
    source's: its score edges and prior rates); :meth:`channel` gives a
    prior's index by name. Each cell is ``(hits + w q0) / (trials + w)``
    with prior ``q0`` and weight ``w``; a cell's counts are scaled down past
    ``max_weight`` observations so that it follows a change of text.
    """

    def __init__(self, priors: Sequence[Prior], weight: float = PRIOR_WEIGHT, max_weight: float = MAX_WEIGHT):
        unique = {}
        for p in priors:
            unique.setdefault(p.name, p)
        self.priors = list(unique.values())
        self.names = {p.name: i for i, p in enumerate(self.priors)}
        self.edges = np.array([p.edges for p in self.priors], np.float32).reshape(len(self.priors), N_BUCKETS - 1)
        prior = np.stack([p.q for p in self.priors]) if self.priors else np.zeros((0, DEPTHS, N_BUCKETS))
        slot_prior = np.stack([p.slots for p in self.priors]) if self.priors else np.zeros((0, DEPTHS, RANKS))
        self.prior, self.weight, self.max_weight = np.asarray(prior, np.float64), weight, max_weight
        self.hits = np.zeros_like(self.prior)
        self.trials = np.zeros_like(self.prior)
        # The same counts by sibling rank instead of score: the host's estimates.
        self.slot_prior = np.asarray(slot_prior, np.float64)
        self.slot_hits = np.zeros_like(self.slot_prior)
        self.slot_trials = np.zeros_like(self.slot_prior)
        self._device = None

    def channel(self, name: str) -> int:
        """The index of the prior called ``name``."""
        return self.names[name]

    def table(self) -> np.ndarray:
        """q [C, D, B] as float32."""
        return ((self.hits + self.weight * self.prior) / (self.trials + self.weight)).astype(np.float32)

    def device_table(self) -> mx.array:
        """:meth:`table` on the device (rebuilt only after an observation)."""
        if self._device is None:
            self._device = mx.array(self.table())
        return self._device

    def observe(self, nodes: Observed, accepted_path: Sequence[int]) -> None:
        """Learn from a verified tree and the packed indices the step accepted
        (``g0`` first, as the loop reads ``path[: n + 1]``): every node whose
        parent was accepted is a trial of its cell, a hit when it was accepted too."""
        accepted = set(accepted_path) | {0}
        for i, b in enumerate(nodes.bucket):
            if b < 0 or nodes.parent[i] not in accepted:
                continue
            hit = (i + 1) in accepted
            d = min(nodes.depth[i], DEPTHS) - 1
            self._count(self.hits, self.trials, (nodes.source[i], d, b), hit)
            if nodes.rank is not None:
                self._count(self.slot_hits, self.slot_trials, (nodes.source[i], d, nodes.rank[i]), hit)
        self._device = None

    def _count(self, hits: np.ndarray, trials: np.ndarray, cell, hit: bool) -> None:
        trials[cell] += 1
        hits[cell] += hit
        if trials[cell] > self.max_weight:
            scale = self.max_weight / trials[cell]
            trials[cell] *= scale
            hits[cell] *= scale

    def marginal(self, source: int, depth: int, rank: int = 0) -> float:
        """q of the ``rank``-th node of (source, depth), whatever its score."""
        cell = (source, min(depth, DEPTHS) - 1, min(rank, RANKS - 1))
        w = self.weight
        return float((self.slot_hits[cell] + w * self.slot_prior[cell]) / (self.slot_trials[cell] + w))

    def estimate(self, structure: Structure, score: Optional[np.ndarray] = None) -> np.ndarray:
        """Host estimates of p for :func:`pick_bucket`: from ``score`` where the
        host knows it (NaN where not, e.g. the drafter's, still on the
        device), else the rate of each node's (source, depth, sibling rank)."""
        m = structure.size
        score = np.full(m, np.nan, np.float32) if score is None else np.asarray(score, np.float32)
        known = ~np.isnan(score)
        q = np.array(
            [
                self.marginal(int(s), int(d), int(r))
                for s, d, r in zip(structure.source, structure.depth, structure.rank())
            ]
        )
        if known.any():
            b = bucket_of(np, self.edges, structure.source, np.where(known, score, 0.0))
            table = self.table()[structure.source, np.minimum(structure.depth, DEPTHS) - 1, b]
            q = np.where(known, table, q)
        q = np.clip(q, Q_MIN, 1.0)
        return path_p(np, structure.parent, q, int(structure.depth.max(initial=1)))
