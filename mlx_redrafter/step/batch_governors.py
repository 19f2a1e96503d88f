"""Where a batch's governor for a number of rows starts (step/batched.py).

A batch keeps one :class:`~mlx_redrafter.step.governor.Governor` per number
of rows (a forward of 4 rows costs otherwise than one of 3). A new one
starts from the nearest number of rows measured, else from what requests
decoding alone learned on this model, device and sources (step/keep.py:
earlier requests, chat turns and runs): its rates scaled by the rows and by
what the verify-cost curve says a batch of them costs. So a draft model
that did not pay alone is not measured again from scratch in the batch
(each of its arms' first steps costs several plain ones), and rows that
come and go do not measure every arm again at each count.
"""

from __future__ import annotations

from typing import Dict, Sequence

from .batch_budget import batch_cost
from .governor import FAR, PLAIN, Governor
from .keep import live_key, opened


def new_governor(model, names: Sequence[str], costly: Sequence[str], governors: Dict[int, Governor], curve, n: int):
    """The governor of ``n`` rows: seeded from ``governors`` (by number of
    rows) at the nearest count measured, else from the arms far behind plain
    decoding in the state kept for a request alone (none kept: from nothing)."""
    gov = Governor(names, costly=costly)
    known = [m for m, g in governors.items() if any(r.samples for r in g.rates.values())]
    if known:
        m = min(known, key=lambda m: (abs(m - n), -m))
        gov.seeded(governors[m], n / m, batch_cost(curve, n, 1) / batch_cost(curve, m, 1))
        return gov
    state = (opened(live_key(model, names)) or {}).get("governor")
    if state:
        gov.seeded(
            _far_arms(Governor(names, costly=costly), state), n, batch_cost(curve, n, 1) / batch_cost(curve, 1, 1)
        )
        if gov.rates[gov.best].samples:
            # The plan's arm was far behind alone: plain decoding runs first, so that
            # the arm is not left "from the start" (which would cut its kept wait short).
            gov.best = PLAIN
    return gov


def _far_arms(alone: Governor, state: dict) -> Governor:
    """``alone`` restored from a request alone's ``state``, with only its arms
    far behind plain decoding there (:data:`~mlx_redrafter.step.governor.FAR`)
    kept: an arm that lost that much to plain decoding alone (a draft model,
    a rejected MTP head) loses in a batch too, where its forward runs for
    every row. The others are measured in the batch itself: a batch's
    economics differ (drafting that paid alone may not, step/batch_budget.py),
    and what paid alone paid on that request's text."""
    alone.restore(state)
    plain = alone.rates[PLAIN].per_second if alone.rates[PLAIN].samples else 0.0
    for arm, rate in alone.rates.items():
        if arm == PLAIN or rate.per_second >= FAR * plain:
            rate.samples = 0  # not carried (Governor.seeded skips it)
    return alone
