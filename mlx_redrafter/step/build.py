"""The one tree builder and the one acceptance over what it built.

A step's :class:`Candidates` are the rows every source proposed, joined in
the plan's order. :func:`build` turns them into the tree the model verifies
(:class:`Built`), in one of three shapes:

* **packed** (``tree="fixed"``, every row on the host): rows that share a
  prefix share its nodes (step/tree.py ``pack``); only the read-then-build
  schedule has every row on the host before the tree is built;
* **laid out** (``tree="fixed"``): each row owns its nodes
  (step/tree.py ``Layout``), so the size is ``1 + sum(lengths)``, known on the
  host before the rows are: the build-ahead schedule needs that;
* **chosen** (``tree="auto"``): the nodes that pay on the cost, picked on
  the device from the laid-out rows (step/auto.py); the policy may choose
  ``g0`` alone (a plain decoding step).

Nothing drafted, or nothing chosen, is :meth:`Built.alone`: ``g0`` verified
alone. :func:`accept` keeps the longest path the model agrees with (greedy:
argmax; sampling: exact, each prefix once in the walk), over logits masked
by a grammar when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx

from ..config import PAD
from .accept import Accepted, accept_greedy, accept_sampling, sample_first
from .source import Prior, Rows
from .tree import Tree, count_rows, layout, merged_parent, pack


@dataclass
class Candidates:
    """A step's rows, one block per source that proposed (plan order)."""

    blocks: List[Rows] = field(default_factory=list)

    @property
    def lengths(self) -> tuple:
        return tuple(n for b in self.blocks for n in b.lengths)

    @property
    def labels(self) -> tuple:
        """Each row's label (the step stats' ``source``)."""
        return tuple(b.label for b in self.blocks for _ in b.lengths)

    @property
    def priors(self) -> tuple:
        """Each row's calibration channel, by its prior's name."""
        return tuple(b.prior.name for b in self.blocks for _ in b.lengths)

    def beams(self) -> mx.array:
        """Every row, PAD-padded to the longest: ``[R, depth]``."""
        depth = max(self.lengths)
        return mx.concatenate(
            [mx.pad(b.tokens, [(0, 0), (0, depth - b.tokens.shape[1])], constant_values=PAD) for b in self.blocks]
        )

    def scores(self) -> mx.array:
        """``[R, depth]`` every node's raw score (tree auto): a block's own, else its rows' host scores."""
        depth, parts = max(self.lengths), []
        for b in self.blocks:
            if b.scores is not None:
                s = b.scores
            else:
                host = list(b.host_scores or [0.0] * len(b.lengths))
                s = mx.broadcast_to(mx.array(host, mx.float32)[:, None], b.tokens.shape)
            parts.append(mx.pad(s, [(0, 0), (0, depth - s.shape[1])]))
        return mx.concatenate(parts)

    def host_scores(self) -> List[float]:
        """Per node (row-major over the rows' lengths): the host's score, NaN where it is on the device."""
        out = []
        for b in self.blocks:
            known = b.host_scores if b.scores is None or b.host is not None else None
            for r, n in enumerate(b.lengths):
                s = float("nan") if known is None else (known[min(r, len(known) - 1)] if known else 0.0)
                out += [s] * n
        return out

    def host_rows(self) -> List[List[int]]:
        """Every row on the host (each block must hold them: ``Rows.host``)."""
        return [list(r[:n]) for b in self.blocks for r, n in zip(b.host, b.lengths)]


@dataclass
class Built:
    """The tree a step verifies and what acceptance walks over it (lazy)."""

    tree: Tree
    beams: mx.array  # [R, L] the rows acceptance walks (PAD: not verified)
    node_index: mx.array  # [R, L] each row token's node in the tree (0: none)
    size: int  # tokens verified, g0 included
    chain: bool  # a single path: the model's own causal call verifies it
    labels: tuple = ()  # each row's label
    walk: Optional[object] = None  # sampling: each node's parent in the merged tree (a function, lazily)
    codes: Optional[mx.array] = None  # tree auto: the chosen nodes' codes (they ride in the step's read)
    structure: Optional[object] = None  # tree auto: the candidates' Structure (to learn from the codes)
    host: tuple = ()  # tree auto, greedy: (rows, scores, prior name) of host blocks (learned from when left out)

    @property
    def depth(self) -> int:
        """The longest row (the read's layout: ``path`` has ``depth + 1`` entries)."""
        return self.beams.shape[1]

    def walk_tree(self) -> Tree:
        """The tree the sampling walk takes: each prefix once (a node's parent in the merged tree)."""
        t = self.tree
        return Tree(t.tokens, t.depth, self.walk(), self.node_index, t.mask)

    @classmethod
    def alone(cls, g0: mx.array, **kw) -> "Built":
        """``g0`` verified alone: a plain decoding step."""
        one = Tree(g0.reshape(1), mx.zeros((1,), mx.int32), None, None, mx.ones((1, 1), mx.bool_), levels=1)
        return cls(one, mx.zeros((1, 0), mx.int32), mx.zeros((1, 0), mx.int32), 1, True, **kw)


