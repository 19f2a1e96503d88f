"""The DFlash drafter's training forward and data (train/dflash_trainer.py
runs them): windows of distilled sequences, random anchor blocks in them,
the forward that is the drafter's own inference for every block at once
(:func:`train_hidden`), the decaying block-wise loss and the held-out
evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft.dflash import DFlashDrafter
from .examples import llm_labels
from .shards import Corpus


def _rope_blocks(rope, x: mx.array, anchors: mx.array, size: int) -> mx.array:
    """RoPE of ``x [B, heads, N * K, d]``, block ``n`` at positions ``anchors[:, n] + 0..K-1``."""
    b, heads, nk, d = x.shape
    n = nk // size
    blocks = x.reshape(b, heads, n, size, d).transpose(0, 2, 1, 3, 4).reshape(b * n, heads, size, d)
    rotated = rope(blocks, offset=anchors.reshape(-1))
    return rotated.reshape(b, n, heads, size, d).transpose(0, 2, 1, 3, 4).reshape(b, heads, nk, d)


def train_hidden(drafter: DFlashDrafter, taps: mx.array, blocks: mx.array, anchors: mx.array) -> mx.array:
    """The blocks' final states ``[B, N * K, H]``: ``taps [B, S, F]`` of a window,
    ``blocks [B, N, K]`` (an anchor token, then masks) at window positions
    ``anchors [B, N]``. A block attends to the context before its anchor and
    to itself (see the module doc); every layer's context keys come from the
    same fused taps, as at inference (:meth:`DFlashDrafter.context`)."""
    b, s, _ = taps.shape
    n, k = blocks.shape[1:]
    ctx = drafter.fuse(taps)
    embed = drafter._bound()[0]
    x = embed(blocks.reshape(b, n * k)).astype(ctx.dtype)
    before = mx.arange(s)[None, None, :] < anchors[:, :, None]  # [B, N, S]: context before each anchor
    ctx_mask = mx.repeat(before, k, axis=1)  # [B, N * K, S]
    own = mx.arange(n * k) // k
    blk_mask = mx.broadcast_to((own[:, None] == own[None, :])[None], (b, n * k, n * k))
    mask = mx.concatenate([ctx_mask, blk_mask], axis=-1)[:, None]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = _rope_blocks(drafter.rope, attn.q_norm(attn._heads(attn.q_proj(h), attn.n_heads)), anchors, k)
        kb = _rope_blocks(drafter.rope, attn.k_norm(attn._heads(attn.k_proj(h), attn.n_kv_heads)), anchors, k)
        vb = attn._heads(attn.v_proj(h), attn.n_kv_heads)
        kc, vc = attn.keys_values(ctx, drafter.rope, 0)
        keys, values = mx.concatenate([kc, kb], axis=2), mx.concatenate([vc, vb], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n * k, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@dataclass
class Blocks:
    """What one training step reads: ``B`` windows of ``S`` positions, ``N`` blocks of ``K``."""

    taps: mx.array  # [B, S, F]
    blocks: mx.array  # [B, N, K]
    anchors: mx.array  # [B, N] window positions
    targets: mx.array  # [B, N, K - 1] the LLM's token k places after each anchor
    mask: mx.array  # [B, N, K - 1] the target exists


class BlockBatcher:
    """Windows of a corpus distilled with the drafter's taps, and random anchors in them."""

    def __init__(self, corpus: Corpus, starts, ends, cfg, mask_id: int, origins):
        """``cfg``: a :class:`~mlx_redrafter.train.dflash_trainer.DFlashTrainConfig` (window, anchors, block)."""
        self.taps = mx.array(corpus.extra["features"])  # float16, on device
        self.tokens, self.labels, self.last = corpus.tokens, llm_labels(corpus), len(corpus.tokens) - 1
        self.starts, self.ends, self.cfg, self.mask_id, self.origins = starts, ends, cfg, mask_id, origins

    def batch(self, idx: np.ndarray, rng: np.random.Generator) -> Blocks:
        cfg = self.cfg
        s, n, k = cfg.window, cfg.anchors, cfg.block_size
        start, end = self.starts[idx][:, None], self.ends[idx][:, None]
        pos = start + np.arange(s)[None]  # [B, S]
        at = np.minimum(pos, self.last)
        # Anchors: positions of the window with context before them and a next token in their sequence.
        ok = (pos < end - 1) & (np.arange(s)[None] >= 1) & self.origins[at]
        anchors = np.stack([_pick(rng, np.nonzero(row)[0], n) for row in ok])  # [B, N]
        absolute = start + anchors  # [B, N]
        later = absolute[..., None] + np.arange(1, k)  # [B, N, K-1]
        valid = (later < end[..., None]) & ok[np.arange(len(idx))[:, None], anchors][..., None]
        blocks = np.full((len(idx), n, k), self.mask_id, np.int32)
        blocks[..., 0] = self.tokens[np.minimum(absolute, self.last)]
        return Blocks(
            self.taps[mx.array(at)],
            mx.array(blocks),
            mx.array(anchors.astype(np.int32)),
            mx.array(self.labels[np.minimum(later, self.last)].astype(np.int32)),
            mx.array(valid),
        )


