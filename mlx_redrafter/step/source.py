"""What every draft source implements: one protocol for the ReDrafter
drafter, lookup, the datastore, MTP and EAGLE-3 heads, draft models, the
grammar's forced tokens and a user's own ``propose(tokens)``.

A :class:`Source` is frozen: the plan (step/plan.py) holds it and a
generation may reuse it. It says

* ``name``: its rows' label in the step stats, ``/metrics`` and the chat's colours;
* ``needs``: what its rows come from (:data:`DEVICE`: the target's hidden
  state and the next token, on the device; :data:`TOKENS`: the tokens the
  host has read; :data:`STATES`: the hidden states of the accepted tokens,
  which it catches up on, in a cache of its own);
* ``rows`` and ``length``: the most rows, and the longest row, it proposes in a step;
* ``prior``: its rows' channel in tree auto's calibration (step/select.py);
* ``taps``: the target layers it reads (and ``last``: the final hidden state);
* ``ahead``: whether it can propose before the step in flight is read
  (the build-ahead schedule, step/loop.py).

:meth:`Source.open` gives the generation's :class:`Proposer`, which
proposes a step's :class:`Rows` from :class:`At` (where the step starts),
hears what the host read (``emitted``) and what entered the target's cache
(``entered``), and may keep a cache beside the target's (``make_cache``).

Nothing here reads the device: the step's one read (step/protocol.py)
brings what a source needs (:attr:`Rows.pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..config import PAD

DEVICE, TOKENS, STATES = "device", "tokens", "states"
DEPTHS = 8  # calibration depths; deeper nodes share the last
N_BUCKETS = 5  # score buckets of a node (four edges)
RANKS = 4  # sibling ranks the host's estimates tell apart (beam 0, 1, 2, the rest)


@dataclass(frozen=True, eq=False)
class Prior:
    """A calibration channel: how a source's node scores bucket, and the prior
    acceptance rates q (given the parent) per depth and bucket, and per depth
    and sibling rank (the host's estimates)."""

    name: str
    edges: Tuple[float, ...]  # N_BUCKETS - 1 score edges: a score >= edge moves one bucket up
    q: np.ndarray  # [DEPTHS, N_BUCKETS]
    slots: np.ndarray  # [DEPTHS, RANKS]


def rates(first: Sequence[float], deeper: Sequence[float]) -> np.ndarray:
    """``[DEPTHS, n]``: ``first`` at depth 1, ``deeper`` at every depth after it."""
    out = np.empty((DEPTHS, len(first)), np.float32)
    out[0], out[1:] = first, deeper
    return out


@dataclass
class Rows:
    """One source's rows for a step (lazy on the device, shapes on the host).

    ``tokens [R, L]``: PAD past each row's ``lengths[r]``. ``scores [R, L]``:
    each node's raw score for tree auto (None: every node scores the row's
    ``host_scores``, or 0). ``host_scores``: each row's score where the host
    knows it (NaN: on the device). ``host``: the rows as the host proposed
    them (None: the device did; built ahead, each first repeats what the
    step in flight emits).
    ``pending``: device ints the host must read before the rows can be
    used (``settle`` then makes the usable rows from them).
    """

    tokens: mx.array
    lengths: Tuple[int, ...]
    label: str = ""
    prior: Optional[Prior] = None
    scores: Optional[mx.array] = None
    host_scores: Optional[Sequence[float]] = None
    host: Optional[List[List[int]]] = None
    copies: bool = False  # copied from the context (the datastore stands in where no copy is found)
    pending: Optional[mx.array] = None
    settle: Optional[Callable[[List[int]], "Rows"]] = None

    def split(self, flat: List[int], lengths: Optional[Sequence[int]] = None) -> List[List[int]]:
        """Its rows on the host from ``flat``, its ``tokens`` as read (row by
        row, ``[R, L]``): each row's first ``lengths[r]`` (default: its own lengths)."""
        width = self.tokens.shape[1]
        return [flat[r * width : r * width + n] for r, n in enumerate(self.lengths if lengths is None else lengths)]

    @classmethod
    def of_host(cls, rows: List[List[int]], scores: Sequence[float], **kw) -> "Rows":
        """Rows the host proposed (lists of token ids of any lengths)."""
        depth = max(len(r) for r in rows)
        tokens = mx.array([r + [PAD] * (depth - len(r)) for r in rows], mx.int32)
        return cls(tokens, tuple(len(r) for r in rows), host_scores=list(scores), host=rows, **kw)


@dataclass
class Flight:
    """The step in flight when the next one is built ahead (all lazy): it
    emits ``row[:n]`` then ``g0``; ``depth`` is ``row``'s length."""

    row: mx.array
    n: mx.array
    g0: mx.array
    depth: int


@dataclass
class At:
    """Where a step's rows start: what a proposer proposes from."""

    g0: mx.array  # the LLM's next token, the tree's root (device scalar)
    context: mx.array  # the target's hidden state where g0 was predicted, every tap fused [F]
    history: List[int]  # the tokens the host has read: earlier turns, the prompt, the reply so far
    g0_value: Optional[int] = None  # g0 on the host (read, then build), else None
    flight: Optional[Flight] = None  # built ahead: the step in flight, not read yet
    proposed: List[Rows] = field(default_factory=list)  # rows earlier sources proposed for this step


@dataclass
class Setting:
    """What a proposer is opened with, for one generation."""

    model: object
    embed: object
    features: Callable[[mx.array], mx.array]  # this source's columns of the target's fused hidden states
    history: List[int]
    auto: bool  # tree auto: rows carry their nodes' scores
    greedy: bool
    ahead: bool  # the build-ahead schedule


class Proposer:
    """One generation's side of a source (the defaults do nothing)."""

    reads = 0  # host reads the last propose() made beyond the step's one read

    def propose(self, at: At) -> Optional[Rows]:
        return None

    def emitted(self, tokens: List[int]) -> None:
        """The host read these tokens (in order, after the ones read before)."""

    def entered(self, tokens: List[int], features: Optional[mx.array]) -> None:
        """``tokens`` entered the target's cache, ``features [len, F]`` this
        source's columns of the target's hidden states there."""

    make_cache = None  # a function making the caches it keeps beside the target's (None: it keeps none)

    def attach(self, caches: list) -> None:
        """Its caches, as the prompt cache holds them after the target's (made by ``make_cache``)."""

    def close(self) -> None:
        """The generation ends (between two steps)."""


def line_up(proposals: mx.array, row: mx.array, n: mx.array, g0: mx.array, length: int) -> mx.array:
    """Rows the host proposed one step late, lined up with the step in flight.

    ``proposals [K, P]`` continue the tokens the host has read; the step in
    flight emits ``row[:n]`` then ``g0``. A proposal that starts with those
    tokens yields its next ``length`` tokens; one that does not is all
    ``PAD`` (never accepted). ``length`` is at most ``P - len(row) - 1``.
    """
    d = row.shape[0]
    idx = mx.arange(d + 1)
    emitted = mx.where(idx == n, g0, mx.concatenate([row, mx.zeros((1,), row.dtype)]))
    same = (proposals[:, : d + 1] == emitted[None]) | (idx > n)[None]
    rest = mx.take(proposals, n + 1 + mx.arange(length), axis=1)
    return mx.where(same.all(axis=1, keepdims=True), rest, PAD)


class HostProposer(Proposer):
    """A proposer whose rows continue the tokens the host has read (lookup,
    the datastore, a user's source). Read, then build: its rows as they are.
    Built ahead: the step in flight is not read yet, so it proposes rows
    longer by what that step may emit (``extra`` tokens), and they are lined
    up with it on the device (:func:`line_up`); a row that does not line up
    is padding, never accepted. A row of ``P`` tokens verifies its last
    ``P - extra`` (all of it when the step in flight accepts every draft)."""

    label, prior, copies = "host", None, False
    shadow = False  # True: guess() gives its rows from the history alone, at no cost (step/shadow.py)

    def rows_after(self, at: At, extra: int) -> Optional[Tuple[List[List[int]], List[float]]]:
        """``(rows, scores)`` continuing ``at.history`` (lists of token ids; a
        score per row, its calibration score), ``extra`` tokens longer; None: none."""
        return None

    def propose(self, at: At) -> Optional[Rows]:
        flight = at.flight
        extra = 0 if flight is None else flight.depth + 1
        found = self.rows_after(at, extra)
        if not found or not found[0]:
            return None
        rows, scores = found
        kw = dict(label=self.label, prior=self.prior, copies=self.copies)
        if flight is None:
            return Rows.of_host(rows, scores, **kw)
        kept = [(r, s) for r, s in zip(rows, scores) if len(r) > extra]
        if not kept:
            return None
        rows, scores = [r for r, _ in kept], [s for _, s in kept]
        width = max(len(r) for r in rows)
        padded = mx.array([r + [PAD] * (width - len(r)) for r in rows], mx.int32)
        tokens = line_up(padded, flight.row, flight.n, flight.g0, width - extra)
        return Rows(tokens, tuple(len(r) - extra for r in rows), host_scores=scores, host=rows, **kw)


class Source:
    """A draft source as a plan holds it (see the module doc). Subclasses
    are frozen dataclasses and override what differs."""

    name = "source"
    needs = TOKENS
    prior: Optional[Prior] = None
    taps: Optional[Tuple[int, ...]] = None
    last = True  # reads the target's final hidden state (with ``taps``, after them)
    beams = False  # rows of one beam search: they share prefixes (packing them saves nodes)
    controller = None  # an adaptive-depth controller deciding this source's depth
    takes_controller = False  # whether a controller may decide its depth
    rows = 1  # the most rows it proposes in a step
    length = 1  # the longest of them

    @property
    def ahead(self) -> bool:
        """Whether it can propose while the step before is in flight (build ahead)."""
        return self.needs != STATES and self.controller is None

    def check(self, model) -> None:
        """Refuse a shape or a model this source cannot draft for (a :class:`RedrafterError`)."""

    def open(self, setting: Setting) -> Proposer:
        raise NotImplementedError
