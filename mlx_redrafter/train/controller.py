"""Training the adaptive-depth controller (draft/controller.py) for a drafter, on this device.

Offline policy gradient (REINFORCE, with its expectation over the ``L``
stopping depths computed exactly) on recorded episodes: per step, the
confidences, the number of drafts the LLM accepted at full depth ``a`` (so
depth ``D`` would accept ``min(a, D)``) and the tree size at every depth,
priced with verify latencies measured on this device (with a verify-cost
curve from ``doctor --calibrate``, c(N) x one plain step). Reward:
``(min(a, D) + 1) / (T(D) / T_plain) - alpha * D``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..config import DraftConfig
from ..draft.controller import WEIGHTS, Controller, ControllerConfig, save_controller
from ..step.dispatch import redrafter_steps

# --------------------------------------------------------------------------- recording


class Recorder:
    """Stands in for a controller while recording: always verifies the full
    depth, and keeps the best beam's confidences and the tree size that each
    depth would have had."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.confidences: List[mx.array] = []
        self.tree_sizes: List[mx.array] = []

    def choose_depth(self, beams) -> mx.array:
        from ..step.tree import count_nodes

        length = beams.tokens.shape[1]
        self.confidences.append(beams.confidences[0])
        self.tree_sizes.append(mx.stack([count_nodes(beams.tokens, d) + 1 for d in range(1, length + 1)]))
        return mx.array(length, mx.int32)


@dataclass
class Episodes:
    confidences: np.ndarray  # [n, L, k]
    accepted: np.ndarray  # [n] drafts accepted at full depth
    tree_sizes: np.ndarray  # [n, L] tokens verified (g0 included) at depth 1..L


def record_episodes(
    model,
    drafter,
    prompts: List[List[int]],
    width: int,
    length: int,
    max_tokens: int,
    eos_ids=(),
    top_k: int = ControllerConfig.top_k,
    progress: Optional[Callable[[int], None]] = None,
) -> Episodes:
    """Run ReDrafter (greedy) on tokenized training prompts; one episode per step."""
    from mlx_lm.models.cache import make_prompt_cache

    confs, accepted, sizes = [], [], []
    for i, prompt in enumerate(prompts):
        rec = Recorder(top_k)
        ids = mx.array(prompt, dtype=mx.int32)
        # Every step drafts: an episode is a drafted step (the live choice would
        # run plain steps where drafting does not pay, and record nothing for them).
        draft = DraftConfig(drafter, width, length, controller=rec, always_draft=True)
        steps = redrafter_steps(model, ids, make_prompt_cache(model), draft=draft)
        stats, emitted = [], 0
        for step in steps:
            stats.append(step.stats)
            emitted += len(step.tokens)
            if emitted >= max_tokens or any(t in eos_ids for t in step.tokens):
                break
        steps.close()
        # The drafts made in step j are verified in step j + 1.
        for j, st in enumerate(stats[1:]):
            confs.append(np.array(rec.confidences[j]))
            sizes.append(np.array(rec.tree_sizes[j]))
            accepted.append(st.accepted)
        if progress:
            progress(i + 1)
    return Episodes(np.stack(confs), np.array(accepted), np.stack(sizes))


# --------------------------------------------------------------------------- cost model


