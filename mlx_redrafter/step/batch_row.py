"""One row of a batch of draft trees (step/batched.py): how it decodes
(:class:`RowPlan`) and what it carries between two steps (:class:`BatchRow`:
its sources, its grammar's matcher, its next token and its next tree's rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx

from ..config import SamplingConfig
from .drafts import Drafts
from .sources.forced import FORCED_LENGTH
from .tree import PAD

GRAMMAR = "grammar"  # the label of a grammar's forced row


@dataclass
class RowPlan:
    """How one row decodes: its ``sampling``, its own random ``key``
    (sampling rows; None: the global random state), its ``grammar``,
    whether it ``drafts``, and for a row that does not, an optional
    ``sampler(logprobs [1, V]) -> [1]`` (mlx-lm's sampler contract)."""

    sampling: SamplingConfig
    key: Optional[mx.array] = None
    grammar: object = None
    drafts: bool = True
    sampler: Optional[Callable] = None


class BatchRow:
    """A row of :class:`BatchSteps`: its plan, drafts and next token."""

    def __init__(self, plan: RowPlan, drafts: Optional[Drafts], matcher):
        self.plan, self.drafts, self.matcher = plan, drafts, matcher
        self.g0 = 0  # the next token (the root of the next tree), on the host
        self.rows: List[List[int]] = []  # the next tree's rows (PAD-padded), host
        self.sources: List[str] = []
        self.steps = 0
        self.saved_key = None  # its key before a step queued ahead drew from it

    def next_key(self):
        """A fresh key for this step's draws (None: the row draws from the global state)."""
        if self.plan.key is None:
            return None
        self.plan.key, sub = mx.random.split(self.plan.key)
        return sub

    def take(self, vals: List[int], emitted: List[int]) -> None:
        """The next tree's rows, from the early sources' values just read and the tokens just emitted."""
        self.rows, self.sources = [], []
        if self.drafts is not None:
            self.drafts.emitted(emitted)
            cands = self.drafts.late(vals, True, g0_value=self.g0)
            if cands.blocks:
                rows = cands.host_rows()
                depth = max(len(r) for r in rows)
                self.rows, self.sources = [r + [PAD] * (depth - len(r)) for r in rows], list(cands.labels)
        if self.matcher is not None and self.plan.drafts and not self.matcher.is_done():
            forced = self.matcher.forced_tokens()[:FORCED_LENGTH]
            if forced:
                self.rows.append(forced)
                self.sources.append(GRAMMAR)
