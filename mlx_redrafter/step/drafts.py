"""One generation's proposers: every source of its plan, opened (step/source.py).

:class:`Drafts` asks them for a step's rows in the plan's order, tells them
what the host read and what entered the target's cache, and closes them.
The fused backbone returns every source's taps (:func:`fused_layers`) and
each source reads its own columns of it (:func:`columns`).

Read, then build (step/loop.py, and every row of a batch, step/batched.py):
the sources that propose from the device (``DEVICE``) do so *early*, right
after a step's acceptance and before its read, and the read brings what
they need (:meth:`Drafts.early_reads`: a controller's depth; their rows too
when the tree needs every row on the host); the others propose after the
read (:meth:`Drafts.late`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

from .build import Candidates
from .source import DEVICE, STATES, TOKENS, At, Rows, Setting


def fused_layers(sources) -> List[int]:
    """The target layers the backbone must also return: every source's taps, in order."""
    layers: List[int] = []
    for s in sources:
        layers += [t for t in (s.taps or ()) if t not in layers]
    return layers


def source_names(sources) -> List[str]:
    """Each source's name, a repeated one numbered (``name#2``): the governor's arms are sets of them."""
    out: List[str] = []
    for s in sources:
        name, k = s.name, 1
        while name in out:
            k += 1
            name = f"{s.name}#{k}"
        out.append(name)
    return out


def costly_names(names: Sequence[str], sources) -> List[str]:
    """The names (:func:`source_names`) of the sources with a forward of their
    own (not host tokens alone): the governor's arms leave each of them out."""
    return [n for n, s in zip(names, sources) if s.needs != TOKENS]


def columns(layers: Sequence[int], wanted: Sequence[int], width: int, last: bool):
    """Indices into the fused backbone output ``[taps of layers..., final]``
    of the ``wanted`` taps (then the final state, with ``last``), or None when
    that is the whole vector."""
    if list(wanted) == list(layers) and last:
        return None
    idx = [layers.index(t) for t in wanted] + ([len(layers)] if last else [])
    return mx.array([i * width + j for i in idx for j in range(width)], mx.int32)


def _picker(cols):
    return (lambda h: h) if cols is None else (lambda h: mx.take(h, cols, axis=-1))


class Drafts:
    """The proposers of ``sources`` for one generation (or one row of a batch)."""

    def __init__(self, sources, model, embed, width: int, history: List[int], auto: bool, greedy: bool, ahead: bool):
        self.sources, self.history = list(sources), history
        layers = fused_layers(self.sources)
        self.proposers, self.pickers = [], []
        for s in self.sources:
            pick = _picker(columns(layers, list(s.taps or ()), width, s.last))
            self.proposers.append(s.open(Setting(model, embed, pick, history, auto, greedy, ahead)))
            self.pickers.append(pick)
        self.early = [s.needs == DEVICE for s in self.sources]  # read, then build: proposed before the read
        self.stateful = any(s.needs == STATES for s in self.sources)
        self.pending: List[Optional[Rows]] = [None] * len(self.sources)  # the early rows, not read yet
        self.on: Optional[List[bool]] = None  # the governor's choice: which proposers propose (None: all)

    def propose(self, at: At, which=None) -> List[Optional[Rows]]:
        """Each proposer's rows (None where it proposes none), in plan order;
        ``which[i]`` False, or the governor's ``on[i]`` False, skips proposer
        ``i`` (its entry stays None; a source with a cache catches up when it
        next proposes)."""
        out = []
        for i, p in enumerate(self.proposers):
            asked = (which is None or which[i]) and (self.on is None or self.on[i])
            rows = p.propose(at) if asked else None
            if rows is not None:
                at.proposed.append(rows)
            out.append(rows)
        return out

    def reads(self) -> int:
        """Host reads the proposers made beyond the step's one read."""
        return sum(p.reads for p in self.proposers)

    def emitted(self, tokens: List[int]) -> None:
        """The host read these tokens: the history and the proposers grow by them."""
        self.history += tokens
        for p in self.proposers:
            p.emitted(tokens)

    def entered(self, tokens: List[int], hidden: mx.array) -> None:
        """``tokens`` entered the target's cache, ``hidden [len, F]`` its fused states there."""
        for s, p, pick in zip(self.sources, self.proposers, self.pickers):
            if s.needs == STATES:
                p.entered(tokens, pick(hidden))

    def close(self) -> None:
        for p in self.proposers:
            p.close()

    # ------------------------------------------------------------------ read, then build

    def early_reads(self, g0: mx.array, context: mx.array, host: bool) -> List[mx.array]:
        """The early sources' rows after ``g0`` (lazy); what the step's read
        must bring of them (``host``: their tokens too)."""
        self.pending = self.propose(At(g0, context, self.history), self.early)
        out = []
        for b in self.pending:
            if b is None:
                continue
            if b.pending is not None:
                out.append(b.pending.reshape(-1).astype(mx.int32))
            if host:
                out.append(b.tokens.reshape(-1).astype(mx.int32))
        return out

    def late(self, vals: List[int], host: bool, g0=None, context=None, g0_value: Optional[int] = None) -> Candidates:
        """The step's candidates once read: the early rows settled from
        ``vals`` (:meth:`early_reads`' values, in order), then the other
        sources' rows after ``g0_value``."""
        early, i = [], 0
        for b in self.pending:
            if b is None:
                early.append(None)
                continue
            if b.pending is not None:
                k = b.pending.size
                settled = b.settle(vals[i : i + k])
                i += k
            else:
                settled = b
            if host:
                settled.host = b.split(vals[i : i + b.tokens.size], settled.lengths)
                i += b.tokens.size
            early.append(settled)
        at = At(g0, context, self.history, g0_value=g0_value, proposed=[b for b in early if b is not None])
        late = self.propose(at, [not e for e in self.early])
        joined = [e if e is not None else lt for e, lt in zip(early, late)]
        return Candidates([b for b in joined if b is not None])