def measure_latency(
    model, drafter, width: int, length: int, sizes=None, repeats: int = 5, top_k: int = ControllerConfig.top_k
) -> Dict[str, float]:
    """Device latencies in ms: one plain decode step, the verify call for each
    tree size, one full beam search (returning ``top_k`` confidences per
    depth, as the controller reads them), and the controller itself."""
    from ..llm.cache import warm_cache
    from ..llm.parts import model_parts
    from ..tuning.cost import median_ms

    embed, backbone, head = model_parts(model)
    cache, rewind = warm_cache(model, backbone)

    def timed(fn):
        return median_ms(fn, repeats, after=rewind)

    def forward(n):
        def fn():
            h = backbone(mx.arange(n)[None] % 100, cache=cache)
            mx.eval(mx.argmax(head(h), axis=-1))

        return fn

    sizes = sizes or range(1, width * length + 2)
    out = {f"verify_{n}": timed(forward(n)) for n in sizes}
    # A fused drafter reads wider hidden states; any other drafter, the LLM's own.
    ctx = mx.random.normal((getattr(drafter, "context_size", embed.weight.shape[-1]),))
    out["draft"] = timed(
        lambda: mx.eval(drafter.draft(embed, ctx, mx.array(1), width, length, confidences=top_k).tokens)
    )
    probe = Controller(ControllerConfig(top_k=top_k))
    mx.eval(probe.parameters())
    conf = mx.random.uniform(shape=(length, top_k))
    out["controller"] = timed(lambda: mx.eval(probe.depth(conf)))
    out["plain"] = out["verify_1"]
    return out


def curve_latency(latency: Dict[str, float], curve) -> Dict[str, float]:
    """``latency`` with every verify time priced by this device's measured
    verify-cost curve (step/curve.py, pipelined like the generation loop):
    c(N) x one plain step, instead of the few synchronous calls timed here."""
    out = dict(latency)
    for key in latency:
        if key.startswith("verify_"):
            out[key] = latency["plain"] * curve(int(key.split("_")[1]))
    return out


def step_cost(latency: Dict[str, float], tree_size: np.ndarray) -> np.ndarray:
    """Estimated step time (ms) for verifying trees of the given sizes ``[..., L]``
    (depth 1..L). A layer head's table prices each depth's drafting of its own
    (``draft_D``: one more draft call per depth, train/head_controller.py)."""
    table = {int(k.split("_")[1]): v for k, v in latency.items() if k.startswith("verify_")}
    keys = np.array(sorted(table))
    vals = np.array([table[k] for k in keys])
    draft = latency["draft"]
    if "draft_1" in latency:
        draft = np.array([latency[f"draft_{d}"] for d in range(1, tree_size.shape[-1] + 1)])
    return np.interp(tree_size, keys, vals) + draft + latency["controller"]


# --------------------------------------------------------------------------- training


def train_controller(
    episodes: Episodes,
    config: ControllerConfig,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    progress: Optional[Callable[[int, float], None]] = None,
) -> Controller:
    """Policy gradient on recorded episodes (no live interaction with the LLM).

    The return of stopping at depth ``D`` is ``(min(a, D) + 1) / (T(D) /
    T_plain) - alpha * D``. An episode has only ``L`` possible outcomes and
    every one's return is known offline, so the expectation of REINFORCE's
    estimator is computed exactly (the all-actions form): the objective is
    ``sum_D P(D) R(D)`` with ``P(D) = p_1 ... p_{D-1} (1 - p_D)``. Sampled
    REINFORCE collapses to "always stop" here before it explores the rare
    steps where going deeper pays.
    """
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    ctrl = Controller(config)
    length = episodes.confidences.shape[1]
    cost = step_cost(config.latency, episodes.tree_sizes) / config.latency["plain"]  # [n, L]
    depth = np.arange(1, length + 1)[None, :]
    returns = (np.minimum(episodes.accepted[:, None], depth) + 1) / cost - config.alpha * depth
    conf = mx.array(episodes.confidences.astype(np.float32))
    returns = mx.array(returns.astype(np.float32))
    opt = optim.Adam(learning_rate=lr)

    def loss_fn(model, c, r):
        p = mx.sigmoid(model.continue_logits(c)[:, 1:])  # P(verify depth d+1 | depth d verified)
        ones = mx.ones((p.shape[0], 1))
        reach = mx.concatenate([ones, mx.cumprod(p, axis=1)], axis=1)  # P(D >= d)
        stop = mx.concatenate([1 - p, ones], axis=1)
        return -(reach * stop * r).sum(1).mean()

    grad_fn = nn.value_and_grad(ctrl, loss_fn)
    n = len(episodes.accepted)
    for epoch in range(epochs):
        order = rng.permutation(n)
        values = []
        for s in range(0, n, batch_size):
            idx = mx.array(order[s : s + batch_size])
            value, grads = grad_fn(ctrl, conf[idx], returns[idx])
            opt.update(ctrl, grads)
            mx.eval(ctrl.parameters(), opt.state, value)
            values.append(-float(value))
        if progress:
            progress(epoch + 1, float(np.mean(values)))
    return ctrl


