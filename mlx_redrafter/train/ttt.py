"""Training-time test (EAGLE-3): an EAGLE-3 head trained on its own earlier
predictions, over windows of distilled sequences.

At inference the head first reads the target's taps at every accepted
position (its KV cache holds those), then drafts by calling itself on its own
output: call ``k`` at origin ``i`` reads the head's state from call ``k - 1``
and the token drafted there, at position ``i + k - 1``, and attends to the
cached positions ``<= i`` and to its own chain's earlier calls. Training
unrolls exactly that for every origin of a window at once (teacher-forced
tokens, the head's own states): step 1 is causal attention over the window;
step ``k`` attends to step 1's keys at ``j <= i`` and to the keys of steps
``2..k`` at the same origin ``i`` (the diagonal). :func:`ttt_logits` is tested
against the head's own cached inference calls.

A window is ``S`` positions of one sequence (prompt positions, then the
reply). Position ``i`` pairs the target's taps there with the token they
produced, and the output of step ``k`` is trained on the target's own token
``k`` positions later: its reply token, or at a prompt position the top-1 of
its stored top-k (``llm_labels``), plus ``soft_weight`` times the KL to that
top-k; step ``k`` weighs ``depth_decay ** (k - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .examples import is_eval_conversation, llm_labels, soft_targets
from .loss import kl_to_soft
from .shards import Corpus

# --------------------------------------------------------------------------- the forward


def _project(attn, x: mx.array, offset: int):
    """Queries, keys and values of ``x [B, S, 2H]`` at positions ``offset + j``."""
    B, S, _ = x.shape
    q = attn.q_proj(x).reshape(B, S, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def ttt_attention(q: mx.array, keys: List[mx.array], values: List[mx.array], scale: float) -> mx.array:
    """``[B, heads, S, d]``: queries over step 1's keys (causal) and every later step's key at the same origin."""
    B, nh, S, d = q.shape
    nkv = keys[0].shape[1]
    q = q.reshape(B, nkv, nh // nkv, S, d) * scale
    first = q @ keys[0][:, :, None].swapaxes(-1, -2)  # [B, kv, rep, S, S]
    causal = mx.tril(mx.ones((S, S), dtype=mx.bool_))
    scores = [mx.where(causal, first, mx.array(-1e30, first.dtype))]
    scores += [(q * k[:, :, None]).sum(-1, keepdims=True) for k in keys[1:]]
    p = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
    out = p[..., :S] @ values[0][:, :, None]
    for m, v in enumerate(values[1:]):
        out = out + p[..., S + m : S + m + 1] * v[:, :, None]
    return out.reshape(B, nh, S, d)


def ttt_logits(head, taps: mx.array, tokens: mx.array, depth: int) -> List[mx.array]:
    """The head's logits ``[B, S, Vd]`` for steps ``1..depth`` of a window.

    ``taps [B, S, 3h]``: the target's taps at the window's positions;
    ``tokens [B, S + depth - 1]``: the tokens there and after (step ``k`` reads
    ``tokens[:, k - 1 : k - 1 + S]``)."""
    layer = head.layers[0]
    attn = layer.self_attn
    S = taps.shape[1]
    state, keys, values, out = head.fuse(taps), [], [], []
    for k in range(depth):
        x, residual = layer.inputs(head.embed(tokens[:, k : k + S]).astype(state.dtype), state)
        q, key, value = _project(attn, x, offset=k)
        keys.append(key)
        values.append(value)
        o = ttt_attention(q, keys, values, attn.scale)
        state = layer.finish(residual, attn.o_proj(o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1)))
        out.append(head.logits(state))
    return out


# --------------------------------------------------------------------------- windows and batches


@dataclass
class Window:
    """What one training step reads (``B`` windows of ``S`` positions, ``D`` steps)."""

    taps: mx.array  # [B, S, 3h]
    tokens: mx.array  # [B, S + D - 1]
    targets: mx.array  # [B, S, D] draft-vocabulary index of the target's token k positions later
    mask: mx.array  # [B, S, D] the origin counts, the target exists and is in the draft vocabulary
    valid: mx.array  # [B, S, D] the origin counts and the target exists
    soft_ids: Optional[mx.array] = None  # [B, S, D, k]
    soft_p: Optional[mx.array] = None  # [B, S, D, k]


def window_starts(corpus: Corpus, size: int, fraction: float, held: bool, share=None):
    """``(starts, ends)``: windows of ``size`` positions tiling each sequence of
    the training (``held=False``) or held-out conversations."""
    starts, ends = [], []
    for k, cid in enumerate(corpus.ids):
        if is_eval_conversation(cid, fraction) != held or (share is not None and not share(cid)):
            continue
        a, b = int(corpus.offsets[k]), int(corpus.offsets[k + 1])
        for s in range(a, b - 1, size):
            starts.append(s)
            ends.append(b)
    return np.array(starts, np.int64), np.array(ends, np.int64)


class WindowBatcher:
    """Gathers :class:`Window` s from a corpus distilled with the head's taps (``features``)."""

    def __init__(self, corpus: Corpus, starts, ends, size: int, depth: int, vocab_map, origins, soft: bool = False):
        self.taps = mx.array(corpus.extra["features"])  # float16, on device
        self.last = len(corpus.tokens) - 1  # gathers past the end read the last position (masked)
        self.tokens, self.labels = corpus.tokens, llm_labels(corpus)
        self.origins = origins  # [T] bool: positions that count as origins (reply-only for held-out)
        self.starts, self.ends, self.size, self.depth, self.vocab_map = starts, ends, size, depth, vocab_map
        self.soft = (corpus.extra["topk_ids"], corpus.extra["topk_logits"]) if soft else None

    def batch(self, idx: np.ndarray) -> Window:
        S, D = self.size, self.depth
        start, end = self.starts[idx][:, None], self.ends[idx][:, None]
        at = np.minimum(start + np.arange(S + D)[None], self.last)  # [B, S + D]
        pos = start + np.arange(S)[None]  # [B, S]
        origin = (pos < end - 1) & self.origins[np.minimum(pos, self.last)]
        later = pos[..., None] + np.arange(1, D + 1)  # [B, S, D]: the targets' positions
        valid = origin[..., None] & (later < end[..., None])
        tgt = at[:, 1:][:, np.arange(S)[:, None] + np.arange(D)[None]]  # at[:, j + k] for k = 1..D
        targets = self.vocab_map[self.labels[tgt]]
        mask = valid & (targets >= 0)
        out = Window(
            self.taps[mx.array(at[:, :S])],
            mx.array(self.tokens[at[:, : S + D - 1]]),
            mx.array(np.maximum(targets, 0)),
            mx.array(mask),
            mx.array(valid),
        )
        if self.soft is not None:
            sid, sp = soft_targets(self.soft[0][tgt], self.soft[1][tgt], self.vocab_map)
            out.soft_ids, out.soft_p = mx.array(sid), mx.array(sp * mask[..., None])
        return out