def build(cands: Candidates, g0: mx.array, auto=None, packed: bool = False, greedy: bool = True) -> Built:
    """The tree of a step's candidates (see the module doc): ``auto`` an
    :class:`~mlx_redrafter.step.auto.AutoTree` (tree auto), else every node,
    ``packed`` (every block on the host) or laid out."""
    if not cands.blocks:
        return Built.alone(g0)
    if auto is not None:
        return _chosen(cands, g0, auto, greedy)
    if packed:
        return _packed(cands, g0)
    beams, lay = cands.beams(), layout(cands.lengths)
    tree = lay.tree(beams, g0)
    return Built(
        tree, beams, lay.node_index, lay.size, len(lay.lengths) == 1, cands.labels, lambda: merged_parent(lay, beams)
    )


def _packed(cands: Candidates, g0: mx.array) -> Built:
    rows = cands.host_rows()
    n_nodes = count_rows(rows)
    if n_nodes == 0:
        return Built.alone(g0)
    # The depth is the longest row without its PAD end (a datastore row ends
    # where its sequence did), so that n_nodes == depth only for a single path.
    depth = max(next((j for j, t in enumerate(r) if t < 0), len(r)) for r in rows)
    beams = mx.array([r[:depth] + [PAD] * (depth - len(r[:depth])) for r in rows], mx.int32)
    tree = pack(beams, n_nodes, g0, padded=True)
    # A single path (W=1, or all rows alike) has the model's own causal positions and mask.
    return Built(tree, beams, tree.node_index, tree.size, n_nodes == depth, cands.labels, lambda: tree.parent)


def _chosen(cands: Candidates, g0: mx.array, auto, greedy: bool) -> Built:
    """tree auto: the bucket's best nodes, chosen on the device; the read ends with their codes."""
    lengths = cands.lengths
    structure, ancestors = auto.shape(lengths, cands.priors)
    size = auto.bucket(structure, cands.host_scores())
    host = _host_blocks(cands) if greedy else ()
    if size == 1:  # g0 alone; the host rows left out are still learned from
        return Built.alone(g0, structure=structure, host=host, codes=mx.zeros((0,), mx.int32))
    beams, lay = cands.beams(), layout(lengths)
    sel, chosen, index = auto.select(structure, ancestors, beams, lay, cands.scores(), size - 1, dedup=not greedy)
    tree = sel.tree(beams[lay.node_row, lay.node_pos], g0)
    tree.levels = beams.shape[1] + 1  # the candidates' depth bounds the selection's
    # One row of candidates: the selection is a prefix of it (parents first,
    # ties to the shallower), a single path the model's own causal call verifies.
    chain = size == 2 or len(lengths) == 1
    return Built(tree, chosen, index, size, chain, cands.labels, lambda: tree.parent, sel.codes, structure, host)


def _host_blocks(cands: Candidates) -> tuple:
    return tuple((b.host, list(b.host_scores or []), b.prior.name) for b in cands.blocks if b.host is not None)


def alone(logits: mx.array, sampling) -> Accepted:
    """Acceptance of ``g0`` verified alone: nothing drafted, the model's own next token."""
    zero = mx.zeros((1,), mx.int32)
    return Accepted(zero[0], zero[0], zero, zero[0], sample_first(logits[0], sampling))


def accept(built: Built, logits: mx.array, sampling) -> Accepted:
    """The longest path of ``built`` the model agrees with (lazy)."""
    if built.size == 1:
        return alone(logits, sampling)
    if sampling.greedy:
        return accept_greedy(built.beams, built.node_index, logits)
    return accept_sampling(built.beams, built.walk_tree(), logits, sampling)


def channels_of(priors: Sequence[Prior]) -> List[Prior]:
    """The distinct priors (by name), in order."""
    seen = {}
    for p in priors:
        seen.setdefault(p.name, p)
    return list(seen.values())
