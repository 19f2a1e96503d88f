"""``make-drafter``'s time budget: the rates it measures in the run, and how
they split the budget between its stages.

Distillation and training share what the other stages leave. The split
follows the shipped recipe's shape (bench/RESULTS.md section 12: 1479
steps of 256 over 361k positions, about one pass): training makes
:data:`PASSES` passes over the data, so the seconds of training that one
distilled position calls for are ``PASSES * (1 - held_out) / (batch *
steps per second)``. Both rates are this run's own: positions per second
while distilling (live), training steps per second from a probe on random
data of the real shapes (a step's cost depends on the shapes alone) until
training has run. The other stages' costs are estimated from the model's
measured decode step and replaced by what they measured once they ran.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Optional

import mlx.core as mx
import numpy as np

PASSES = 1.0  # training passes over the distilled data (the shipped recipe's)
FIXED_SHARE = 0.2  # at most this share of the budget goes to the controller, calibration and verdict
MIN_RATE_SECONDS = 20.0  # live distillation rates replace a stored one after this long


@dataclass
class Rates:
    """What the run measured (0: not yet)."""

    step_s: float = 0.0  # one plain decode step of the LLM
    positions_per_s: float = 0.0  # distillation: training positions (replies and prompts) per second
    train_steps_per_s: float = 0.0  # drafter training steps per second
    eagle3_positions_per_s: float = 0.0  # EAGLE-3 head training: positions (chain origins) per second
    dflash_positions_per_s: float = 0.0  # DFlash drafter training: drafted slots (blocks x drafts) per second

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Rates":
        return cls(**{f.name: float((d or {}).get(f.name, 0.0)) for f in fields(cls)})


@dataclass
class Sizes:
    """How much the controller, calibration and verdict stages measure."""

    controller_prompts: int = 24  # `make train-default`'s train-controller run
    controller_tokens: int = 96
    verdict_prompts: int = 8
    verdict_tokens: int = 96
    calibrate_s: float = 30.0  # `doctor --calibrate`'s budget


def estimate_fixed_s(sizes: Sizes, step_s: float, verdict_passes: int = 4) -> dict:
    """Seconds each fixed stage should take, from one plain decode step:
    recording the controller's episodes verifies a W=2 L=4 tree per step
    (about two plain steps on a CPU), its latency table times about 150
    calls; the verdict decodes every prompt once per pass (plain twice,
    lookup, the new drafter, and the one in use, if any)."""
    return {
        "controller": 2 * sizes.controller_prompts * sizes.controller_tokens * step_s + 150 * step_s + 5,
        "calibrate": sizes.calibrate_s + 2,
        "verdict": 1.2 * verdict_passes * sizes.verdict_prompts * sizes.verdict_tokens * step_s,
    }


def fit_sizes(budget_s: float, step_s: float, base: Optional[Sizes] = None) -> Sizes:
    """The default sizes, scaled down (prompts and tokens alike) until the
    fixed stages fit :data:`FIXED_SHARE` of the budget."""
    base = base or Sizes()
    total = sum(estimate_fixed_s(base, step_s).values())
    scale = min(1.0, FIXED_SHARE * budget_s / max(total, 1e-9))
    if scale >= 1.0:
        return base
    root = math.sqrt(scale)
    # A calibration round times every size from 1 to 16 in short bursts: about 100 plain steps.
    rounds_s = min(base.calibrate_s, 2 * 100 * step_s)
    return Sizes(
        max(2, round(base.controller_prompts * root)),
        max(16, round(base.controller_tokens * root)),
        max(2, round(base.verdict_prompts * root)),
        max(16, round(base.verdict_tokens * root)),
        max(1.0, rounds_s, base.calibrate_s * scale),
    )


def train_seconds_per_position(rates: Rates, batch_size: int, held_out: float, heads=("redrafter",)) -> float:
    """Training seconds that one more distilled position calls for: each head
    in ``heads`` makes :data:`PASSES` passes over the data (the ReDrafter head
    at its steps of ``batch_size`` positions, the EAGLE-3 head at its own rate)."""
    seconds = 0.0
    if "redrafter" in heads:
        seconds += PASSES * (1 - held_out) / (batch_size * max(rates.train_steps_per_s, 1e-9))
    if "eagle3" in heads:
        seconds += PASSES * (1 - held_out) / max(rates.eagle3_positions_per_s, 1e-9)
    if "dflash" in heads:  # a pass trains each position as one block's slot (anchors sampled at random)
        seconds += PASSES * (1 - held_out) / max(rates.dflash_positions_per_s, 1e-9)
    return seconds


def more_distill_s(
    left_s: float,
    positions: int,
    train_spent_s: float,
    rates: Rates,
    batch_size: int,
    held_out: float,
    heads=("redrafter",),
) -> float:
    """Seconds more of distillation, out of ``left_s`` for distillation and
    training together, so that training keeps pace with the data: with
    ``x`` more seconds of distilling, training's total ``train_spent_s + (left_s
    - x)`` equals the seconds that ``positions + rate * x`` positions call for."""
    if left_s <= 0:
        return 0.0
    k = train_seconds_per_position(rates, batch_size, held_out, heads)
    x = (left_s + train_spent_s - k * positions) / (1 + k * rates.positions_per_s)
    return min(max(x, 0.0), left_s)


class LiveRate:
    """Positions per second of this distillation run, and the seconds of one
    of its decode steps, from its progress calls (one per step)."""

    def __init__(self, prior: float = 0.0):
        self.prior, self.start, self.base, self.now = prior, None, 0, 0.0
        self.last, self.step_s = None, 0.0

    def update(self, positions: int) -> float:
        """The rate after ``positions`` (the folder's total so far, in-flight replies included)."""
        t = time.perf_counter()
        if self.start is None:
            self.start, self.base = t, positions
        if self.last is not None:  # a moving average: prefills make some steps long
            self.step_s = t - self.last if not self.step_s else 0.9 * self.step_s + 0.1 * (t - self.last)
        self.last = t
        self.now = (positions - self.base) / max(t - self.start, 1e-9)
        return self.rate

    @property
    def elapsed(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start

    @property
    def rate(self) -> float:
        """The live rate once it has run long enough (or when there is no prior), else the prior."""
        if self.prior and self.elapsed < MIN_RATE_SECONDS:
            return self.prior
        return self.now


def measure_step_s(model, prompt, tokens: int = 16) -> float:
    """Seconds per plain decode step of ``model`` on ``prompt`` (token ids)."""
    from ..tuning.measure import measure

    measure(model, prompt, max_tokens=4)  # the first call pays for kernels and allocations
    run = measure(model, prompt, max_tokens=tokens)
    return run.decode_time / max(run.decode_tokens, 1)


def measure_train_rate(model, cfg, steps: int = 4, top_k: int = 16, positions: int = 2048) -> float:
    """Training steps per second of the head ``cfg`` (a TrainConfig) for
    ``model`` on this device, timed on random data of the real shapes (the
    hidden states, ``top_k`` soft targets), before any data is distilled."""
    import mlx.optimizers as optim

    from ..llm.parts import hidden_size, model_parts
    from .examples import Batcher, Examples
    from .shards import Corpus
    from .trainer import make_step, new_drafter, vocab_map
    from .world import world

    embed, _, _ = model_parts(model)
    vocab, hidden = int(embed.weight.shape[0]), hidden_size(model)
    rng = np.random.default_rng(0)
    corpus = Corpus(
        rng.integers(0, vocab, positions).astype(np.int32),
        rng.standard_normal((positions, hidden)).astype(np.float16),
        np.array([0, positions]),
        ["probe"],
    )
    if top_k:
        corpus.extra = {
            "topk_ids": rng.integers(0, vocab, (positions, top_k)).astype(np.int32),
            "topk_logits": rng.standard_normal((positions, top_k)).astype(np.float32),
        }
    probe = replace(cfg, init_head_from_llm=False)  # the step costs the same; no copy of the LLM's head
    drafter = new_drafter(model, corpus, probe)
    examples = Examples(np.arange(positions - cfg.depth - 1), np.full(positions, positions))
    batcher = Batcher(corpus, examples, cfg.depth, vocab_map(drafter, vocab), soft=bool(top_k and cfg.soft_weight))
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    embed.freeze()  # as training does: the LLM stays frozen
    step = make_step(drafter, embed, optimizer, world(), probe)

    def one():  # gathering the batch on the host is part of a training step
        step(batcher.batch(rng.integers(0, len(examples.positions), cfg.batch_size)), cfg.lr)

    one()  # compiles
    tic = time.perf_counter()
    for _ in range(steps):
        one()
    mx.eval(drafter.parameters())
    return steps / (time.perf_counter() - tic)
