"""Training-free drafts from the token history: n-gram lookup.

Small models repeat themselves, and many tasks copy from the prompt
(summaries, edits, RAG answers). The proposer keeps the host-side history
(prompt + emitted tokens) and an index from every n-gram (``n_min`` to
``n_max`` tokens) to the position right after its latest occurrence. A
proposal takes the longest suffix of the history seen before and copies the
tokens that followed it. Each new token updates ``n_max - n_min + 1`` index
entries, so the cost per step does not grow with the context.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from ..config import PAD

# Measured offline on the default model's greedy replies (MT-Bench, Spec-Bench
# summarization): suffixes of 3 then 2 tokens, the latest occurrence, 4 tokens
# (LOOKUP_LENGTH, in config.py beside the other draft defaults).
# A 1-token suffix matches nearly always and is mostly wrong: it doubles the
# tree for little. A most-frequent continuation or a second lookup beam
# accepted no more. Lookup beams may be longer than the drafter's.
N_MAX, N_MIN = 3, 2


class Lookup:
    """An incremental n-gram proposer over a growing token history.

    ``propose(L, k)`` returns up to ``k`` drafts of ``L`` tokens: the tokens
    after the latest earlier occurrence of the longest suffix of the history
    (``n_max`` down to ``n_min`` tokens), then, for ``k > 1``, the
    continuations of shorter suffixes that differ from those already taken.
    A continuation that runs into the end of the history repeats itself (the
    history ``x a b a b`` with suffix ``a b`` continues ``a b a b ...``), so
    every draft has exactly ``L`` tokens.
    """

    def __init__(self, tokens: Iterable[int] = (), n_max: int = N_MAX, n_min: int = N_MIN):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max (got {n_min}, {n_max})")
        self.n_min, self.n_max = n_min, n_max
        self.history: List[int] = []
        # n -> {n-gram: index of the token that followed its latest occurrence}
        self.index: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the history and index the n-grams they complete."""
        h = self.history
        for t in tokens:
            # The n-grams ending at the current last token get a continuation: t.
            end = len(h)
            for n in self.index:
                if end >= n:
                    self.index[n][tuple(h[end - n : end])] = end
            h.append(int(t))

    def match(self, n: int) -> int:
        """Start of the continuation of the length-``n`` suffix, or -1 if unseen."""
        if len(self.history) < n:
            return -1
        return self.index[n].get(tuple(self.history[-n:]), -1)

    def continuation(self, start: int, length: int) -> List[int]:
        """``length`` tokens from ``history[start]``, repeating past the end."""
        h, out = self.history, []
        for i in range(start, start + length):
            out.append(h[i] if i < len(h) else out[i - len(h)])
        return out

    def propose(self, length: int, k: int = 1) -> List[List[int]]:
        """Up to ``k`` distinct drafts of ``length`` tokens, longest match first.

        ``self.matched`` then holds each draft's matched suffix length (the
        score the cost-aware tree selection calibrates)."""
        drafts: List[List[int]] = []
        self.matched: List[int] = []
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(drafts) >= k:
                break
            start = self.match(n)
            if start < 0:
                continue
            draft = self.continuation(start, length)
            if draft not in drafts:
                drafts.append(draft)
                self.matched.append(n)
        return drafts


class DeviceLookup:
    """:class:`Lookup`'s first draft (``k = 1``), computed on the device.

    The pipelined loop appends each step's accepted tokens while that step
    is still in flight, so the next step's lookup draft continues the
    freshest history without a sync. The history lives in a buffer whose
    length is a device scalar; the host only tracks an upper bound, to grow
    the buffer (in ``GROW``-token chunks) before a write could pass its end.
    Every op has a static shape; the draft is ``PAD`` where nothing matches.
    """

    GROW = 512

    def __init__(self, tokens: Iterable[int], n_max: int = N_MAX, n_min: int = N_MIN):
        import mlx.core as mx

        tokens = [int(t) for t in tokens]
        self.n_max, self.n_min = n_max, n_min
        self.bound = len(tokens)  # host upper bound of the device length
        self.buf = mx.array(tokens + [0] * (self._capacity(self.bound) - len(tokens)), dtype=mx.int32)
        self.length = mx.array(len(tokens), dtype=mx.int32)

    def _capacity(self, need: int) -> int:
        return (need // self.GROW + 1) * self.GROW

    def append(self, row, n, last, room: int) -> None:
        """Append ``row[:n]`` then ``last`` (lazy; ``row [room - 1]``)."""
        import mlx.core as mx

        if self.bound + room > self.buf.shape[0]:
            extra = self._capacity(self.bound + room) - self.buf.shape[0]
            self.buf = mx.concatenate([self.buf, mx.zeros((extra,), mx.int32)])
        idx = mx.arange(room)
        tokens = mx.where(idx == n, last, mx.concatenate([row.astype(mx.int32), mx.zeros((1,), mx.int32)]))
        self.buf = mx.slice_update(self.buf, tokens, self.length.reshape(1), axes=(0,))
        self.length = self.length + n + 1
        self.bound += room

    def settle(self, exact: int) -> None:
        """The host has read every appended step: the device length is ``exact``."""
        self.bound = exact

    def propose(self, length: int):
        """``[length]``: the tokens after the latest earlier occurrence of the
        longest suffix (``n_max`` down to ``n_min``), repeating past the end
        of the history like :meth:`Lookup.continuation`; all ``PAD`` if none.
        ``self.matched`` is then the matched suffix length (a device scalar, 0 if none)."""
        import mlx.core as mx

        buf, size = self.buf, self.buf.shape[0]
        start = mx.array(-1, mx.int32)
        matched = mx.array(0, mx.int32)
        for n in range(self.n_max, self.n_min - 1, -1):
            suffix = mx.take(buf, mx.maximum(self.length - n + mx.arange(n), 0))
            windows = size - n + 1
            match = buf[:windows] == suffix[0]
            for k in range(1, n):
                match = match & (buf[k : windows + k] == suffix[k])
            pos = mx.arange(windows, dtype=mx.int32)
            # An occurrence counts once the token after it exists, before the suffix itself.
            ok = match & (pos + n <= self.length - 1) & (self.length >= n)
            found = mx.max(mx.where(ok, pos + n, -1))
            matched = mx.where((start < 0) & (found >= 0), n, matched)
            start = mx.where(start >= 0, start, found)
        self.matched = matched
        period = mx.maximum(self.length - start, 1)
        tokens = mx.take(buf, mx.maximum(start, 0) + mx.arange(length) % period)
        return mx.where(start >= 0, tokens, PAD)
