"""Beam search with the recurrent drafter: fixed shapes, no host sync.

Conventions: ``length`` counts drafted tokens only (the official code's
``beam_length`` also counts the LLM's own token ``g0``, so its
``beam_length=4`` is our ``length=3``). Beams come back sorted by score, best
first, as in the official PyTorch code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

NEG = -1e9  # score of the beams that do not exist yet at step 1
LOG_0 = -50000.0  # the official code's "log 0" for warped logits
WARP_TOP_K = 50


@dataclass
class Beams:
    tokens: mx.array  # [W, L] drafted token ids (g0 excluded)
    scores: mx.array  # [W] cumulative log-probabilities, float32, descending
    logprobs: Optional[mx.array] = None  # [W, L, V_draft] per-step draft log-softmax
    confidences: Optional[mx.array] = None  # [W, L, k] top-k draft probabilities, descending
    path_scores: Optional[mx.array] = None  # [W, L] cumulative log-probability of each beam's prefix of j+1 tokens


def warp_logits(logits: mx.array, top_k: int = WARP_TOP_K) -> mx.array:
    """The official inference warping: subtract the row max, then set every
    logit below the ``top_k``-th largest to ``LOG_0`` (ties are kept)."""
    logits = logits - logits.max(axis=-1, keepdims=True)
    if logits.shape[-1] <= top_k:
        return logits
    kth = mx.topk(logits, top_k, axis=-1).min(axis=-1, keepdims=True)
    return mx.where(logits < kth, LOG_0, logits)


def top_w(scores: mx.array, width: int) -> mx.array:
    """Indices of the ``width`` largest entries of a 1-D array, best first."""
    if width == 1:
        return mx.argmax(scores, keepdims=True)
    part = mx.argpartition(-scores, kth=width - 1)[:width]
    return part[mx.argsort(-scores[part])]


def beam_search(
    drafter,
    embed,
    context: mx.array,
    g0: mx.array,
    width: int,
    length: int,
    warp: bool = False,
    return_logprobs: bool = False,
    confidences: int = 0,
) -> Beams:
    """Draft ``width`` beams of ``length`` tokens after ``g0``.

    Args:
        drafter: a :class:`~mlx_redrafter.draft.redrafter.Drafter`.
        embed: the LLM's input embedding (called on token ids).
        context: ``[h]`` the LLM's post-norm hidden state that produced ``g0``.
        g0: scalar token id chosen by the LLM.
        warp: apply the official max-subtraction + top-50 warping.
        return_logprobs: also return each beam's per-step draft log-softmax.
        confidences: also return the top-``k`` probabilities of each beam's
            per-step draft distribution (the adaptive controller's input).

    Scores are cumulative log-softmax probabilities; each step keeps the top
    ``width`` of ``width x V`` candidates. Everything stays lazy.
    """
    if width < 1 or length < 1:
        raise ValueError(f"beam width and length must be >= 1 (got W={width}, L={length})")
    context = drafter.context(context)  # fuses intermediate-layer features, when the drafter has them
    tokens = mx.broadcast_to(g0.reshape(1).astype(mx.int32), (width,))
    state = mx.zeros((width, context.shape[-1]), dtype=context.dtype)
    scores = mx.array([0.0] + [NEG] * (width - 1), dtype=mx.float32)
    history = mx.zeros((width, 0), dtype=mx.int32)
    path_scores = mx.zeros((width, 0), dtype=mx.float32)
    lp_history = None
    conf_history = None
    for _ in range(length):
        state = drafter.state_step(state, embed(tokens))
        logits = drafter.logits(context, state).astype(mx.float32)
        if warp:
            logits = warp_logits(logits)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        vocab = logp.shape[-1]
        idx = top_w((scores[:, None] + logp).reshape(-1), width)
        parent = idx // vocab
        scores = (scores[:, None] + logp).reshape(-1)[idx]
        tokens = drafter.token_ids(idx % vocab).astype(mx.int32)
        state = state[parent]
        history = mx.concatenate([history[parent], tokens[:, None]], axis=1)
        # Each prefix's own score: the selection of verified nodes needs every depth's (lazy, unused otherwise).
        path_scores = mx.concatenate([path_scores[parent], scores[:, None]], axis=1)
        if return_logprobs:
            step_lp = logp[parent][:, None]
            lp_history = step_lp if lp_history is None else mx.concatenate([lp_history[parent], step_lp], axis=1)
        if confidences:
            top = mx.sort(mx.topk(logp, confidences, axis=-1), axis=-1)[:, ::-1]
            step_conf = mx.exp(top[parent])[:, None]
            conf_history = (
                step_conf if conf_history is None else mx.concatenate([conf_history[parent], step_conf], axis=1)
            )
    return Beams(history, scores, lp_history, conf_history, path_scores)
