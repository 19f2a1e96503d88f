"""Drafts from the model's own earlier words: a suffix datastore.

The store holds whole token sequences (a model's past replies, a built
corpus). :meth:`Datastore.match` finds the longest suffix of the current
history (up to ``depth`` tokens) that occurs in the store followed by at
least one token of the same sequence, and returns the most frequent
continuations after it, with their counts.

The index is a suffix array built *backwards*: every position ``p`` of one
int32 buffer (sequences separated by ``SEP``) is sorted by the tokens
``buf[p], buf[p-1], ..., buf[p-depth+1]``. The positions whose backward
key starts with the history's last ``j`` tokens are then one contiguous
range, so one pass from the newest history token backwards narrows the range
one token at a time and stops at the longest match: no search per match
length. The range's positions are the occurrences; their continuations are
``buf[p+1 : p+1+L]``, cut at the next ``SEP`` so that none crosses into
another sequence. The sort is prefix doubling (``log2(depth)`` rounds of
``np.unique``) and runs lazily, on the first match after a change.

Memory is bounded (oldest sequences go first past ``max_tokens``); a store
is saved atomically in a versioned file keyed by the model's identity (see
:mod:`.file`) and opened lazily.
"""

from __future__ import annotations

import hashlib
import json
import logging
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ...config import PAD
from ...errors import RedrafterError
from ...files import cache_root
from ...profiles import model_id
from .file import read_store, write_store

log = logging.getLogger(__name__)

SEP = -1  # between sequences in the index buffer: no token id is negative
DEPTH = 16  # longest suffix the index matches
MAX_TOKENS = 1 << 20  # default bound: 4 MiB of tokens, ~12 MiB with the index
# The descent bisects a large range of occurrences one token at a time
# (without gathering it) and finishes a small one in one vectorised gather.
GATHER = 2048
# Continuations are counted over the latest SCAN occurrences of a match: a
# short match can occur thousands of times, and counting them all would cost
# milliseconds (recent text is the better guide anyway).
SCAN = 512
FEW = 16  # up to this many occurrences are counted in Python, more with numpy
# A 1-token match in a large store is nearly always there and mostly wrong
# (as for context lookup, lookup.py): proposals need 2 tokens by default.
MIN_MATCH = 2


@dataclass
class Match:
    """The longest suffix of a history found in a store, and what followed it.

    ``continuations``: ``(tokens, count)`` pairs, most frequent first (ties:
    the most recently added occurrence first); ``tokens`` has up to the
    asked length, fewer where its sequence ended; counts are over the latest
    ``scan`` occurrences (:meth:`Datastore.match`). ``occurrences``: how many
    times the matched suffix occurs in all.
    """

    length: int
    occurrences: int
    continuations: List[Tuple[Tuple[int, ...], int]]


NO_MATCH = Match(0, 0, [])


