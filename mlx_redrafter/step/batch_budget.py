"""How many tokens a batch of rows verifies each step: the budget, priced whole.

Every row of a batch verifies its tree in the same forward, padded to the
widest (step/batch_verify.py), so what a step costs is set by the batch's
size and that width, not by each row's tree: :func:`batch_cost`. What a
step yields is each row's ``1 + sum p`` over the nodes it verifies, ``p``
being the probability that a node's whole path is accepted (the rule of
step/select.py), estimated from what the batch accepted so far by source
and depth (:class:`SourceRates`); the cost is measured live, the
verify-cost curve pricing what was not measured yet (:class:`BatchCost`).
:func:`choose_width` picks the width with
the most expected tokens per unit of cost, from 1 (the batch decodes
plainly: nothing pays) up; each row then keeps its best nodes that fit
(:func:`cut_rows`). A row whose drafts are worth less than the others'
verifies fewer or none of them; rows of one token are never slowed by a
wide neighbour beyond what the width was chosen to pay for.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .tree import PAD

# A source's acceptance rate at a depth before anything was seen: 1 hit in 2 trials.
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0
DECAY = 0.995  # each new observation of a (source, depth) weighs the older ones this much less


def batch_cost(curve, rows: int, width: int) -> float:
    """What one forward of ``rows`` rows of ``width`` tokens each costs, in
    plain single-row steps: the verify-cost curve at ``rows x width``
    tokens (step/curve.py; past its sizes its last slope continues). The one
    place a batch's step is priced: a live cost model replaces this."""
    return curve(rows * width)


COST_WEIGHT = 0.2  # each new step's seconds weigh this much in the average of its (rows, width)
# Each step also moves the other widths' measured seconds this much toward
# what its own seconds and the curve's shape say they cost, so that a width
# once timed slow (another process loading the CPU) is tried again later
# instead of never.
RELAX = 0.02


class BatchCost:
    """What a step of the batch costs, live (one sequence's steps have
    step/live_cost.py's model; a batch's cost depends on its rows as much as
    on its width, so it keeps its own): the measured seconds of steps
    of as many rows at that width (an exponential average); a width not
    measured yet is priced by :func:`batch_cost` scaled to the measured
    width nearest it (the curve's shape, this device's level), or by the
    curve alone before any step of that many rows. The curve is measured on
    one sequence; what a batch's forward costs is not, and a wrong guess is
    corrected by the first step at that width."""

    def __init__(self, curve):
        self.curve = curve
        self.seconds: Dict[Tuple[int, int], float] = {}

    def observe(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - COST_WEIGHT) * old + COST_WEIGHT * seconds
        here = batch_cost(self.curve, rows, width)
        for (r, w), s in self.seconds.items():
            if r == rows and w != width:
                shaped = seconds * batch_cost(self.curve, rows, w) / here
                self.seconds[(r, w)] = (1 - RELAX) * s + RELAX * shaped

    def __call__(self, rows: int, width: int) -> float:
        known = self.seconds.get((rows, width))
        if known is not None:
            return known
        measured = [(w, s) for (r, w), s in self.seconds.items() if r == rows]
        if not measured:
            return batch_cost(self.curve, rows, width)
        w, s = min(measured, key=lambda m: (abs(m[0] - width), m[0]))
        return s * batch_cost(self.curve, rows, width) / batch_cost(self.curve, rows, w)


class SourceRates:
    """Per ``(source, depth)``: how often a verified node whose parent was
    accepted is accepted itself (decayed counts behind a prior)."""

    def __init__(self):
        self.hits: Dict[Tuple[str, int], float] = {}
        self.trials: Dict[Tuple[str, int], float] = {}

    def q(self, source: str, depth: int) -> float:
        key = (source, depth)
        return (self.hits.get(key, 0.0) + PRIOR_HITS) / (self.trials.get(key, 0.0) + PRIOR_TRIALS)

    def observe(self, rows: Sequence[Sequence[int]], sources: Sequence[str], accepted: Sequence[int]) -> None:
        """Learn from a step that verified ``rows`` (PAD-padded, ``sources[r]``
        each) and accepted the drafts ``accepted``."""
        accepted = list(accepted)
        for prefix, source in unique_prefixes(rows, sources):
            depth = len(prefix)
            if list(prefix[:-1]) != accepted[: depth - 1]:
                continue  # its parent was rejected: the node was never on trial
            key = (source, depth)
            self.trials[key] = DECAY * self.trials.get(key, 0.0) + 1.0
            self.hits[key] = DECAY * self.hits.get(key, 0.0) + float(list(prefix) == accepted[:depth])


def unique_prefixes(rows: Sequence[Sequence[int]], sources: Sequence[str]) -> List[Tuple[tuple, str]]:
    """Each node of ``rows`` once (a prefix shared by rows is one node, the
    first row's), depth-major: ``(prefix, source)``."""
    seen, out = set(), []
    length = max((len(r) for r in rows), default=0)
    for j in range(length):
        for row, source in zip(rows, sources):
            if j >= len(row) or any(t < 0 for t in row[: j + 1]):
                continue
            prefix = tuple(row[: j + 1])
            if prefix not in seen:
                seen.add(prefix)
                out.append((prefix, source))
    return out


def ranked_nodes(rows, sources, rates: SourceRates) -> List[Tuple[tuple, float]]:
    """A row's nodes, best first: ``(prefix, p)`` with ``p`` the product of
    its source's rates down its path. ``q <= 1`` makes every node's ``p``
    at most its parent's, so each prefix of this order is a tree (the
    argument of step/select.py)."""
    p_of: Dict[tuple, float] = {}
    ranked = []
    for i, (prefix, source) in enumerate(unique_prefixes(rows, sources)):
        p = p_of.get(prefix[:-1], 1.0) * rates.q(source, len(prefix))
        p_of[prefix] = p
        ranked.append((-p, len(prefix), i, prefix))
    return [(prefix, -neg) for neg, _, _, prefix in sorted(ranked)]


def choose_width(ranked: Sequence[Sequence[Tuple[tuple, float]]], cost) -> int:
    """The batch's tree width (tokens a row, its next token included) with
    the most expected tokens per unit of ``cost(rows, width)`` (a
    :class:`BatchCost`; a verify-cost curve prices by :func:`batch_cost`):
    1 is plain batched decoding."""
    if not isinstance(cost, BatchCost):
        cost = BatchCost(cost)
    rows = len(ranked)
    if not rows:
        return 1
    widest = 1 + max(len(r) for r in ranked)
    sums = []
    for r in ranked:
        total, acc = [0.0], 0.0
        for _, p in r:
            acc += p
            total.append(acc)
        sums.append(total)
    best, best_value = 1, rows / cost(rows, 1)
    for width in range(2, widest + 1):
        value = sum(1.0 + s[min(width - 1, len(s) - 1)] for s in sums) / cost(rows, width)
        if value > best_value:
            best, best_value = width, value
    return best


def cut_rows(rows: Sequence[Sequence[int]], keep: set) -> List[List[int]]:
    """``rows`` cut to the nodes in ``keep`` (a set of prefixes), PAD after."""
    out = []
    for row in rows:
        n = 0
        while n < len(row) and row[n] >= 0 and tuple(row[: n + 1]) in keep:
            n += 1
        out.append(list(row[:n]) + [PAD] * (len(row) - n))
    return out
