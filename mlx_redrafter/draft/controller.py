"""Adaptive draft depth at run time: a small learned controller (RADAR, 2025)
that decides, after each beam-search step, whether drafting deeper is worth it.

The policy reads the drafter's top-k confidences along the best beam and its
own recurrent state: a 1-layer LSTM (hidden 128) and a 2-layer MLP head give
the probability of going one level deeper. Inside the generation loop the
beam search drafts all ``L`` levels lazily (a draft level costs about a
millisecond here, a verified token several), so unlike RADAR the decision to
include depth ``d`` can read depth ``d``'s own confidence. The controller picks
the depth ``D`` on the device, and only ``beams[:, :D]`` are verified; ``D`` is read in
the loop's one sync, together with the tree size. The controller changes how
much is verified, never what is accepted: output stays exact.

Training (``mlx-redrafter train-controller``, train/controller.py) is an offline policy gradient
(REINFORCE, with its expectation over the ``L`` stopping depths computed
exactly) on recorded episodes: per step, the confidences, the number of drafts the LLM
accepted at full depth ``a`` (so depth ``D`` would accept ``min(a, D)``) and the
tree size at every depth, priced with verify latencies measured on this
device. Reward: ``(min(a, D) + 1) / (T(D) / T_plain) - alpha * D``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import DEFAULT_LENGTH, DEFAULT_WIDTH
from ..errors import RedrafterError

CONFIG = "controller.json"
WEIGHTS = "controller.safetensors"


@dataclass
class ControllerConfig:
    top_k: int = 10
    hidden: int = 128
    beam_width: int = DEFAULT_WIDTH  # the (W, L) it was trained for (training sets them)
    beam_length: int = DEFAULT_LENGTH
    threshold: float = 0.5  # continue while P(continue) >= threshold
    alpha: float = 0.05
    latency: Dict[str, float] = field(default_factory=dict)  # measured cost model, ms
    # A layer head's controller decides before each draft call (RADAR's order
    # over EAGLE-3): its LSTM reads the confidences of the depths drafted so
    # far, the first input a zero vector (:func:`before_call_inputs`). False:
    # it reads each depth's own confidences (the recurrent drafter's, whose
    # search drafts every depth in one lazily evaluated graph).
    before_call: bool = False


class Controller(nn.Module):
    """LSTM over per-depth top-k confidences -> P(draft one level deeper)."""

    def __init__(self, config: ControllerConfig):
        super().__init__()
        self.config = config
        self.lstm = nn.LSTM(config.top_k, config.hidden)
        self.mlp = [nn.Linear(config.hidden, config.hidden), nn.Linear(config.hidden, 1)]

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def continue_logits(self, confidences: mx.array) -> mx.array:
        """``[..., L, k]`` confidences -> ``[..., L]`` logits; entry ``d`` (0-based)
        is the logit of verifying depth ``d + 1`` given the confidences of
        depths ``1..d+1`` (entry 0 is unused: depth 1 is always verified)."""
        h, _ = self.lstm(confidences)
        return self.logit(h)

    def logit(self, h: mx.array) -> mx.array:
        """The continue logit of LSTM states ``h [..., hidden]`` -> ``[...]``."""
        return self.mlp[1](nn.relu(self.mlp[0](h)))[..., 0]

    @property
    def bar(self) -> float:
        """The continue logit at the threshold: deeper while the logit is at least this."""
        t = self.config.threshold
        return float(np.log(t / (1 - t)))

    def choose_depth(self, beams) -> mx.array:
        """The generation loop's hook: depth to verify for these :class:`~.beam.Beams`."""
        return self.depth(beams.confidences[0])

    def depth(self, confidences: mx.array) -> mx.array:
        """Drafted depth to verify, in ``[1, L]`` (lazy): stop at the first
        depth whose continue-probability falls below the threshold."""
        logits = self.continue_logits(confidences)[..., 1:]
        keep = (logits >= self.bar).astype(mx.int32)
        return 1 + mx.cumprod(keep, axis=-1).sum(axis=-1)


def before_call_inputs(confidences):
    """``[..., L, k]`` per-depth confidences as a before-call controller reads
    them: entry ``d`` holds depth ``d``'s (entry 0 zeros), so the decision on
    drafting depth ``d + 1`` reads depths ``1..d`` (numpy or MLX)."""
    zeros = confidences[..., :1, :] * 0
    lib = mx if isinstance(confidences, mx.array) else np
    return lib.concatenate([zeros, confidences[..., :-1, :]], axis=-2)


class DepthGate:
    """The controller deciding a layer head's draft calls one at a time, as
    RADAR runs it over EAGLE-3 (one gate per step: the LSTM's state is the
    step's; ``reads`` counts its host reads). :func:`~.head.head_beams` asks
    :meth:`deeper` before each call past the first and tells :meth:`drafted`
    each depth's top-k confidences once the call is made.

    * ``before_call`` (what ``make-drafter`` and ``train-controller`` train for
      a head): the decision to draft depth ``d + 1`` reads the confidences of
      depths ``1..d``; a depth it does not draft costs nothing.
    * otherwise: each depth is drafted, then kept or dropped by its own
      confidences; a dropped depth's call was made.

    Either way the rule is :meth:`Controller.depth`'s (depth 1 always; stop at
    the first decision below the threshold), one depth at a time."""

    def __init__(self, controller: Controller):
        self.controller, self.state, self.reads = controller, (None, None), 0
        self.bar = controller.bar
        self.before = controller.config.before_call
        if self.before:
            self._feed(mx.zeros((controller.top_k,)))

    def _feed(self, x: mx.array) -> None:
        h, cell = self.controller.lstm(x.reshape(1, -1), *self.state)
        self.state = (h[-1], cell[-1])

    def _go(self) -> bool:
        self.reads += 1
        return self.controller.logit(self.state[0]).item() >= self.bar

    def deeper(self, depth: int) -> bool:
        """Before the call for depth ``depth + 1`` (0-based ``depth``, at least 1): make it?"""
        return self._go() if self.before else True

    def drafted(self, depth: int, confidences: mx.array) -> bool:
        """Depth ``depth + 1`` was drafted with these ``[k]`` confidences: keep it?"""
        self._feed(confidences)
        return True if self.before or depth == 0 else self._go()


def save_controller(controller: Controller, folder) -> Path:
    folder = Path(folder)
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(folder / WEIGHTS), dict(tree_flatten(controller.parameters())))
    (folder / CONFIG).write_text(json.dumps(asdict(controller.config), indent=2) + "\n")
    return folder


def load_controller(folder) -> Controller:
    """The controller trained for the drafter in ``folder``."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise RedrafterError(
            f"No adaptive controller next to the drafter in {folder}.",
            f"Train one: mlx-redrafter train-controller --drafter {folder}",
        )
    config = ControllerConfig(**json.loads((folder / CONFIG).read_text()))
    c = Controller(config)
    c.load_weights(str(folder / WEIGHTS))
    mx.eval(c.parameters())
    return c
