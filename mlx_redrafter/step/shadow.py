"""What a host source would have drafted at the steps it sat out.

A copy source's rows (lookup: step/sources/lookup.py) come from the host's
own history, so at every step the governor can ask what they would have
been and, once the next tokens are read, how many of them the model would
have accepted: at greedy exactly the common prefix with what it emitted; at
a temperature the same in distribution (a deterministic row's token is
accepted with the probability the model samples it). An arm made of such
sources alone (lookup without a costly head) then has its yield measured at
every step, not only at its probes: a copy stretch late in a chat shows at
once, and its rate (step/governor.py) is that yield over the time its own
steps take.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .governor import Arm


def _common(row: Sequence[int], after: Sequence[int]) -> int:
    k = 0
    for a, b in zip(row, after):
        if a != b:
            break
        k += 1
    return k


class Shadow:
    """The rows of the proposers that can guess (``shadow = True``) at each
    step, checked against the tokens that follow; :meth:`emitted` gives each
    resolved step's ``(arm, tokens it would have emitted)`` for the ``arms``
    made of those sources alone."""

    def __init__(self, names: Sequence[str], proposers: Sequence, arms: Sequence[Arm]):
        self.guessers = {n: p for n, p in zip(names, proposers) if getattr(p, "shadow", False)}
        self.arms = [a for a in arms if a and a <= set(self.guessers)]
        self.pending: List[Tuple[int, Dict[str, List[List[int]]]]] = []  # (where, each source's rows)

    def emitted(self, history: Sequence[int]) -> List[Tuple[Arm, int]]:
        """The history grew (a step was read): the guesses it settles, then
        a guess for the step that starts here."""
        if not self.arms:
            return []
        out, waiting = [], []
        for where, rows in self.pending:
            after = history[where:]
            matched, open_ = {}, False
            for name, rs in rows.items():
                ks = [_common(r, after) for r in rs]
                open_ |= any(k == len(after) < len(r) for k, r in zip(ks, rs))  # may match further
                matched[name] = max(ks, default=0)
            if open_:
                waiting.append((where, rows))
                continue
            out += [(arm, 1 + max(matched[n] for n in arm)) for arm in self.arms]
        self.pending = waiting + [(len(history), {n: p.guess() for n, p in self.guessers.items()})]
        return out


__all__ = ["Shadow"]
