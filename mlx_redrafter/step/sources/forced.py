"""The grammar's forced tokens as a source: under a grammar (step/grammar.py)
the tokens it forces after the step's root (a JSON key's closing quote and
colon, say) join the tree as one more row, so structured output drafts
even where no other source does. It needs the grammar's state after the
host has read the step, so it proposes in the read-then-build schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..source import TOKENS, HostProposer, Setting, Source
from .host import prior_for

FORCED_LENGTH = 8  # at most this many grammar-forced tokens join the tree as a row
PRIOR = prior_for("grammar")


@dataclass(frozen=True, eq=False)
class ForcedSource(Source):
    """The row of tokens ``matcher`` forces (a :class:`~mlx_redrafter.step.grammar.Matcher` after the root)."""

    matcher: object

    name = "grammar"
    needs = TOKENS
    length = FORCED_LENGTH
    prior = PRIOR

    @property
    def ahead(self) -> bool:
        return False

    def open(self, setting: Setting) -> "_Forced":
        return _Forced(self)


class _Forced(HostProposer):
    label, prior = "grammar", PRIOR

    def __init__(self, source: ForcedSource):
        self.matcher = source.matcher

    def rows_after(self, at, extra: int):
        forced = self.matcher.forced_tokens()[:FORCED_LENGTH]
        return ([forced], [0.0]) if forced else None