class _Index:
    """The backward suffix array over a fixed list of sequences."""

    def __init__(self, sequences: Sequence[np.ndarray], depth: int):
        parts = [np.full(1, SEP, np.int32)]
        for s in sequences:
            parts += [s, parts[0]]
        self.buf = np.concatenate(parts)
        self.order = _backward_suffix_array(self.buf, depth)
        self.first = self.buf[self.order]  # sorted: the first column, for searchsorted
        # Plain memoryviews index ~10x faster than numpy scalars in bisect's key.
        self._buf_mv, self._order_mv = memoryview(self.buf), memoryview(self.order)

    def descend(self, history: Sequence[int], max_match: int) -> Tuple[int, int, int]:
        """``(m, lo, hi)``: the longest match ``m`` and its occurrences ``order[lo:hi]``."""
        rev = np.asarray(history[-max_match:], dtype=np.int32)[::-1]  # newest token first
        first = rev[:1]  # an int32 needle: a Python int would cast the column to int64 first
        lo, hi = int(self.first.searchsorted(first, "left")[0]), int(self.first.searchsorted(first, "right")[0])
        if lo == hi:
            return 0, 0, 0
        j = 1
        while j < len(rev) and hi - lo > GATHER:
            a, b = self._bisect(lo, hi, j, int(rev[j]))
            if a == b:
                return j, lo, hi
            lo, hi, j = a, b, j + 1
        return self._finish(lo, hi, j, rev) if j < len(rev) else (j, lo, hi)

    def _bisect(self, lo: int, hi: int, j: int, t: int) -> Tuple[int, int]:
        """The subrange of ``[lo, hi)`` whose ``j``-th backward token is ``t``.

        Within the range the first ``j`` backward tokens are equal (and no
        ``SEP``), so column ``j`` is sorted and ``order[i] - j >= 0``."""
        buf, order = self._buf_mv, self._order_mv

        def key(i):
            return buf[order[i] - j]

        span = range(lo, hi)
        return lo + bisect_left(span, t, key=key), lo + bisect_right(span, t, key=key)

    def _finish(self, lo: int, hi: int, j: int, rev: np.ndarray) -> Tuple[int, int, int]:
        """The rest of the descent over a small range at once: how far each
        occurrence's backward tokens from ``j`` on agree with ``rev``. The
        rows that agree longest are contiguous (the range is sorted)."""
        ends = self.order[lo:hi]
        # Clamped before the buffer's start: buf[0] is SEP, which matches nothing.
        cols = self.buf[np.maximum(ends[:, None] - np.arange(j, len(rev)), 0)]
        eq = cols == rev[None, j:]
        run = np.where(eq.all(axis=1), len(rev) - j, eq.argmin(axis=1))
        rows = np.flatnonzero(run == run.max())
        return j + int(run.max()), lo + int(rows[0]), lo + int(rows[-1]) + 1

    def continuations(self, lo: int, hi: int, length: int, k: int, scan: int):
        """The ``k`` most frequent continuations of ``length`` tokens after the
        ``scan`` latest occurrences in ``order[lo:hi]``."""
        ends = self.order[lo:hi]
        if len(ends) > scan:
            ends = np.partition(ends, len(ends) - scan)[-scan:]
        idx = np.minimum(ends[:, None] + 1 + np.arange(length), len(self.buf) - 1)
        rows = self.buf[idx]
        if len(ends) <= FEW:
            return _rank_few(ends.tolist(), rows.tolist(), k)
        rows[np.cumsum(rows == SEP, axis=1) > 0] = SEP  # stop at the sequence's end
        # Sort by (row, end): equal rows form runs, each run's last end is its
        # latest occurrence (4x faster than np.unique(axis=0) here).
        o = np.lexsort((ends, *rows.T[::-1]))
        rows, ends = rows[o], ends[o]
        last = np.flatnonzero(np.append((rows[1:] != rows[:-1]).any(axis=1), True))
        counts = np.diff(last, prepend=-1)
        best = np.lexsort((-ends[last], -counts))[:k]
        return [(tuple(int(x) for x in rows[last[i]] if x != SEP), int(counts[i])) for i in best]


def _rank_few(ends: List[int], rows: List[List[int]], k: int):
    """:meth:`_Index.continuations` for a few occurrences, in plain Python
    (a long match mostly occurs once or twice; numpy's per-call overhead
    would dominate)."""
    stats = {}
    for end, row in zip(ends, rows):
        key = tuple(row[: row.index(SEP)] if SEP in row else row)
        count, latest = stats.get(key, (0, -1))
        stats[key] = (count + 1, max(latest, end))
    ranked = sorted(stats.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:k]
    return [(tokens, count) for tokens, (count, _) in ranked]


def _backward_suffix_array(buf: np.ndarray, depth: int) -> np.ndarray:
    """Positions of ``buf`` that end a token followed by another token of the
    same sequence, sorted by their backward keys of ``depth`` tokens (ties:
    position order). Prefix doubling: ``rank`` ranks the backward key of
    ``k`` tokens; the key of ``2k`` is ``(rank[p], rank[p - k])``."""
    n = len(buf)
    _, rank = np.unique(buf, return_inverse=True)  # SEP ranks lowest (0)
    rank = rank.reshape(-1).astype(np.int64)
    k = 1
    while k < depth:
        before = np.zeros_like(rank)  # SEP's rank before the start
        before[k:] = rank[: max(n - k, 0)]
        _, rank = np.unique(rank * (n + 1) + before, return_inverse=True)
        rank = rank.reshape(-1).astype(np.int64)
        k *= 2
    ends = np.flatnonzero((buf[:-1] != SEP) & (buf[1:] != SEP))
    return ends[np.argsort(rank[ends], kind="stable")].astype(np.int32)