def expected_speedup(ctrl_or_depth, episodes: Episodes, latency: Dict[str, float]) -> float:
    """Offline estimate of tokens per plain-step-equivalent for a policy
    (a Controller, or a fixed depth int) on recorded episodes."""
    if isinstance(ctrl_or_depth, int):
        depth = np.full(len(episodes.accepted), ctrl_or_depth)
    else:
        depth = np.array(ctrl_or_depth.depth(mx.array(episodes.confidences.astype(np.float32))))
    cost = step_cost(latency, episodes.tree_sizes) / latency["plain"]
    t = cost[np.arange(len(depth)), depth - 1]
    tokens = np.minimum(episodes.accepted, depth) + 1
    return float(tokens.sum() / t.sum())


# --------------------------------------------------------------------------- fitting for a drafter


@dataclass
class FitReport:
    """What :func:`fit_and_save` measured: offline tokens per plain-step time
    of each fixed depth and of the trained controller."""

    steps: int  # recorded steps (episodes)
    fixed: Dict[int, float]  # depth -> expected speedup
    learned: float
    path: Path  # the saved weights

    @property
    def best_depth(self) -> int:
        return max(self.fixed, key=self.fixed.get)

    @property
    def beats_fixed(self) -> bool:
        return self.learned > self.fixed[self.best_depth]


def fit_and_save(
    model,
    drafter,
    drafter_path,
    prompts: List[List[int]],
    width: int,
    length: int,
    max_tokens: int,
    eos_ids=(),
    epochs: int = 100,
    alpha: float = 0.05,
    seed: int = 0,
    progress: Optional[Callable[[str, int, Optional[int]], None]] = None,
    curve=None,
) -> FitReport:
    """Record greedy ReDrafter steps on ``prompts`` (token ids), measure this
    device's latencies, train the controller and save it next to the
    drafter. ``progress(stage, done, total)`` follows the three stages.
    ``curve``: this device's measured verify-cost curve, which then prices
    the verify calls (:func:`curve_latency`)."""
    tell = progress or (lambda stage, done, total: None)
    config = ControllerConfig(beam_width=width, beam_length=length, alpha=alpha)
    tell("recording", 0, len(prompts))
    episodes = record_episodes(
        model,
        drafter,
        prompts,
        width,
        length,
        max_tokens,
        eos_ids=eos_ids,
        top_k=config.top_k,
        progress=lambda i: tell("recording", i, len(prompts)),
    )
    tell("measuring latency", 0, None)
    latency = measure_latency(model, drafter, width, length, top_k=config.top_k)
    return train_and_save(episodes, config, latency, curve, drafter_path, epochs, seed, tell)


def train_and_save(
    episodes, config: ControllerConfig, latency, curve, folder, epochs: int, seed: int, tell
) -> FitReport:
    """The end of a fit, for any draft source: the measured ``latency`` (priced
    by the device's ``curve`` when given, :func:`curve_latency`), the
    controller trained on the recorded ``episodes``, saved in ``folder``, and
    its expected speed-up against every fixed depth."""
    config.latency = latency if curve is None else curve_latency(latency, curve)
    tell("training", 0, epochs)
    controller = train_controller(
        episodes, config, epochs=epochs, seed=seed, progress=lambda e, _: tell("training", e, epochs)
    )
    path = save_controller(controller, folder) / WEIGHTS
    fixed = {d: expected_speedup(d, episodes, config.latency) for d in range(1, config.beam_length + 1)}
    learned = expected_speedup(controller, episodes, config.latency)
    return FitReport(len(episodes.accepted), fixed, learned, path)
