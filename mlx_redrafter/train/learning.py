"""A drafter's own learning curve, and how much more data it says a drafter needs.

The points are the trainer's held-out evaluations (``train_log.jsonl``):
depth-1 accuracy (the share of first drafts right, teacher-forced) against
the positions seen by then (steps x batch). Within the first pass nearly
every position seen is new, so positions seen stand for positions of data.
The fit is ``accuracy = a + b * ln(positions)``: the shape of the
data-scaling curve in bench/RESULTS.md section 12, straight on a log scale
over four doublings. Least squares over the points past the learning
rate's warm-up and past the first 20% of training: the steep start of
optimisation says nothing about data (a run too short to have such points
says so instead of extrapolating).

To turn a speed-up into an accuracy, a step's cost is held fixed and the
tokens it adds beyond one are taken to grow with the first-draft accuracy:
``tokens/step - 1 = beta * accuracy``, with ``beta`` from this verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

MIN_POINTS = 3


def learning_points(log_path, batch_size: int) -> List[Tuple[int, float]]:
    """``(positions seen, held-out depth-1 accuracy)`` of every evaluation in a training log."""
    points = []
    path = Path(log_path)
    if not path.is_file():
        return points
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("eval_acc") and rec.get("step"):
            points.append((int(rec["step"]) * batch_size, float(rec["eval_acc"][0])))
    return sorted(dict(points).items())


def fit_points(points: List[Tuple[int, float]], warmup: int = 0) -> List[Tuple[int, float]]:
    """The points the fit uses: past ``warmup`` positions and the first 20% of training."""
    cut = max(warmup, points[-1][0] * 0.2) if points else 0
    return [(p, a) for p, a in points if p > cut]


def fit_log(points: List[Tuple[int, float]], warmup: int = 0) -> Optional[Tuple[float, float]]:
    """``(a, b)`` of ``accuracy = a + b ln(positions)`` over :func:`fit_points`,
    or None with fewer than :data:`MIN_POINTS` of them."""
    used = fit_points(points, warmup)
    if len(used) < MIN_POINTS:
        return None
    xs = [math.log(p) for p, _ in used]
    ys = [a for _, a in used]
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx_) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx_, b


def curve_words(a: float, b: float, used: List[Tuple[int, float]]) -> str:
    """The fitted curve as a reader takes it: the accuracy it gives at the
    first and last positions fitted, the change per doubling of the data,
    then the fit itself (its intercept is the accuracy at one position, an
    extrapolation that may lie outside 0-1)."""
    (first, _), (last, _) = used[0], used[-1]
    at = lambda p: a + b * math.log(p)
    sign = "-" if b < 0 else "+"
    return (
        f"held-out first-draft accuracy {at(first):.3f} at {first:,} positions, {at(last):.3f} at {last:,}: "
        f"{b * math.log(2):+.3f} per doubling of the data; fit over {len(used)} evaluations: "
        f"{a:.3f} {sign} {abs(b):.4f} ln(positions)"
    )


@dataclass
class Need:
    """What the curve says about a drafter that did not pay."""

    message: str
    accuracy: Optional[float] = None  # the depth-1 accuracy it would take
    positions: Optional[float] = None  # distilled positions it would take (in all)
    more_minutes: Optional[float] = None  # more budget for that, at this run's rates

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def data_needed(
    points,
    accuracy: float,
    tokens_per_step: float,
    speedup: float,
    target: float,
    data_positions: int,
    seconds_per_position: float,
    warmup: int = 0,
) -> Need:
    """How many distilled positions the drafter would need to beat ``target``
    (a speed-up), from its learning curve (:func:`fit_log`; ``warmup``: the
    positions seen in the learning rate's warm-up), and the budget that takes
    at ``seconds_per_position`` (distilling and training one)."""
    fit = fit_log(points, warmup)
    if fit is None:
        used = len(fit_points(points, warmup))
        return Need(
            f"its learning curve has {used} held-out evaluation(s) past the warm-up, too few to "
            f"extrapolate (it takes {MIN_POINTS}): a larger budget trains longer and tells more"
        )
    a, b = fit
    shape = curve_words(a, b, fit_points(points, warmup))
    if b <= 0:
        trend = "falls" if b < 0 else "is flat"
        return Need(f"its learning curve {trend} ({shape}): more data alone is not predicted to make it pay")
    if tokens_per_step <= 1 or accuracy <= 0 or speedup <= 0:
        return Need(
            f"its drafts were not accepted in the verdict ({tokens_per_step:.2f} tokens/step), so its learning "
            f"curve ({shape}) cannot say how much more data would pay"
        )
    cost = tokens_per_step / speedup  # one step in plain steps
    want = (target * cost - 1) / ((tokens_per_step - 1) / accuracy)
    if want >= 1:
        return Need(
            f"it would need a first-draft accuracy of {want:.2f} or more ({shape}): "
            "more data alone cannot make it pay at this step cost",
            want,
        )
    if want <= accuracy:
        return Need(
            f"its accuracy ({accuracy:.3f}) is already what the step cost calls for ({want:.3f}), "
            "so more data is not what it lacks: the verify cost on this device is",
            want,
        )
    seen = points[-1][0]
    needed = math.exp((want - a) / b)
    total = data_positions * max(needed / max(seen, 1), 1.0)
    more = max(total - data_positions, 0.0) * seconds_per_position / 60
    return Need(
        f"its learning curve ({shape}) reaches the {want:.3f} it needs at about {needed:,.0f} positions: "
        f"about {total:,.0f} distilled positions in all, {total - data_positions:,.0f} more "
        f"(about {more:.0f} more minutes at this run's rates)",
        want,
        total,
        more,
    )
