"""What a step costs on this machine now, learned from this run's own steps.

A stored verify-cost curve (step/curve.py) is a measurement of one moment on
one machine: a laptop on battery, another job on the cores, a longer context
or simply another host all move it. :class:`LiveCost` keeps a model of a
step's wall time that every step's measured time corrects:

    t(step) = plain + extra(size) + sum of draft(source) for the sources that drafted

* ``plain``: a plain decoding step (``g0`` alone, nothing drafted);
* ``extra(size)``: what verifying ``size`` tokens costs over one, at the
  sizes of :data:`SIZES` (linear between them, the last slope past them);
* ``draft(source)``: what a source with a forward of its own (the ReDrafter
  head, a layer head, a draft model, a block drafter) adds to a step.
  Host-side sources (lookup, the datastore, a user's) cost only their
  verified tokens, which ``extra`` counts.

The parameters are learned by recursive least squares with exponential
forgetting: a measurement counts ``FORGET`` times less each step after it,
so the model follows a machine that slows down or a context that grows,
and a prior (the calibrated or built-in curve, and a guess per source in
plain steps) is overruled after a few steps. The time measured in the
pipelined schedule is the time between two reads, so the overlap that
schedule gains is part of what a size costs.

Everything here is host numbers (numpy); nothing reads the device.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from ..files import cache_root, write_json_atomic
from .curve import BUCKET_SIZES, builtin_curve

LIVE_VERSION = 1
SIZES = BUCKET_SIZES[1:]  # sizes with a parameter of their own (size 1 is ``plain``)
FORGET = 0.95  # weight of a measurement one step older: about the last 20 steps count
# A source's draft cost before it is measured, in plain steps (``draft_prior``
# overrides it): a small head or a short beam search costs a fraction of the model.
DRAFT_PRIOR = 0.2
PRIOR_SD = 0.6  # prior standard deviation of each parameter, in plain steps
NOISE_SD = 0.1  # a measurement's standard deviation, in plain steps
PLAIN_SD = 0.15  # past this relative uncertainty of a plain step's cost, a plain step is measured
CLAMP = 0.5  # a measurement is clamped to +-CLAMP of the prediction (a GC pause, a page fault)


def size_weights(size: int) -> np.ndarray:
    """``extra(size)`` as weights over :data:`SIZES`' parameters: linear
    between the two around ``size``, the last slope continued past them."""
    w = np.zeros(len(SIZES))
    if size <= 1:
        return w
    sizes = (1,) + SIZES
    if size >= sizes[-1]:  # extrapolate from the last two sizes
        lo, hi = len(sizes) - 2, len(sizes) - 1
    else:
        hi = next(i for i, s in enumerate(sizes) if s >= size)
        lo = hi - 1
    t = (size - sizes[lo]) / (sizes[hi] - sizes[lo])
    if lo > 0:
        w[lo - 1] += 1 - t
    w[hi - 1] += t
    return w


class LiveCost:
    """A step's wall time, learned online (see the module doc).

    ``curve``: the prior verify-cost curve (c(n) in plain steps: a
    calibrated one, else the built-in one); ``draft_prior``: per source,
    its prior draft cost in plain steps. Times are in seconds. Before the
    first measurement the model knows costs in plain steps only
    (:meth:`ratio`); the first measurement sets their scale.
    """

    def __init__(self, curve=None, draft_prior: Optional[Dict[str, float]] = None, forget: float = FORGET):
        curve = curve if curve is not None else builtin_curve()
        self.forget = forget
        self.draft_prior = dict(draft_prior or {})
        self.sources: Dict[str, int] = {}  # source name -> parameter index
        # Parameters in plain steps until the first measurement scales them.
        self.theta = np.array([1.0] + [max(curve(s) - 1.0, 0.0) for s in SIZES])
        self.cov = np.diag([PRIOR_SD**2] * len(self.theta))
        self.scale: Optional[float] = None  # seconds per plain step, set by the first measurement
        self.samples = 0

    # ------------------------------------------------------------------ model

    def _index(self, source: str) -> int:
        """The parameter of ``source``'s draft cost (added at its prior the first time it is named)."""
        if source not in self.sources:
            self.sources[source] = len(self.theta)
            prior = self.draft_prior.get(source, DRAFT_PRIOR) * (self.scale or 1.0)
            sd = PRIOR_SD * (self.scale or 1.0)
            self.theta = np.append(self.theta, prior)
            cov = np.zeros((len(self.theta), len(self.theta)))
            cov[:-1, :-1] = self.cov
            cov[-1, -1] = sd**2
            self.cov = cov
        return self.sources[source]

    def features(self, size: int, sources: Iterable[str] = ()) -> np.ndarray:
        """The step's feature vector: plain, the size's weights, one per drafting source."""
        idx = [self._index(s) for s in sources]
        x = np.zeros(len(self.theta))
        x[0] = 1.0
        x[1 : 1 + len(SIZES)] = size_weights(size)
        for i in idx:
            x[i] += 1.0
        return x

    def predict(self, size: int, sources: Iterable[str] = ()) -> float:
        """Expected wall time of a step (seconds; plain steps before any measurement)."""
        return max(float(self.features(size, sources) @ self.theta), 1e-9)

    def ratio(self, size: int, sources: Iterable[str] = ()) -> float:
        """A step's expected time in plain steps (c(size) plus the sources' draft costs)."""
        return self.predict(size, sources) / self.predict(1)

    def curve(self, sources: Sequence[str] = ()):
        """``c(n)`` in plain steps for a step drafted by ``sources``: the
        callable the tree selection prices sizes with (step/select.py)."""
        sources = tuple(sources)
        plain = self.predict(1)
        base = self.features(1, sources) @ self.theta

        def c(n: int) -> float:
            return float(base + size_weights(n) @ self.theta[1 : 1 + len(SIZES)]) / plain

        c.max_size = SIZES[-1]
        return c

    def needs_plain(self) -> bool:
        """Whether a plain step should be measured: steps that always draft
        cannot tell a plain step's cost from the drafting's, and forgetting
        makes that uncertainty grow until a plain step pins it again."""
        if self.scale is None:
            return False
        return self.cov[0, 0] > (PLAIN_SD * self.theta[0]) ** 2

    # ------------------------------------------------------------------ learning

    def observe(self, size: int, seconds: float, sources: Iterable[str] = ()) -> None:
        """One step of ``size`` verified tokens, drafted by ``sources``, took ``seconds``."""
        if seconds <= 0:
            return
        x = self.features(size, sources)
        if self.scale is None:  # the first measurement fixes the unit: plain steps -> seconds
            self.scale = seconds / float(x @ self.theta)
            self.theta = self.theta * self.scale
            self.cov = self.cov * self.scale**2
        pred = float(x @ self.theta)
        seconds = min(max(seconds, pred * (1 - CLAMP)), pred * (1 + CLAMP))
        cov = self.cov / self.forget
        noise = (NOISE_SD * self.theta[0]) ** 2
        px = cov @ x
        gain = px / (noise + x @ px)
        self.theta = self.theta + gain * (seconds - pred)
        self.theta[0] = max(self.theta[0], 1e-6)
        self.cov = cov - np.outer(gain, px)
        self.cov = (self.cov + self.cov.T) / 2  # keep it symmetric against rounding
        self.samples += 1

    # ------------------------------------------------------------------ keeping it

    def to_dict(self) -> dict:
        """The learned model in plain steps (a reload on a busier machine rescales at its first step)."""
        unit = self.theta[0] if self.scale is not None else 1.0
        sd = np.sqrt(np.maximum(np.diag(self.cov), 0.0)) / unit
        return {
            "version": LIVE_VERSION,
            "theta": (self.theta / unit).tolist(),
            "sd": sd.tolist(),
            "sources": self.sources,
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, data: dict, forget: float = FORGET) -> "LiveCost":
        """A model that starts from what an earlier run learned: its costs in
        plain steps as the prior (with the uncertainty it had, never below
        :data:`NOISE_SD`), its scale set again by this run's first step."""
        if data.get("version") != LIVE_VERSION:
            raise ValueError(f"live cost version {data.get('version')!r}, expected {LIVE_VERSION}")
        theta = np.asarray(data["theta"], np.float64)
        if theta.shape[0] < 1 + len(SIZES) or theta[0] <= 0:
            raise ValueError("live cost: malformed parameters")
        out = cls(forget=forget)
        out.theta = theta
        sd = np.maximum(np.asarray(data.get("sd", [PRIOR_SD] * len(theta)), np.float64), NOISE_SD)
        out.cov = np.diag(sd**2)
        out.sources = {str(k): int(v) for k, v in data.get("sources", {}).items()}
        out.samples = int(data.get("samples", 0))
        return out


# --------------------------------------------------------------------------- on disk


def live_path(key: Sequence[str]):
    """``cache_root()/profiles/live-<digest>.json`` for a (device, model, variant) key."""
    digest = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"live-{digest}.json"


def save_state(key: Sequence[str], state: dict):
    """Write a generation's learned state (atomically) where :func:`load_state` finds it."""
    path = live_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"key": list(key), **state})
    return path


def load_state(key: Sequence[str]) -> Optional[dict]:
    """What an earlier run learned for ``key``, or None (none, unreadable, another key)."""
    path = live_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("key") == list(key) else None
