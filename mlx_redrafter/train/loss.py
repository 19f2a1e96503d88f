"""The drafter's training loss (cross-entropy plus the KL to the LLM's
soft targets, weighed by depth) and its evaluation on held-out examples."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft.redrafter import Drafter
from .examples import Batch, Batcher


def depth_weights(cfg) -> mx.array:
    return mx.array(cfg.depth_decay ** np.arange(cfg.depth), dtype=mx.float32)


def kl_to_soft(logits: mx.array, soft_ids: mx.array, soft_p: mx.array) -> mx.array:
    """``KL(p || q)`` per position, ``[...]``: ``p`` given on ``soft_ids``
    (zero elsewhere), ``q = softmax(logits)``."""
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    logq = mx.take_along_axis(logq, soft_ids, axis=-1)
    logp = mx.log(mx.maximum(soft_p, 1e-30))
    return (soft_p * (logp - logq)).sum(-1)


def drafter_loss(drafter: Drafter, embed, batch: Batch, count=None, weights=None, soft_weight: float = 0.0):
    """``(loss, (per_depth_ce, logits))``: the depth-weighted sum of the mean
    cross-entropy (plus ``soft_weight`` x KL to the soft targets) of the
    counted targets. ``count`` (per depth) defaults to this batch's own count;
    data-parallel training passes the whole batch's, so that the ranks'
    gradients add up. ``per_depth_ce`` is the hard-label cross-entropy alone."""
    logits = drafter(drafter.context(batch.context), embed(batch.inputs))  # [B, T, Vd]
    ce = nn.losses.cross_entropy(logits, batch.targets, reduction="none")  # [B, T]
    m = batch.mask.astype(ce.dtype)
    count = mx.maximum(m.sum(0), 1) if count is None else count
    per_depth = (ce * m).sum(0) / count
    total = per_depth
    if soft_weight and batch.soft_p is not None:
        total = total + soft_weight * kl_to_soft(logits, batch.soft_ids, batch.soft_p).sum(0) / count
    if weights is not None:
        total = total * weights
    return total.sum(), (per_depth, logits)


def evaluate(drafter, embed, batcher: Batcher, batch_size: int, max_examples: int = 20_000):
    """Per-depth loss, top-1 accuracy, and the expected accepted length of a
    single greedy beam (``sum_k P(first k drafts all right)``)."""
    n = min(len(batcher.examples.positions), max_examples)
    if n == 0:
        return None
    order = np.random.default_rng(0).permutation(len(batcher.examples.positions))[:n]
    loss_sum, right_sum, count, run_sum = 0.0, 0.0, 0.0, 0.0
    for s in range(0, n, batch_size):
        b = batcher.batch(order[s : s + batch_size])
        _, (per_depth, logits) = drafter_loss(drafter, embed, b)
        right = (mx.argmax(logits, -1) == b.targets) & b.mask
        vf = b.valid.astype(mx.float32)
        rows = b.valid[:, 0].astype(mx.float32)
        run = mx.cumprod(right.astype(mx.float32), axis=1).sum(1)  # accepted prefix length
        loss_sum = loss_sum + per_depth * b.mask.sum(0)
        right_sum = right_sum + right.astype(mx.float32).sum(0)
        count = count + vf.sum(0)
        run_sum = run_sum + (run * rows).sum()
    mx.eval(loss_sum, right_sum, count, run_sum)
    count_np = np.maximum(np.array(count), 1)
    return {
        "eval_loss": (np.array(loss_sum) / count_np).round(4).tolist(),
        "eval_acc": (np.array(right_sum) / count_np).round(4).tolist(),
        "eval_accepted_w1": round(float(run_sum) / n, 4),
        "eval_examples": n,
    }