def _pick(rng, choices: np.ndarray, n: int) -> np.ndarray:
    if len(choices) == 0:
        return np.ones(n, np.int64)  # a window with no anchor: its blocks are all masked out (valid False)
    return rng.choice(choices, n, replace=len(choices) < n)


def block_loss(drafter: DFlashDrafter, head_w: mx.array, b: Blocks, weights: mx.array):
    """``(loss, (per-slot cross-entropy, logits))``: the decaying block-wise cross-entropy."""
    hidden = train_hidden(drafter, b.taps, b.blocks, b.anchors)
    n, k = b.blocks.shape[1:]
    hidden = hidden.reshape(hidden.shape[0], n, k, -1)[:, :, 1:]  # the drafts' slots
    logits = hidden @ head_w.T  # [B, N, K-1, V]: the target's LM head
    ce = nn.losses.cross_entropy(logits, b.targets, reduction="none")
    m = b.mask.astype(ce.dtype)
    per_slot = (ce * m).sum((0, 1)) / mx.maximum(m.sum((0, 1)), 1)
    return (per_slot * weights).sum() / weights.sum(), (per_slot, logits)


def evaluate(drafter, head_w, batcher: BlockBatcher, batch_size: int, max_windows: int = 400) -> Optional[dict]:
    """Held-out per-slot loss and top-1 accuracy, and the expected accepted
    length of the block as one chain (``sum_k P(first k drafts right)``)."""
    n = min(len(batcher.starts), max_windows)
    if n == 0:
        return None
    k = batcher.cfg.block_size - 1
    rng = np.random.default_rng(1234)
    ones = mx.ones(k)
    loss_sum, right_sum, count, run_sum, blocks = mx.zeros(k), mx.zeros(k), mx.zeros(k), 0.0, 0.0
    for s in range(0, n, batch_size):
        b = batcher.batch(np.arange(s, min(s + batch_size, n)), rng)
        _, (per_slot, logits) = block_loss(drafter, head_w, b, ones)
        right = ((mx.argmax(logits, -1) == b.targets) & b.mask).astype(mx.float32)
        first = b.mask[..., 0].astype(mx.float32)
        loss_sum = loss_sum + per_slot * b.mask.sum((0, 1))
        right_sum, count = right_sum + right.sum((0, 1)), count + b.mask.astype(mx.float32).sum((0, 1))
        run_sum = run_sum + (mx.cumprod(right, axis=-1).sum(-1) * first).sum()
        blocks = blocks + first.sum()
        mx.eval(loss_sum, right_sum, count, run_sum, blocks)
    c = np.maximum(np.array(count, np.float64), 1)
    return {
        "eval_loss": [round(float(x), 4) for x in np.array(loss_sum) / c],
        "eval_acc": [round(float(x), 4) for x in np.array(right_sum) / c],
        "eval_accepted_w1": round(float(run_sum) / max(float(blocks), 1.0), 4),
        "eval_examples": int(float(blocks)),
    }
