"""Training examples from distilled data: the held-out split, the draft
vocabulary, the LLM's soft targets, and the batches the trainer reads."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .shards import Corpus


def is_eval_conversation(conv_id: str, fraction: float) -> bool:
    """Deterministic held-out split by conversation id."""
    return (zlib.crc32(conv_id.encode()) % 10_000) < fraction * 10_000


@dataclass
class Examples:
    """Positions usable as training examples, with the arrays to gather from."""

    positions: np.ndarray  # [n] index of g0 in the corpus
    seq_end: np.ndarray  # [T_total] end offset of each position's sequence


def repeated_windows(tokens: np.ndarray, width: int) -> np.ndarray:
    """``[len(tokens)]`` bool: the ``width`` tokens starting here already
    occurred earlier in the same sequence (the reply is looping)."""
    seen, out = set(), np.zeros(len(tokens), bool)
    for i in range(len(tokens) - width + 1):
        key = tokens[i : i + width].tobytes()
        out[i] = key in seen
        seen.add(key)
    return out


def in_share(conv_id: str, share: float) -> bool:
    """Deterministic nested subset of the conversations (independent of the held-out split)."""
    return (zlib.crc32(b"share:" + conv_id.encode()) % 10_000) < share * 10_000


def split_examples(corpus: Corpus, fraction: float, skip_repeats: int = 0, share: float = 1.0, prompts: bool = True):
    """Train / held-out examples, split by conversation; ``share`` < 1 keeps
    that share of the training conversations (the held-out set is unchanged).
    Held-out examples are reply positions only; training ones include the
    prompts' positions the data holds unless ``prompts=False``.

    With ``skip_repeats = n``, training positions whose next ``n`` tokens
    repeat a window seen earlier in the same reply are left out: small LLMs
    loop, and memorizing one reply's loop teaches the drafter nothing about
    the next reply. Held-out examples keep every position.
    """
    ends = np.zeros(len(corpus.tokens), np.int64)
    train, held = [], []
    for k, cid in enumerate(corpus.ids):
        a, b = corpus.offsets[k], corpus.offsets[k + 1]
        ends[a:b] = b
        pos = np.arange(a, b - 1)  # at least one target token after g0
        reply = corpus.reply[a : b - 1] if corpus.reply is not None else np.ones(len(pos), bool)
        if is_eval_conversation(cid, fraction):
            held.append(pos[reply])
            continue
        if share < 1 and not in_share(cid, share):
            continue
        if skip_repeats:
            fresh = ~repeated_windows(corpus.tokens[a:b], skip_repeats + 1)[: b - a - 1]
            pos, reply = pos[fresh], reply[fresh]
        train.append(pos if prompts else pos[reply])
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return Examples(cat(train), ends), Examples(cat(held), ends)


def choose_draft_vocab(tokens: np.ndarray, size: int, vocab_size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent tokens of the distilled replies (plus ``always``)."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    for t in always:
        counts[t] = np.inf
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


@dataclass
class Batch:
    context: mx.array  # [B, c] the drafter's context (hidden state, with features when fused)
    inputs: mx.array  # [B, T] g0 .. g_{T-1}
    targets: mx.array  # [B, T] draft-vocabulary indices of g1 .. g_T
    mask: mx.array  # [B, T] target exists and is in the draft vocabulary
    valid: mx.array  # [B, T] target exists
    soft_ids: Optional[mx.array] = None  # [B, T, k] draft-vocabulary indices of the LLM's top-k
    soft_p: Optional[mx.array] = None  # [B, T, k] their probabilities, renormalized (0 outside)


def soft_targets(ids: np.ndarray, logits: np.ndarray, vocab_map: np.ndarray):
    """The LLM's top-k (``ids``, ``logits``, ``[..., k]``) as a distribution
    over the draft vocabulary: ``(indices, probabilities)``; ids outside it
    get probability 0 and the rest are renormalized."""
    idx = vocab_map[ids]
    lg = np.where(idx >= 0, logits.astype(np.float32), -np.inf)
    top = lg.max(-1, keepdims=True)
    e = np.exp(lg - np.where(np.isfinite(top), top, 0))
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.maximum(total, 1e-30), 0.0)
    return np.maximum(idx, 0), p.astype(np.float32)


def llm_labels(corpus: Corpus) -> np.ndarray:
    """``[T]`` the LLM's greedy token at each position: the token itself,
    except at prompt positions, where it is the top-1 of the stored top-k."""
    if corpus.reply is None or corpus.reply.all() or not corpus.soft_targets:
        return corpus.tokens
    top1 = corpus.extra["topk_ids"][np.arange(len(corpus.tokens)), corpus.extra["topk_logits"].argmax(1)]
    return np.where(corpus.reply, corpus.tokens, top1).astype(np.int32)


def reply_tokens(corpus: Corpus) -> np.ndarray:
    return corpus.tokens if corpus.reply is None else corpus.tokens[corpus.reply]


class Batcher:
    """Gathers :class:`Batch` es from the corpus."""

    def __init__(
        self,
        corpus: Corpus,
        examples: Examples,
        depth: int,
        vocab_map: np.ndarray,
        soft: bool = False,
        fuse: bool = False,
    ):
        context = corpus.hidden
        if fuse:  # [features..., last]: the layout Drafter.context expects
            context = np.concatenate([corpus.extra["features"], corpus.hidden], axis=1)
        self.hidden = mx.array(context)  # float16, on device
        self.tokens = np.concatenate([corpus.tokens, np.zeros(depth + 1, np.int32)])
        # The labels are the LLM's own next tokens: the text itself in replies,
        # its top-1 prediction at a prompt's positions (where the text is the user's).
        self.labels = np.concatenate([llm_labels(corpus), np.zeros(depth + 1, np.int32)])
        self.soft = None
        if soft:
            k = corpus.extra["topk_ids"].shape[1]
            pad = lambda a: np.concatenate([a, np.zeros((depth + 1, k), a.dtype)])  # noqa: E731
            self.soft = (pad(corpus.extra["topk_ids"]), pad(corpus.extra["topk_logits"]))
        self.examples = examples
        self.depth = depth
        self.vocab_map = vocab_map  # full id -> draft index, or -1

    def batch(self, idx: np.ndarray) -> Batch:
        pos = self.examples.positions[idx]
        k = np.arange(self.depth + 1)
        at = pos[:, None] + k[None, :]
        ids = self.tokens[at]  # g0 .. g_T
        valid = at[:, 1:] < self.examples.seq_end[pos][:, None]
        targets = self.vocab_map[self.labels[at[:, 1:]]]
        mask = valid & (targets >= 0)
        out = Batch(
            self.hidden[mx.array(pos)].astype(mx.float32),
            mx.array(ids[:, :-1]),
            mx.array(np.maximum(targets, 0)),
            mx.array(mask),
            mx.array(valid),
        )
        if self.soft is not None:
            sid, sp = soft_targets(self.soft[0][at[:, 1:]], self.soft[1][at[:, 1:]], self.vocab_map)
            out.soft_ids, out.soft_p = mx.array(sid), mx.array(sp * mask[..., None])
        return out
