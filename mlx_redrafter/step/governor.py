"""Whether a step drafts, and with which sources: the rule that keeps
generation from ever being slower than plain decoding.

A generation's sources can run in several ways, its **arms**: every source
(the plan as asked), none (plain decoding), and every source but a costly
one (a forward of its own: the ReDrafter head, an MTP or EAGLE-3 head, a
draft model), so that lookup can draft without an MTP head that does not
pay. The :class:`Governor` measures each arm's throughput live, tokens per second over this run's own steps, and runs
the best one; plain decoding is one of them. Nothing is assumed about the
machine, the model or the source: a draft model that does not pay, an MTP
head whose drafts are rejected, a host twice as slow, a long context, all
show in what the steps measure.

* **Start**: the plan's arm runs first, then every other arm is tried for
  :data:`PROBE_STEPS` steps (an arm's first step of a run is not measured,
  nor its last where the loop chose the next arm before that step was timed:
  their time mixes two arms' work), plain decoding first.
* **Then**: each step runs the arm with the best rate (the one running keeps
  its place unless another beats it by :data:`HYSTERESIS`, the one asked
  for by :data:`PLAN_EDGE` more, and by one standard error of its rate more,
  up to :data:`DOUBT` of it, while that rate is unsure: a draft's yield comes
  in stretches, and a few steps of a hard one must not park it).
* **Probes**: an arm left out cannot show that it pays again (a copy task
  late in a chat makes lookup pay), so after :data:`PROBE_AFTER` steps out
  it runs for up to :data:`PROBE_STEPS` steps (fewer once its steps tell
  it apart from the best, :data:`SURE`ly, and its own steps agree: a text
  that turned shows in them before it moves the earlier probes'); each probe doubles its next wait (up to
  :data:`MAX_WAIT`; an arm far behind, :data:`FAR`, waits four times longer),
  and once chosen on its merits its wait starts over. Ollama's MLX runner
  and oMLX park speculation the same way.
* **A budget for probing**: what a probe cost over what the best arm would
  have emitted in its time (its every step, a source catching up included)
  must be at most :data:`EXPLORE` of the time until the next one, so an arm
  whose steps cost three plain ones (an MTP head whose drafts are rejected,
  a draft model) waits hundreds of steps, one near a tie a few dozen. The
  wait spans generations: the steps out of a far arm, of plain decoding and
  of an arm measured where it sits out carry over (a new text does not hide
  their rates), while a close arm is probed again soon.
* **Shadows**: an arm of host sources alone (lookup) is measured where it
  sits out too (:meth:`Governor.saw`, step/shadow.py: its rows from the
  history, checked against what the model emitted): its yield from every
  step, its time from its own.
* **Forgetting**: a measurement counts :data:`FORGET` times less each step
  after it, so a machine that slows down, or a context that grows, moves the
  rates within a few dozen steps (a parked arm's, at most :data:`PROBE_AFTER`
  steps' worth between two probes: they add up).

What was learned carries over (:meth:`Governor.to_dict`,
:meth:`Governor.restore`; step/keep.py keeps it per model, dtype, device and
plan): the next chat turn, server request or run starts with the arm that
won and its measurements, forgotten as the new steps come.

Each step's stats say what it ran (:func:`mode_of`), which the summaries,
``/stats`` and ``/metrics`` count (output.py ``Tally``). Everything here is
host numbers; nothing reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

Arm = FrozenSet[str]
PLAIN: Arm = frozenset()

PROBE_AFTER = 16  # steps an arm waits out before it is probed the first time
PROBE_STEPS = 6  # steps a probe runs (the middle four are measured)
MAX_WAIT = 512  # the longest wait between two probes of an arm
FORGET = 0.98  # weight of a measurement one step older: about the last 50 steps count
HYSTERESIS = 1.02  # another arm must beat the running one by this factor to replace it
# ... and the plan's own arm (every source asked for) by this one: a draft's
# rate swings with the text (a copy pays, prose may not), a plain step's
# hardly, so near a tie the few steps a probe measures favour plain decoding
# by chance more often than not; what the user asked for keeps a small edge.
PLAN_EDGE = 1.05
DOUBT = 0.1  # ... and by up to this share of its rate while its rate is unsure (see _rank)
# A probe ends early, or an arm is called far behind (probed less), only this
# sure: two unlucky drafting steps (1 token each) must not park an arm for long.
SURE = 2.0
# A pseudo-step's relative variance, so that a rate from a few alike steps is
# not taken for certain: a drafting step's tokens swing (1 to several), a plain
# step's time hardly.
DRAFT_SPREAD, PLAIN_SPREAD = 0.5, 0.01
PRIOR_STEPS = 3  # steps the pseudo-step's spread is worth
MIN_SAMPLES = 2  # measured steps before an arm's rate is trusted
# An arm below this share of the best's rate (even by its rate's upper bound)
# is far behind: its next wait is four times longer (not twice), and a new
# generation neither measures it first nor shortens its wait.
FAR = 0.8
# Probing spends at most this share of the time: a probe that lost t seconds
# against the best arm waits t / EXPLORE seconds (the best arm's steps) before the next.
EXPLORE = 0.02
LONGEST_WAIT = 4096  # ... up to this many steps
PROBE_COST_STEPS = 3  # the steps a probe takes at least (its first is not measured): what one costs
RESTORED_WAIT = PROBE_AFTER  # a new text: an arm out whose yield hangs on it (and not shadowed) is probed soon


def arm_name(arm: Arm) -> str:
    """``"plain"`` or the sources' names joined by ``+`` (sorted)."""
    return "+".join(sorted(arm)) or "plain"


