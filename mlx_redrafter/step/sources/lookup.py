"""Lookup as a source: rows copied from the context, the tokens after the
latest earlier occurrence of the longest suffix of the history
(draft/lookup.py).

Read, then build: the host proposes from every token read. Built ahead:
one lookup row (the default) is proposed on the device from a history that
each queued step extends with its accepted tokens
(:class:`~mlx_redrafter.draft.lookup.DeviceLookup`), so it is as fresh as
when the step is read first; whether a step verifies it at all is decided
on the host from the tokens read so far (a row costs its tokens' compute
even when it matches nothing). More rows come from the host, lined up with
the step in flight (:class:`~mlx_redrafter.step.source.HostProposer`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from ...config import LOOKUP_LENGTH
from ...draft.lookup import DeviceLookup, Lookup
from ..source import TOKENS, HostProposer, Prior, Rows, Setting, Source, rates

# Scores: the matched suffix length (1, 2, 3, 4, 5+). A longer match is more
# often right, and once a copy has started it tends to go on (acceptance past
# depth 1, given the parent, is higher). Priors only: the online calibration
# replaces them with what the run accepts.
_Q = rates([0.12, 0.3, 0.45, 0.55, 0.6], [0.4, 0.55, 0.65, 0.7, 0.75])
LABELS = ("lookup",)
PRIOR = Prior("lookup", (1.5, 2.5, 3.5, 4.5), _Q, _Q.mean(axis=1, keepdims=True) * [1.0, 0.5, 0.4, 0.3])


@dataclass(frozen=True, eq=False)
class LookupSource(Source):
    """Up to ``count`` rows of ``length`` tokens copied from the context."""

    count: int = 1
    length: int = LOOKUP_LENGTH

    name = "lookup"
    needs = TOKENS
    prior = PRIOR

    @property
    def rows(self) -> int:
        return self.count

    def check(self, model) -> None:
        from ...errors import RedrafterError

        if self.count < 0 or self.length < 1:
            raise RedrafterError(
                f"lookup must be at least 0 beams of at least 1 token (got {self.count} of {self.length}).",
                "Use lookup=True (one lookup beam) or lookup=False.",
            )

    def open(self, setting: Setting) -> "LookupProposer":
        return LookupProposer(self, setting)


class LookupProposer(HostProposer):
    label, prior, copies = "lookup", PRIOR, True
    shadow = True  # its rows come from the history alone: step/shadow.py asks for them when it sits out

    def __init__(self, source: LookupSource, setting: Setting):
        self.s = source
        self.index = Lookup(setting.history)
        # Built ahead, one row (the default) is proposed on the device from the freshest history.
        self.fresh = DeviceLookup(setting.history) if setting.ahead and source.count == 1 else None

    def rows_after(self, at, extra: int):
        rows = self.index.propose(self.s.length + extra, self.s.count)
        return rows, list(self.index.matched)

    def guess(self) -> List[List[int]]:
        """The rows it would propose after the history read so far (step/shadow.py)."""
        return self.index.propose(self.s.length, self.s.count)

    def propose(self, at) -> Optional[Rows]:
        fresh, flight = self.fresh, at.flight
        if fresh is None:
            return super().propose(at)
        fresh.append(flight.row, flight.n, flight.g0, flight.depth + 1)  # every queued step extends it
        rows, scores = self.rows_after(at, flight.depth + 1)
        if not rows:
            return None
        length = self.s.length
        block = fresh.propose(length)[None]
        matched = mx.broadcast_to(fresh.matched.reshape(1, 1), block.shape).astype(mx.float32)
        return Rows(
            block, (length,), self.label, self.prior, scores=matched, host_scores=scores[:1], host=rows[:1], copies=True
        )

    def emitted(self, tokens: List[int]) -> None:
        self.index.extend(tokens)
        if self.fresh is not None:  # every appended step is read: the device length is known
            self.fresh.settle(len(self.index.history))


def from_request(draft) -> List[Source]:
    return [LookupSource(operator.index(draft.lookup), draft.lookup_length)] if draft.lookup else []
