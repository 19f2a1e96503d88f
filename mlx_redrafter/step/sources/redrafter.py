"""The ReDrafter drafter as a source: ``W`` beams of ``L`` tokens, beam-searched
on the device from the target's hidden state and its next token
(draft/redrafter.py, draft/beam.py).

Its rows need nothing from the host, so it proposes in either schedule,
before the step's read. With an adaptive-depth controller
(draft/controller.py) the depth to verify is decided on the device and read
in the step's read (:attr:`~mlx_redrafter.step.source.Rows.pending`), so
the next tree is built after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from ..source import DEVICE, N_BUCKETS, Prior, Proposer, Rows, Setting, Source, rates

# Scores: a node's draft log-probability given its parent, bucketed at
# probabilities 0.1, 0.25, 0.5, 0.75. Priors measured offline with
# ``bench/acceptance.py --calibration`` on 72 held-out ShareGPT replies of
# the default model (8,195 positions, the shipped drafter's greedy beam,
# bench/results/acceptance-heldout/): the share of drafts accepted given
# their parent was, by the draft's own probability bucket; depth 1, then
# depths 2-5 pooled (they did not fall with depth). By sibling rank: the best
# beam 0.435 at depth 1 and about 0.5 deeper; the next beams add 0.07 and
# 0.06 at depth 1 (bench/RESULTS.md section 3's sweep).
PROBABILITY_EDGES = tuple(math.log(p) for p in (0.1, 0.25, 0.5, 0.75))
PRIOR = Prior(
    "drafter",
    PROBABILITY_EDGES,
    rates([0.045, 0.174, 0.389, 0.694, 0.905], [0.065, 0.161, 0.391, 0.709, 0.890]),
    rates([0.435, 0.07, 0.06, 0.04], [0.5, 0.2, 0.15, 0.1]),
)
assert PRIOR.q.shape[1] == N_BUCKETS
LABELS = ("drafter",)  # what its rows are called in the stats, /metrics and the chat's colours


def node_scores(beams) -> mx.array:
    """``[W, L]`` each beam node's own log-probability given its parent (lazy),
    from :class:`~mlx_redrafter.draft.beam.Beams`. Beams that report no
    per-depth scores count every node as sure (log 1)."""
    if beams.path_scores is None:
        return mx.zeros(beams.tokens.shape, mx.float32)
    cum = beams.path_scores
    return mx.concatenate([cum[:, :1], cum[:, 1:] - cum[:, :-1]], axis=1)


@dataclass(frozen=True, eq=False)
class RedrafterSource(Source):
    """``width`` beams of ``length`` tokens from a ReDrafter ``drafter``."""

    drafter: object
    width: int
    length: int
    warp: bool = False
    controller: object = None

    name = "drafter"
    needs = DEVICE
    prior = PRIOR
    beams = True
    takes_controller = True

    @property
    def rows(self) -> int:
        return self.width

    @property
    def taps(self):
        return tuple(getattr(getattr(self.drafter, "config", None), "feature_layers", None) or ()) or None

    def check(self, model) -> None:
        from ...draft.redrafter import check_fits
        from ...errors import RedrafterError

        if self.width < 1 or self.length < 1:
            raise RedrafterError(
                f"Beam width and length must be at least 1 (got width {self.width}, length {self.length}).",
                "Use e.g. --beam-width 2 --beam-length 1.",
            )
        if hasattr(self.drafter, "config"):  # a drafter built in code may be any object with draft()
            check_fits(self.drafter, model)

    def open(self, setting: Setting) -> Proposer:
        return _Beams(self, setting)


class _Beams(Proposer):
    def __init__(self, source: RedrafterSource, setting: Setting):
        self.s, self.setting = source, setting

    def propose(self, at) -> Optional[Rows]:
        s, setting = self.s, self.setting
        top_k = s.controller.top_k if s.controller is not None else 0
        beams = s.drafter.draft(
            setting.embed, setting.features(at.context), at.g0, s.width, s.length, warp=s.warp, confidences=top_k
        )
        scores = node_scores(beams) if setting.auto else None
        rows = Rows(beams.tokens, (s.length,) * s.width, s.name, s.prior, scores=scores)
        if s.controller is None:
            return rows
        depth = s.controller.choose_depth(beams)

        def settle(vals: List[int]) -> Rows:
            d = vals[0]
            cut = None if scores is None else scores[:, :d]
            return Rows(beams.tokens[:, :d], (d,) * s.width, s.name, s.prior, scores=cut)

        rows.pending, rows.settle = depth.reshape(1).astype(mx.int32), settle
        return rows


def from_request(draft) -> List[Source]:
    """The drafter of a request, unless it is a layer head (step/sources/chain.py drafts those)."""
    from ...config import is_layer_head

    d = draft.drafter
    if d is None or is_layer_head(d):
        return []
    return [RedrafterSource(d, draft.beam_width, draft.beam_length, draft.warp)]
