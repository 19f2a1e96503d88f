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
        return self.mlp[1](nn.relu(self.mlp[0](h)))[..., 0]

    def choose_depth(self, beams) -> mx.array:
        """The generation loop's hook: depth to verify for these :class:`~.beam.Beams`."""
        return self.depth(beams.confidences[0])

    def depth(self, confidences: mx.array) -> mx.array:
        """Drafted depth to verify, in ``[1, L]`` (lazy): stop at the first
        depth whose continue-probability falls below the threshold."""
        logits = self.continue_logits(confidences)[..., 1:]
        t = self.config.threshold
        keep = (logits >= float(np.log(t / (1 - t)))).astype(mx.int32)
        return 1 + mx.cumprod(keep, axis=-1).sum(axis=-1)


class DepthGate:
    """The controller deciding a layer head's draft calls one at a time, as
    RADAR runs it over EAGLE-3: after each draft call the LSTM reads that
    depth's top-k confidences, and the host reads whether the depth is kept
    (and the next call made). The same rule as :meth:`Controller.depth`
    (depth 1 always kept; stop at the first depth below the threshold), one
    depth at a time: a layer head's depths are calls of their own, and a
    depth never drafted costs nothing. One gate per step (the LSTM's state
    is the step's); ``reads`` counts its host reads."""

    def __init__(self, controller: Controller):
        self.controller, self.state, self.reads = controller, (None, None), 0
        t = controller.config.threshold
        self.bar = float(np.log(t / (1 - t)))

    def __call__(self, depth: int, confidences: mx.array) -> bool:
        """Whether drafted depth ``depth + 1`` (0-based ``depth``) is verified,
        from its ``[k]`` confidences; depth 1 is, without a read."""
        c = self.controller
        h, cell = c.lstm(confidences.reshape(1, -1), *self.state)
        self.state = (h[-1], cell[-1])
        if depth == 0:
            return True
        self.reads += 1
        return c.mlp[1](nn.relu(c.mlp[0](h[-1])))[0].item() >= self.bar


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
