"""The datastore as a source: one row from the model's past outputs, on steps
where no source before it copied from the context (draft/datastore/: the
suffix index, the stores a generation drafts from).

Its rows continue the host's tokens, so it proposes like lookup
(:class:`~mlx_redrafter.step.source.HostProposer`): from every token read,
or built ahead and lined up with the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ...config import LOOKUP_LENGTH
from ...draft.datastore.index import StoreLookup
from ..source import TOKENS, HostProposer, Prior, Setting, Source, rates

# Scores: the continuation's count (1, 2-3, 4-7, 8-15, 16+). Around 30% for a
# first token: a guess that no measurement in this repository backs yet; the
# online calibration replaces it with what the run accepts.
_Q = rates([0.2, 0.25, 0.3, 0.35, 0.4], [0.4, 0.45, 0.5, 0.55, 0.6])
LABELS = ("datastore",)
PRIOR = Prior("datastore", (1.5, 3.5, 7.5, 15.5), _Q, _Q.mean(axis=1, keepdims=True) * [1.0, 0.5, 0.4, 0.3])


@dataclass(frozen=True, eq=False)
class DatastoreSource(Source):
    """One row of ``length`` tokens from ``store`` (a ``Datastore`` or ``Stores``)."""

    store: object
    length: int = LOOKUP_LENGTH

    name = "datastore"
    needs = TOKENS
    prior = PRIOR

    def open(self, setting: Setting) -> "_Store":
        return _Store(self, setting)


class _Store(HostProposer):
    label, prior = "datastore", PRIOR

    def __init__(self, source: DatastoreSource, setting: Setting):
        self.s = source
        self.index = StoreLookup(source.store, setting.history)

    def rows_after(self, at, extra: int):
        if any(r.copies for r in at.proposed):  # the context had a copy: none from the store
            return None
        rows = self.index.propose(self.s.length + extra, 1)
        if not rows:
            return None
        store = self.index.store
        store.proposed = getattr(store, "proposed", 0) + 1  # the session's datastore counts
        # A row keeps its PAD end (where its sequence ended): verified, never
        # accepted, and the row's length is the one asked for.
        return rows, [count for _, count in self.index.last.continuations[:1]]

    def emitted(self, tokens: List[int]) -> None:
        self.index.extend(tokens)


def from_request(draft) -> List[Source]:
    return [] if draft.datastore is None else [DatastoreSource(draft.datastore, draft.lookup_length)]