class Datastore:
    """Token sequences with a suffix index, bounded to ``max_tokens``.

    ``add`` appends whole sequences (the oldest are evicted first once the
    store holds more than ``max_tokens``; a longer sequence keeps its last
    ``max_tokens`` tokens). ``model_id`` names the model whose token ids the
    sequences are (:func:`model_key`); a saved file is refused by a store
    of another model. ``depth`` is the longest suffix matched.
    """

    def __init__(self, max_tokens: int = MAX_TOKENS, model_id: str = "", depth: int = DEPTH):
        if max_tokens < 1 or depth < 1:
            raise RedrafterError(f"A datastore needs max_tokens >= 1 and depth >= 1 (got {max_tokens}, {depth}).")
        self.max_tokens, self.model_id, self.depth = int(max_tokens), str(model_id), int(depth)
        self._seqs: deque = deque()
        self._tokens = 0
        self._index: Optional[_Index] = None
        self.path: Optional[Path] = None  # the file it was opened from (save's default)
        self._unread = False  # opened lazily, file not read yet
        self._strict = True
        self.refused: Optional[str] = None  # why the file was refused (non-strict open)

    # -- opening and saving ----------------------------------------------

    @classmethod
    def open(cls, path, model_id: str, max_tokens: int = MAX_TOKENS, depth: int = DEPTH, strict: bool = True):
        """A store backed by ``path``, read on first use (a missing file is an
        empty store). A corrupt file, one of another format version or of
        another model raises :class:`RedrafterError` then; with
        ``strict=False`` it logs a warning and the store stays empty and
        refuses to be saved over the file (see :func:`load_or_empty`)."""
        store = cls(max_tokens, model_id, depth)
        store.path, store._unread, store._strict = Path(path), True, strict
        return store

    def _read(self) -> None:
        if not self._unread:
            return
        self._unread = False
        if not self.path.is_file():
            return
        try:
            sequences = read_store(self.path, self.model_id)
        except RedrafterError as e:
            if self._strict:
                raise
            self.refused = str(e)
            log.warning("Drafting without the datastore: %s", e)
            return
        for s in sequences:
            self._append(s)

    def save(self, path=None) -> Path:
        """Write the store to ``path`` (default: the file it was opened from), atomically."""
        self._read()
        path = Path(path) if path is not None else self.path
        if path is None:
            raise RedrafterError("This datastore has no file to save to.", "Pass a path: store.save(path).")
        if self.refused and path == self.path:
            raise RedrafterError(
                f"Not saving over {path}: it was refused when read ({self.refused.splitlines()[0]})",
                "Run `mlx-redrafter datastore clear` (or delete the file) to start a new store there.",
            )
        write_store(path, self.model_id, list(self._seqs))
        return path

    # -- contents ----------------------------------------------------------

    def add(self, tokens: Iterable[int]) -> None:
        """Append one whole sequence (a reply, a document); the index is rebuilt lazily."""
        self._read()
        self._append(tokens)

    def _append(self, tokens) -> None:
        seq = np.array(tokens if hasattr(tokens, "__len__") else list(tokens), dtype=np.int64).reshape(-1)
        if seq.size and (seq.min() < 0 or seq.max() > np.iinfo(np.int32).max):
            raise RedrafterError(f"Token ids must be in [0, 2**31) (got {seq.min()}..{seq.max()}).")
        if not seq.size:
            return
        seq = seq[-self.max_tokens :].astype(np.int32)
        self._seqs.append(seq)
        self._tokens += seq.size
        while self._tokens > self.max_tokens:
            self._tokens -= self._seqs.popleft().size
        self._index = None

    def clear(self) -> None:
        """Drop every sequence (and forget a refused file: saving starts it anew)."""
        self._unread, self.refused = False, None
        self._seqs.clear()
        self._tokens, self._index = 0, None

    def sequences(self) -> List[List[int]]:
        """The stored sequences, oldest first."""
        self._read()
        return [s.tolist() for s in self._seqs]

    @property
    def tokens(self) -> int:
        self._read()
        return self._tokens

    def __len__(self) -> int:
        """The number of stored sequences."""
        self._read()
        return len(self._seqs)

    # -- matching ----------------------------------------------------------

    def match(
        self,
        history: Sequence[int],
        max_match: int = DEPTH,
        max_continuations: int = 4,
        length: int = 4,
        scan: int = SCAN,
    ) -> Match:
        """The longest suffix of ``history`` (up to ``max_match`` tokens) that
        occurs in the store with a token after it, and its
        ``max_continuations`` most frequent continuations of up to ``length``
        tokens (:class:`Match`), counted over its ``scan`` most recently
        added occurrences; :data:`NO_MATCH` if none."""
        if not 1 <= max_match <= self.depth:
            raise RedrafterError(f"max_match must be in [1, {self.depth}] for this store (got {max_match}).")
        self._read()
        if not self._seqs or not len(history) or length < 1 or max_continuations < 1:
            return NO_MATCH
        if self._index is None:
            self._index = _Index(self._seqs, self.depth)
        m, lo, hi = self._index.descend(history, max_match)
        if m == 0:
            return NO_MATCH
        return Match(m, hi - lo, self._index.continuations(lo, hi, length, max_continuations, max(scan, 1)))