# --------------------------------------------------------------------------- loss and evaluation


def ttt_loss(head, w: Window, weights: mx.array, soft_weight: float = 0.0):
    """``(loss, (per-step cross-entropy, logits))``, each step's mean over its counted targets."""
    steps = ttt_logits(head, w.taps, w.tokens, w.targets.shape[-1])
    logits = mx.stack(steps, axis=2)  # [B, S, D, Vd]
    ce = nn.losses.cross_entropy(logits, w.targets, reduction="none")
    m = w.mask.astype(ce.dtype)
    count = mx.maximum(m.sum((0, 1)), 1)
    per_step = (ce * m).sum((0, 1)) / count
    total = per_step
    if soft_weight and w.soft_p is not None:
        total = total + soft_weight * kl_to_soft(logits, w.soft_ids, w.soft_p).sum((0, 1)) / count
    return (total * weights).sum(), (per_step, logits)


def evaluate_ttt(head, batcher: WindowBatcher, batch_size: int, max_windows: int = 2000) -> Optional[dict]:
    """Held-out per-step loss and top-1 accuracy, and the expected accepted
    length of one greedy chain (``sum_k P(first k drafts all right)``), over reply origins."""
    n = min(len(batcher.starts), max_windows)
    if n == 0:
        return None
    D = batcher.depth
    loss_sum, right_sum, count, run_sum, origins = mx.zeros(D), mx.zeros(D), mx.zeros(D), 0.0, 0.0
    for s in range(0, n, batch_size):
        w = batcher.batch(np.arange(s, min(s + batch_size, n)))
        _, (per_step, logits) = ttt_loss(head, w, mx.ones(D))
        right = (mx.argmax(logits, -1) == w.targets) & w.mask
        first = w.valid[..., 0].astype(mx.float32)
        loss_sum = loss_sum + per_step * w.mask.sum((0, 1))
        right_sum = right_sum + right.astype(mx.float32).sum((0, 1))
        count = count + w.valid.astype(mx.float32).sum((0, 1))
        run_sum = run_sum + (mx.cumprod(right.astype(mx.float32), axis=-1).sum(-1) * first).sum()
        origins = origins + first.sum()
        mx.eval(loss_sum, right_sum, count, run_sum, origins)
    c = np.maximum(np.array(count, np.float64), 1)
    return {
        "eval_loss": [round(float(x), 4) for x in np.array(loss_sum) / c],
        "eval_acc": [round(float(x), 4) for x in np.array(right_sum) / c],
        "eval_accepted_w1": round(float(run_sum) / max(float(origins), 1.0), 4),
        "eval_examples": int(float(origins)),
    }
