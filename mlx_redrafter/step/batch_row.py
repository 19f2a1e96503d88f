"""One row of a batch of draft trees (step/batched.py): how it decodes
(:class:`RowPlan`) and what it carries between two steps (:class:`BatchRow`:
its sources, its grammar's matcher, its next token and its next tree's rows).

A row's sources with caches of their own (an MTP or EAGLE-3 head, a draft
model, a DFlash drafter) are the row's alone: their caches are made when it
joins (:meth:`BatchRow.open_caches`), they catch up on what each step put in
the row's cache (:meth:`BatchRow.entered`), and they draft after the step's
read, on the device; :func:`propose_rows` reads every row's such rows in one
read, the step's second."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from ..config import SamplingConfig
from ..llm.cache import split_sources
from .build import Candidates
from .drafts import Drafts
from .protocol import StepRead, host_read
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
        self.caches: list = []  # its stateful sources' caches (a prompt cache keeps them after the model's)

    def next_key(self):
        """A fresh key for this step's draws (None: the row draws from the global state)."""
        if self.plan.key is None:
            return None
        self.plan.key, sub = mx.random.split(self.plan.key)
        return sub

    def open_caches(self, kept: list = ()) -> list:
        """Its stateful sources' own caches (the batch's cache holds the model's
        alone): ``kept``, the caches a row alone or an earlier turn left after
        the model's (a prompt cache's, holding what the model's hold), when they
        are these sources' and can be trimmed with the model's; else new ones.
        Returns the kept ones taken (flat)."""
        keepers = [p for p in (self.drafts.proposers if self.drafts is not None else ()) if p.make_cache is not None]
        fresh = [p.make_cache() for p in keepers]
        taken = split_sources(kept, fresh) if can_trim_prompt_cache(kept) else None
        for p, caches in zip(keepers, taken or fresh):
            p.attach(caches)
        self.caches = [c for caches in taken or fresh for c in caches]
        return self.caches if taken else []

    @property
    def carried(self) -> list:
        """Its sources' caches as the row leaves, to keep after the model's
        (none when they cannot be trimmed with them: a hybrid draft model's state)."""
        return self.caches if can_trim_prompt_cache(self.caches) else []

    @property
    def stateful(self) -> bool:
        """Whether it has sources with caches of their own (they hear what each step put in the row's cache)."""
        return self.drafts is not None and self.drafts.stateful

    def entered(self, hidden: mx.array, read: StepRead) -> None:
        """A step put its root and accepted drafts in the row's cache (the row
        is :attr:`stateful`): ``hidden [width, F]`` is the row's fused states
        over its tree, ``read`` the step's read."""
        path = mx.array(read.path[: read.n + 1], mx.int32)
        self.drafts.entered([self.g0] + read.row[: read.n], hidden[path])

    def propose(self, vals: List[int], emitted: List[int]) -> Optional[Candidates]:
        """The next tree's candidates (rows drafted on the device after the
        read still lazy), from the early sources' values just read and the tokens just emitted."""
        if self.drafts is None:
            return None
        self.drafts.emitted(emitted)
        return self.drafts.late(vals, True, g0_value=self.g0)

    def take(self, cands: Optional[Candidates]) -> None:
        """The next tree's rows: ``cands``' (every row on the host), then a grammar's forced row."""
        self.rows, self.sources = [], []
        if cands is not None and cands.blocks:
            rows = cands.host_rows()
            depth = max(len(r) for r in rows)
            self.rows, self.sources = [r + [PAD] * (depth - len(r)) for r in rows], list(cands.labels)
        if self.matcher is not None and self.plan.drafts and not self.matcher.is_done():
            forced = self.matcher.forced_tokens()[:FORCED_LENGTH]
            if forced:
                self.rows.append(forced)
                self.sources.append(GRAMMAR)


def propose_rows(rows: Sequence[BatchRow], reads: Sequence[StepRead]) -> int:
    """Every row's next tree (:meth:`BatchRow.take`) after a step's read:
    the rows its sources drafted on the device after the read (a stateful
    source's), all rows' at once, come to the host in one read. Returns the
    reads made (0 or 1)."""
    cands = [row.propose(read.rest, read.emitted) for row, read in zip(rows, reads)]
    late = [b for c in cands if c is not None for b in c.blocks if b.host is None]
    if late:
        vals, at = host_read(*[b.tokens for b in late]), 0
        for b in late:
            b.host = b.split(vals[at : at + b.tokens.size])
            at += b.tokens.size
    for row, c in zip(rows, cands):
        row.take(c)
    return int(bool(late))