def arms_of(names: Sequence[str], costly: Optional[Sequence[str]] = None) -> List[Arm]:
    """The arms worth trying: every source, plain decoding, and every source
    but one of the ``costly`` ones (a forward of their own: the ReDrafter
    head, a layer head, a draft model; default: all), with (three costly
    sources at most) the other sets of them. Host sources (lookup, the
    datastore) cost little when they find nothing, so they are not dropped alone."""
    full = frozenset(names)
    costly = list(names if costly is None else costly)
    out = [full, PLAIN] + [full - {c} for c in costly]
    if len(costly) <= 3:
        out += [full - set(p) for p in combinations(costly, 2)]
    seen: List[Arm] = []
    for a in out:
        if a not in seen:
            seen.append(a)
    return seen


@dataclass
class Rate:
    """One arm's measured steps, each forgotten by :data:`FORGET` per step:
    their tokens and seconds (the rate) and how much the rate may be off
    (a drafting step's tokens swing with the text, a plain step's never)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # the steps' summed weights
    weight2: float = 0.0  # ... and squared weights (how many steps the rate is worth: weight**2 / weight2)
    tt: float = 0.0  # weighted sums of tokens**2, tokens*seconds, seconds**2 (the spread)
    ts: float = 0.0
    ss: float = 0.0
    samples: int = 0  # measured steps (not forgotten)
    at: int = 0  # the step of the last measurement
    prior: float = DRAFT_SPREAD  # the pseudo-step's relative variance
    # Tokens its steps would have emitted where it sat out (step/shadow.py: lookup's rows checked
    # against what came next), and those steps, forgotten by FORGET per step: its yield is
    # then known from every step, its time per step from its own.
    seen: float = 0.0
    seen_steps: float = 0.0
    seen_at: int = 0

    def add(self, step: int, tokens: int, seconds: float) -> None:
        d = self.aged(step)
        self.tokens, self.seconds = self.tokens * d + tokens, self.seconds * d + seconds
        self.weight, self.weight2 = self.weight * d + 1.0, self.weight2 * d * d + 1.0
        self.tt, self.ts, self.ss = self.tt * d + tokens**2, self.ts * d + tokens * seconds, self.ss * d + seconds**2
        self.samples, self.at = self.samples + 1, step

    def aged(self, step: int) -> float:
        """What the measurements count at ``step``: :data:`FORGET` per step
        since the last, at most :data:`PROBE_AFTER` steps (an arm parked
        learns nothing: what its next probe measures adds to what the earlier
        ones did, so that a lead shows after a few probes)."""
        return FORGET ** min(max(step - self.at, 0), PROBE_AFTER)

    def kept(self, step: int, tokens: float = 1.0, seconds: float = 1.0) -> "Rate":
        """These measurements as they count at ``step`` (forgotten up to it),
        each step's tokens times ``tokens`` and seconds times ``seconds``:
        what carries to another governor (a later generation, another number
        of rows), whose steps count from 0."""
        d, k, t = self.aged(step), tokens, seconds
        s = FORGET ** max(step - self.seen_at, 0)
        return Rate(
            self.tokens * k * d,
            self.seconds * t * d,
            self.weight * d,
            self.weight2 * d * d,
            self.tt * k * k * d,
            self.ts * k * t * d,
            self.ss * t * t * d,
            self.samples,
            0,
            self.prior,
            self.seen * s * k,
            self.seen_steps * s,
        )

    def saw(self, step: int, tokens: int) -> None:
        """A step it sat out would have emitted ``tokens``."""
        d = FORGET ** max(step - self.seen_at, 0)
        self.seen, self.seen_steps, self.seen_at = self.seen * d + tokens, self.seen_steps * d + 1.0, step

    @property
    def per_second(self) -> float:
        """Tokens per step (its own steps' and those it would have had) over its seconds per step."""
        if self.seconds <= 0:
            return 0.0
        return (self.tokens + self.seen) / (self.weight + self.seen_steps) * self.weight / self.seconds

    @property
    def error(self) -> float:
        """The rate's standard error (tokens per second; the ratio estimator's):
        the steps' spread around the rate over how many steps it is worth,
        with a pseudo-step of spread ``prior`` so that a few alike steps are
        not taken for certain."""
        if self.weight <= 0 or self.seconds <= 0:
            return float("inf")
        r = self.per_second
        squares = max(self.tt - 2 * r * self.ts + r * r * self.ss, 0.0)  # of tokens - rate * seconds
        spread = squares * self.weight / self.tokens**2  # relative variance of one step
        spread = (spread * self.weight + self.prior * PRIOR_STEPS) / (self.weight + PRIOR_STEPS)
        return r * (spread * self.weight2 / self.weight**2) ** 0.5


def _rate(arm: Arm, *sums) -> Rate:
    return Rate(*sums, prior=DRAFT_SPREAD if arm else PLAIN_SPREAD)


@dataclass
class _Parked:
    wait: int = PROBE_AFTER  # steps out before the next probe
    out: int = 0  # steps out since the last probe


def mode_of(arm: Arm, probing: bool) -> str:
    """A governed step's ``StepStats.mode``: "probe" (measuring an arm),
    "draft" (its sources chosen on their merits) or "plain" (none paid)."""
    return "probe" if probing else ("draft" if arm else "plain")


class Governor:
    """Chooses each step's arm from measured rates (see the module doc).

    ``names``: the plan's sources (distinct names), ``costly`` those with a
    forward of their own (default: all); ``starts_plain``: plain
    decoding runs first (a stored curve says no draft pays). :meth:`choose` gives the
    next step's arm; :meth:`ran` tells what a step of an arm emitted and how
    long it took.
    """

    def __init__(self, names: Sequence[str], starts_plain: bool = False, costly: Optional[Sequence[str]] = None):
        self.names = tuple(names)
        self.arms = arms_of(self.names, costly)
        if starts_plain:  # a prior says no draft pays here: plain runs first, the others are measured after
            self.arms.insert(0, self.arms.pop(self.arms.index(PLAIN)))
        self.rates: Dict[Arm, Rate] = {a: _rate(a) for a in self.arms}
        self.parked: Dict[Arm, _Parked] = {a: _Parked() for a in self.arms}
        self.best: Arm = self.arms[0]
        self.plan: Arm = self.arms[0]  # the arm asked for (plain where a stored curve says no draft pays)
        self.step = 0
        self.probe: Optional[Arm] = None
        self.probe_left = 0
        self.probe_got = (0, 0.0)  # the tokens and seconds of the steps the running probe measured
        self.chosen: Optional[Arm] = None  # the arm the last choose() gave
        self.prev: Optional[Arm] = None  # the arm of the last step ran (a step of another is not measured)
        self.probed: Optional[Arm] = None  # the arm of the probe whose steps are being counted
        self.spent = (0, 0.0)  # ... its tokens and seconds, every step of it

    # ------------------------------------------------------------------ deciding

    @property
    def plain_rate(self) -> float:
        """Tokens per second of plain decoding, as measured (0: not yet)."""
        return self.rates[PLAIN].per_second

    def choose(self) -> Tuple[Arm, bool]:
        """``(arm, probing)`` for the next step."""
        self.step += 1
        if self.probe_left:
            self.probe_left -= 1
            self.chosen = self.probe
            return self.probe, True
        unknown = next((a for a in self.arms if self.rates[a].samples < MIN_SAMPLES), None)
        if unknown is not None and unknown != self.best:
            return self._start_probe(unknown)
        if unknown is None:
            self._rank()
        for arm, park in self.parked.items():
            if arm == self.best:
                continue
            if unknown is None and park.out >= park.wait:  # waited out: probe it, and wait longer next time
                park.out, park.wait = 0, min(park.wait * (4 if self._far(arm) else 2), MAX_WAIT)
                return self._start_probe(arm)
            park.out += 1
        self.chosen = self.best
        return self.best, False

    def measure_first(self) -> None:
        """The step just chosen is timed on its own work alone (the loop ran none of it before): measured."""
        self.prev = self.chosen

    def _start_probe(self, arm: Arm) -> Tuple[Arm, bool]:
        self.probe, self.probe_left, self.chosen, self.probe_got = arm, PROBE_STEPS - 1, arm, (0, 0.0)
        return arm, True

    def _far(self, arm: Arm) -> bool:
        """Whether ``arm`` is far behind the fastest other arm measured (a
        draft model that does not pay), even by its rate's upper bound: probed less."""
        rate, best = self.rates[arm], self.rates[self._leader(arm)]
        return rate.per_second + SURE * min(rate.error, rate.per_second) < FAR * best.per_second

    def _leader(self, but: Arm) -> Arm:
        """The arm measured fastest so far other than ``but``: what a probe
        is compared with (the running best, when no other arm is measured
        yet). While the arms are first measured, the running best is the
        plan's arm, which may itself be far behind."""
        known = [a for a in self.arms if a != but and self.rates[a].samples >= MIN_SAMPLES]
        return max(known, key=lambda a: self.rates[a].per_second) if known else self.best

    def _beats(self, arm: Arm, other: Arm) -> bool:
        """Whether ``arm``'s rate is above ``other``'s by :data:`SURE` standard errors of the difference."""
        a, b = self.rates[arm], self.rates[other]
        return a.per_second - b.per_second > SURE * (a.error**2 + b.error**2) ** 0.5

    def _rank(self) -> None:
        def score(a: Arm) -> float:
            rate = self.rates[a]
            edge = (HYSTERESIS if a == self.best else 1.0) * (PLAN_EDGE if a == self.plan else 1.0)
            # The arm asked for gains one standard error (up to DOUBT of its rate): a draft's yield
            # comes in stretches, so a lead a probe's few steps give another arm is often chance.
            doubt = min(rate.error, DOUBT * rate.per_second) if a == self.plan else 0.0
            return (rate.per_second + doubt) * edge

        best = max(self.arms, key=score)
        if best != self.best:
            left, self.best = self.best, best
            self.parked[best] = _Parked()  # chosen on its merits: its next wait starts over
            if self._far(left):  # left far behind (the plan's first steps, a draft model): probed less
                rate = self.rates[left]
                steps = PROBE_COST_STEPS / rate.weight if rate.weight > 0 else 0.0
                budget = self._budget(left, rate.tokens * steps, rate.seconds * steps)
                self.parked[left] = _Parked(wait=max(4 * PROBE_AFTER, budget))

    # ------------------------------------------------------------------ hearing

    def saw(self, arm: Arm, tokens: int) -> None:
        """A step that ``arm`` sat out: it would have emitted ``tokens``
        (step/shadow.py). Counted while another arm runs: its own steps
        measure it while it does."""
        if arm != self.prev:
            self.rates[arm].saw(self.step, tokens)

    def ran(self, arm: Arm, tokens: int, seconds: float, probing: bool = False) -> None:
        """A step of ``arm`` emitted ``tokens`` in ``seconds``. A step between
        two arms is not measured (its time mixes both arms' work)."""
        self._count(arm, tokens, seconds, probing)
        steady = arm == self.prev and arm == self.chosen
        self.prev = arm
        if steady and seconds > 0:
            self.rates[arm].add(self.step, tokens, seconds)
            if probing and arm == self.probe and arm != self.best:
                got = self.probe_got = (self.probe_got[0] + tokens, self.probe_got[1] + seconds)
                leader = self._leader(arm)
                # Told apart by every step measured, this probe's own on the same side (see the module doc).
                ahead = got[0] / got[1] > self.rates[leader].per_second
                decided = self._beats(arm, leader) if ahead else self._beats(leader, arm)
                if decided:  # the steps already tell (one step can, when far: SURE weighs the prior spread)
                    self.probe_left = 0
                    self.rates[arm].samples = max(self.rates[arm].samples, MIN_SAMPLES)
                    if self._far(arm):  # far behind: its next wait is a far arm's, however it was probed
                        self.parked[arm].wait = max(self.parked[arm].wait, 4 * PROBE_AFTER)

    def _count(self, arm: Arm, tokens: int, seconds: float, probing: bool) -> None:
        """Add a probe's step to what it spent; the first step after it settles its next wait."""
        if self.probed is not None and (not probing or arm != self.probed):
            probed, self.probed = self.probed, None
            if probed != self.best:
                park = self.parked[probed]
                park.wait = max(park.wait, self._budget(probed, *self.spent))
        if probing:
            if self.probed is None:
                self.probed, self.spent = arm, (0, 0.0)
            self.spent = (self.spent[0] + tokens, self.spent[1] + seconds)

    def _budget(self, arm: Arm, tokens: float, seconds: float) -> int:
        """Steps to wait after steps of ``arm`` that emitted ``tokens`` in
        ``seconds``: what they lost against the fastest other arm, over
        :data:`EXPLORE` of that arm's step (0 when they lost nothing)."""
        lead = self.rates[self._leader(arm)]
        if lead.per_second <= 0 or lead.weight <= 0:
            return 0
        lost = seconds - tokens / lead.per_second
        return min(int(lost / (EXPLORE * lead.seconds / lead.weight)), LONGEST_WAIT) if lost > 0 else 0

    # ------------------------------------------------------------------ keeping it

    def to_dict(self) -> dict:
        """Each measured arm's sums (forgotten up to now), samples and wait, and the best arm."""
        arms = {}
        for a in self.arms:
            r, p = self.rates[a], self.parked[a]
            if r.samples and r.seconds > 0:
                k = r.kept(self.step)
                arms[arm_name(a)] = {
                    "sums": [k.tokens, k.seconds, k.weight, k.weight2, k.tt, k.ts, k.ss],
                    "seen": [k.seen, k.seen_steps],
                    "samples": r.samples,
                    "wait": p.wait,
                    "out": p.out,
                }
        return {"names": list(self.names), "best": arm_name(self.best), "arms": arms}

    def seeded(self, other: "Governor", tokens: float = 1.0, seconds: float = 1.0) -> None:
        """Start from ``other``'s measurements, its best arm and its waits, as
        a batch of another number of rows over the same texts: each step's
        tokens times ``tokens`` and its seconds times ``seconds`` (the
        rows' ratio, the cost's). Nothing is measured again first: a batch
        whose rows come and go would otherwise measure every arm anew at each
        number of rows (step/batched.py)."""
        for arm in self.arms:
            r = other.rates.get(arm)
            if r is None or not r.samples or r.seconds <= 0:
                continue
            self.rates[arm] = r.kept(other.step, tokens, seconds)
            self.parked[arm] = _Parked(other.parked[arm].wait, other.parked[arm].out)
        if other.rates[other.best].samples:
            self.best = other.best

    def restore(self, data: dict) -> None:
        """Start from what an earlier generation learned: its best arm, its
        waits and its measurements, forgotten as this generation's steps come
        (the plan's arm, unless far behind, measured again first: a new text
        drafts differently)."""
        if not data or sorted(data.get("names", [])) != sorted(self.names):
            return
        by_name = {arm_name(a): a for a in self.arms}
        saved = {}  # arm: what was kept of it
        for name, got in (data.get("arms") or {}).items():
            sums = got.get("sums") if name in by_name else None
            if not isinstance(sums, list) or len(sums) != 7 or not float(sums[1]) > 0:  # another version's
                continue
            arm = by_name[name]
            saved[arm] = got
            self.rates[arm] = rate = _rate(arm, *map(float, sums), int(got.get("samples", 0)), 0)
            seen = got.get("seen")
            if isinstance(seen, list) and len(seen) == 2:
                rate.seen, rate.seen_steps = map(float, seen)
        best = max((self.rates[a].per_second for a in saved), default=0.0)
        for arm, got in saved.items():
            rate = self.rates[arm]
            close = rate.per_second >= FAR * best  # within reach of the best: this text may decide otherwise
            # The plan's arm, when close, is measured again on this text first (a draft's rate is
            # the text's: a prompt that repeats a document makes lookup pay).
            rate.samples = 0 if arm == self.plan and close else max(rate.samples, MIN_SAMPLES)
            # A new generation is a new text: an arm that was close is probed again within
            # RESTORED_WAIT steps; one far behind keeps its wait and the steps it already waited.
            # So does one whose rate the text does not hide: plain decoding's (its steps emit one
            # token each, whatever the text), and an arm measured where it sits out (the shadow
            # sees this text's yield from its first step; a probe would only time it again).
            anew = close and arm != PLAIN and not rate.seen_steps > 0
            wait = max(int(got.get("wait", PROBE_AFTER)), PROBE_AFTER)
            self.parked[arm].wait = min(wait, RESTORED_WAIT if anew else LONGEST_WAIT)
            self.parked[arm].out = 0 if anew else min(max(int(got.get("out", 0)), 0), wait)
        self.best = by_name.get(data.get("best"), self.best)


__all__ = ["Arm", "Governor", "PLAIN", "Rate", "arm_name", "arms_of", "mode_of"]