def load_or_empty(path, model_id: str, max_tokens: int = MAX_TOKENS) -> Datastore:
    """The store at ``path`` for generation: lazily read, and on a corrupt or
    foreign file a warning and an empty store, never an error."""
    return Datastore.open(path, model_id, max_tokens=max_tokens, strict=False)


# -- where stores live ---------------------------------------------------------

KINDS = ("history", "built", "corpus")


def model_key(model_spec) -> str:
    """The model identity a store is keyed by: as for tuned profiles, a local
    model folder in absolute form, other specs (``default``, Hub ids) as given."""
    return model_id(model_spec)


def default_path(model_spec, kind: str = "history") -> Path:
    """``cache_root()/datastore/<digest of the model key>/<kind>.bin``:
    ``history`` (what chat and serve generated), ``built`` (``datastore
    build``) or ``corpus`` (``datastore add``)."""
    if kind not in KINDS:
        raise RedrafterError(f"Unknown datastore kind {kind!r}.", f"Use one of {', '.join(KINDS)}.")
    digest = hashlib.sha256(json.dumps([model_key(model_spec)]).encode()).hexdigest()[:16]
    return cache_root() / "datastore" / digest / f"{kind}.bin"


# -- proposing -----------------------------------------------------------------


def propose(
    store: Datastore, history: Sequence[int], length: int, min_match: int = MIN_MATCH, max_match: int = DEPTH
) -> Tuple[np.ndarray, int, int]:
    """One draft row for a step: ``(tokens [length] int32, match length, count)``.

    ``tokens`` is the most frequent continuation of the longest matched
    suffix, ``PAD``-padded where its sequence ended; all ``PAD`` with
    ``(0, 0)`` when nothing of at least ``min_match`` tokens matches."""
    row = np.full(length, PAD, np.int32)
    m = store.match(history, max_match=min(max_match, store.depth), max_continuations=1, length=length)
    if m.length < min_match:
        return row, 0, 0
    tokens, count = m.continuations[0]
    row[: len(tokens)] = tokens
    return row, m.length, count


class StoreLookup:
    """Datastore drafts with :class:`~mlx_redrafter.draft.lookup.Lookup`'s interface.

    It keeps the last ``max_match`` tokens of the history (``extend``), and
    ``propose(L, k)`` returns up to ``k`` distinct drafts of exactly ``L``
    tokens (``PAD``-padded where a sequence ended): the most frequent
    continuations of the longest suffix matched in the store, so that it can
    stand in for (or beside) a ``Lookup`` (step/sources/datastore.py). ``last`` holds
    the latest proposal's match length and counts, for scoring and stats.
    """

    def __init__(
        self, store: Datastore, tokens: Iterable[int] = (), min_match: int = MIN_MATCH, max_match: int = DEPTH
    ):
        self.store, self.min_match = store, min_match
        self.max_match = min(max_match, store.depth)
        self.history: deque = deque(maxlen=self.max_match)
        self.last = NO_MATCH
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    def propose(self, length: int, k: int = 1) -> List[List[int]]:
        m = self.store.match(list(self.history), self.max_match, max_continuations=k, length=length)
        self.last = m if m.length >= self.min_match else NO_MATCH
        return [list(t) + [PAD] * (length - len(t)) for t, _ in self.last.continuations]
