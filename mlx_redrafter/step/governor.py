"""Whether a step drafts, and with which sources: the rule that keeps
generation from ever being slower than plain decoding.

Each step, before anything is drafted, the step loop offers the
:class:`Governor` its options: the sets of costly sources (those with a
forward of their own: the ReDrafter head, a layer head, a draft model, a
block drafter) it could draft with, each with the expected gain the tree
selection found for it, in tokens per plain step under
:class:`~mlx_redrafter.step.live_cost.LiveCost`'s prices (the empty set is
plain decoding, plus whatever free host-side rows such as lookup's pay for
themselves). The governor takes the best option, so plain decoding runs
whenever drafting is expected to lose.

Expectations come from what was accepted, and a source that does not draft
is not observed: its estimate would never recover after a bad stretch. So a
source left out is **probed**: after ``PROBE_AFTER`` steps out it drafts for
``PROBE_STEPS`` steps, and if it is still left out after that, the wait
doubles (up to ``MAX_WAIT``); once it is chosen again the wait starts over.
Ollama's MLX runner and oMLX park speculation the same way.

:class:`Tally` counts what happened, for the summaries, ``/stats`` and
``/metrics``: steps drafted, steps plain, steps probing, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

PROBE_AFTER = 16  # steps a left-out source waits before it is probed the first time
PROBE_STEPS = 2  # steps a probe drafts
MAX_WAIT = 1024  # the longest wait between probes
MARGIN = 1.0  # an option must beat plain decoding's gain by this factor to draft


@dataclass(frozen=True)
class Option:
    """One way to run the next step: the costly ``sources`` that draft and the
    expected ``gain`` (tokens per plain step) of the best tree they give."""

    sources: FrozenSet[str]
    gain: float


@dataclass
class _Parked:
    wait: int = PROBE_AFTER  # steps out before the next probe
    out: int = 0  # steps out since the last probe
    probing: int = 0  # probe steps left


@dataclass
class Tally:
    """What the governor decided, step by step (host counts)."""

    drafted: int = 0  # steps that drafted with a costly source or verified drafted rows
    plain: int = 0  # steps of plain decoding (nothing drafted)
    probes: int = 0  # steps that drafted to probe a left-out source
    left_out: Dict[str, int] = field(default_factory=dict)  # per costly source: steps it did not draft

    def merge(self, other: "Tally") -> None:
        self.drafted += other.drafted
        self.plain += other.plain
        self.probes += other.probes
        for k, v in other.left_out.items():
            self.left_out[k] = self.left_out.get(k, 0) + v

    @property
    def steps(self) -> int:
        return self.drafted + self.plain

    def summary(self) -> str:
        """One phrase: how often the step drafted and why it did not."""
        if not self.steps:
            return ""
        words = f"drafted {self.drafted} of {self.steps} steps"
        if self.plain:
            words += f", {self.plain} plain (drafting did not pay)"
        if self.probes:
            words += f", {self.probes} probing"
        return words


class Governor:
    """Chooses each step's costly sources (see the module doc)."""

    def __init__(self, sources: Sequence[str] = (), margin: float = MARGIN):
        self.parked: Dict[str, _Parked] = {s: _Parked() for s in sources}
        self.margin = margin
        self.tally = Tally()

    def options(self, sources: Optional[Sequence[str]] = None) -> List[FrozenSet[str]]:
        """The source sets worth pricing this step: none, each source alone,
        all of them (a few costly sources at most, so every subset of two)."""
        names = list(self.parked if sources is None else sources)
        sets = {frozenset()} | {frozenset([s]) for s in names}
        if len(names) <= 3:
            sets |= {frozenset([a, b]) for i, a in enumerate(names) for b in names[i + 1 :]}
        sets.add(frozenset(names))
        return sorted(sets, key=lambda s: (len(s), sorted(s)))

    def choose(
        self, options: Iterable[Option], plain_gain: float = 1.0, measure_plain: bool = False
    ) -> Tuple[FrozenSet[str], bool]:
        """``(sources, probing)``: the option with the best gain (ties to fewer
        sources), with the left-out sources that are due a probe added.
        ``plain_gain``: the gain of the empty set when it is not among ``options``.
        ``measure_plain``: the cost model no longer knows what a plain step
        costs (:meth:`~mlx_redrafter.step.live_cost.LiveCost.needs_plain`):
        this step runs plain, whatever drafting is expected to gain, unless a
        probe is due."""
        options = list(options)
        if measure_plain:
            probing = self._probes(frozenset())
            return probing, bool(probing)
        best = max(options, key=lambda o: (o.gain, -len(o.sources)), default=Option(frozenset(), plain_gain))
        empty = next((o.gain for o in options if not o.sources), plain_gain)
        chosen = best.sources if best.gain > empty * self.margin else frozenset()
        probing = self._probes(chosen)
        return chosen | probing, bool(probing)

    def _probes(self, chosen: FrozenSet[str]) -> FrozenSet[str]:
        due = set()
        for name, park in self.parked.items():
            if name in chosen:
                if not park.probing:  # chosen on its merits: the next wait starts over
                    park.wait, park.out = PROBE_AFTER, 0
                continue
            if park.probing:
                due.add(name)
            elif park.out >= park.wait:
                park.probing, park.out = PROBE_STEPS, 0
                due.add(name)
        return frozenset(due)

    def ran(self, sources: FrozenSet[str], drafted: bool, probing: bool) -> None:
        """The step ran with ``sources``; ``drafted``: it verified more than ``g0``."""
        t = self.tally
        if drafted or sources:
            t.drafted += 1
        else:
            t.plain += 1
        t.probes += int(probing)
        for name, park in self.parked.items():
            if name in sources:
                if park.probing:
                    park.probing -= 1
                    if not park.probing:  # the probe is over: if it is not chosen next, wait longer
                        park.wait = min(park.wait * 2, MAX_WAIT)
                continue
            park.out += 1
            t.left_out[name] = t.left_out.get(name, 0) + 1

    # ------------------------------------------------------------------ keeping it

    def to_dict(self) -> dict:
        return {name: {"wait": p.wait, "out": p.out} for name, p in self.parked.items()}

    def restore(self, data: dict) -> None:
        """Waits carried over from an earlier generation (a source that kept losing stays parked)."""
        for name, p in (data or {}).items():
            if name in self.parked:
                self.parked[name].wait = int(min(max(p.get("wait", PROBE_AFTER), PROBE_AFTER), MAX_WAIT))
                self.parked[name].out = int(max(p.get("out", 0), 0))
