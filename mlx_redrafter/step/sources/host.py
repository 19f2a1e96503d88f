"""A user's own source: any object with a ``name`` and ``propose(tokens)``.

    class MySource:
        name = "mine"                    # its label in the stats, /metrics and the chat's colours
        def propose(self, tokens):       # the prompt and every token emitted so far
            return [[...], [...]]        # draft rows: lists of token ids, any number, any lengths

    stream_generate(model, tokenizer, prompt, sources=[MySource()])

Its rows join the other sources' in the one tree and are verified like
them: the output is the model's own (greedy: token for token; sampling: in
distribution; a row is a deterministic proposal, as lookup's are). Built
ahead (the default schedule), ``tokens`` ends before the step in flight's
tokens and the rows are lined up with what that step emits
(:class:`~mlx_redrafter.step.source.HostProposer`): a row verifies its
tokens after those, so a longer row drafts further. An optional
``score(row)`` (a float, higher is likelier) sorts a row into tree auto's
calibration buckets; without it every row scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from ...errors import RedrafterError
from ..source import TOKENS, HostProposer, Prior, Setting, Source, rates

MAX_LENGTH = 16  # tokens of a row verified at most (a tree past 16 tokens costs more than it can add)
MAX_ROWS = 8  # rows a source proposes at most per step (the first ones are kept)

# Scores: the user's own (``score(row)``, else 0), bucketed at 0.5, 1.5, 2.5,
# 3.5. A neutral prior (a third of first tokens, half of later ones, given
# their parent) that the online calibration replaces with what the run accepts.
_Q = rates([0.3] * 5, [0.5] * 5)
PRIOR_EDGES = (0.5, 1.5, 2.5, 3.5)


def prior_for(name: str) -> Prior:
    return Prior(name, PRIOR_EDGES, _Q, np.repeat(_Q[:, :1], 4, axis=1) * [1.0, 0.5, 0.4, 0.3])


def check_source(obj) -> None:
    """Refuse an object that is not a source, naming what it lacks."""
    missing = [a for a in ("name", "propose") if not hasattr(obj, a)]
    if missing or not callable(getattr(obj, "propose", None)) or not isinstance(obj.name, str) or not obj.name:
        raise RedrafterError(
            f"sources= takes objects with a name and a propose(tokens) method; {type(obj).__name__} "
            f"lacks {', '.join(missing) or 'a non-empty string name and a callable propose'}.",
            "Give it `name = 'mine'` and `def propose(self, tokens): return [[...], ...]` (lists of token ids).",
        )


@dataclass(frozen=True, eq=False)
class HostSource(Source):
    """A user's object with ``name`` and ``propose(tokens)`` (see the module doc)."""

    obj: object

    needs = TOKENS
    rows = MAX_ROWS
    length = MAX_LENGTH

    @property
    def name(self) -> str:
        return self.obj.name

    @property
    def prior(self) -> Prior:
        return prior_for(self.name)

    def check(self, model) -> None:
        check_source(self.obj)

    def open(self, setting: Setting) -> "_User":
        return _User(self, setting)


class _User(HostProposer):
    def __init__(self, source: HostSource, setting: Setting):
        self.obj, self.label, self.prior = source.obj, source.name, source.prior
        self.vocab = setting.embed.weight.shape[0] if hasattr(setting.embed, "weight") else None
        self.score = getattr(source.obj, "score", None)

    def rows_after(self, at, extra: int):
        rows = self.obj.propose(list(at.history))
        kept = []
        for row in list(rows or [])[:MAX_ROWS]:
            row = list(map(int, row))[: MAX_LENGTH + extra]
            if any(t < 0 or (self.vocab is not None and t >= self.vocab) for t in row):
                raise RedrafterError(
                    f"Source {self.label!r} proposed a token id outside the model's vocabulary: {row}.",
                    "Propose token ids of the model's tokenizer (tokenizer.encode(text)).",
                )
            if row and row not in kept:
                kept.append(row)
        scores = [self.score(r) if self.score is not None else 0.0 for r in kept]
        return kept, scores


def from_request(draft) -> List[Source]:
    return [HostSource(obj) for obj in (getattr(draft, "sources", None) or ())]
